"""Stage `train` on synthetic logged rows: metrics contract, saved models, MLflow runs, errors."""

from __future__ import annotations

import json

import lightgbm as lgb
import numpy as np
import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from specstop.common.errors import SpecstopError
from specstop.common.params import Params, validate
from specstop.common.errors import DataError
from specstop.features import FEATURE_GROUPS, SCHEMA_VERSION, feature_index
from specstop.collection.rows import ROW_SCHEMA, read_parts, write_part
from specstop.collection import data
from specstop.models import experiment
from specstop.models.anchor import fit_anchor, Anchor
from specstop.models.fit_data import fit_data
from specstop.models.mlp import StopNet
from specstop.pipeline import train

from synthetic_rows import make_collect

CONTRACT = {"auc", "log_loss", "brier", "simulated_speedup", "fraction_of_oracle"}
FAST = {"mlp": {"hidden": [32], "max_epochs": 15, "batch_size": 128, "lr": 0.003},
        "lightgbm": {"n_estimators": 60, "num_leaves": 7, "min_child_samples": 10}}


def params_for(tmp_path, **overrides) -> Params:
    return validate({"train": {"data": str(tmp_path / "collect"), "out": str(tmp_path / "train"),
                               "metrics": str(tmp_path / "metrics" / "train.json"),
                               "plots": str(tmp_path / "metrics" / "plots"),
                               "threshold_grid": 40, **FAST, **overrides},
                     "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train")
    make_collect(folder / "collect", prompts={"train": 24, "val": 8}, rounds=20)
    params = params_for(folder, regimes={"draft_cost": [1, 4], "verify_slope": [1, 6]},
                        reach=[0, 1, 3])
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        config, store = params.train, params.mlflow.store("train")
        report = experiment.run(config, store)
    return folder, config, store, report


def test_metrics_follow_the_contract(trained):
    folder, config, store, report = trained
    metrics = json.loads(config.metrics.read_text())
    for name in ("logistic", "lightgbm", "mlp", "fixed", "confidence", "entropy"):
        assert CONTRACT <= set(metrics[name]), name
    assert metrics["oracle"]["simulated_speedup"] >= max(
        m["simulated_speedup"] for n, m in metrics.items()
        if n not in ("oracle", "targets", "replay", "sanity_floor", "ablation"))
    families = ("logistic", "lightgbm", "mlp")
    assert all(0.7 < metrics[f]["auc"] <= 1.0 for f in families)
    assert max(metrics[f]["simulated_speedup"] for f in families) \
        > metrics["fixed"]["simulated_speedup"]
    for kind in ("roc", "calibration", "speedup", "tree_budget"):
        assert any((config.plots / kind).glob("*.csv")), kind


def test_tree_replay_reports_every_policy_against_the_best_static_and_the_oracle(trained):
    folder, config, store, report = trained
    replay = json.loads(config.metrics.read_text())["replay"]
    static = replay["best_static"]
    assert static["method"] in ("static_chain", "static_ti_mcsd", "static_tree", "sequoia")
    policies = replay["policies"]
    assert static["simulated_speedup"] == max(policies[n]["simulated_speedup"] for n in
                                              ("static_chain", "static_tree", "sequoia"))
    for name in ("confidence_tree", "logistic", "lightgbm", "mlp"):
        assert policies[name]["simulated_speedup"] <= replay["oracle"]["simulated_speedup"]
        assert {"expand", "max_width", "rho"} <= set(policies[name])
    winner = replay["winner"]
    assert winner["family"] == json.loads((config.out / "summary.json").read_text())["winner"]
    assert winner["vs_best_static"] == pytest.approx(
        winner["simulated_speedup"] / static["simulated_speedup"])
    assert winner["fraction_of_oracle"] <= 1.0


def test_the_regimes_retune_the_winner_on_each_cost_curve_of_the_grid(trained):
    folder, config, store, report = trained
    replay = json.loads(config.metrics.read_text())["replay"]
    regimes = {(e["draft_cost"], e["verify_slope"]): e for e in replay["regimes"]}
    assert set(regimes) == {(1, 1), (1, 6), (4, 1), (4, 6)}
    same = regimes[(1, 1)]  # the measured curve: the comparison above, figure for figure
    assert same["best_static"] == replay["best_static"]
    assert same["confidence_tree"] == replay["policies"]["confidence_tree"]["simulated_speedup"]
    assert same["winner"]["family"] == replay["winner"]["family"]
    for key in ("simulated_speedup", "vs_best_static", "vs_confidence_tree"):
        assert same["winner"][key] == pytest.approx(replay["winner"][key])
    assert regimes[(4, 1)]["c"] == pytest.approx(4 * same["c"])
    for cheap, dear in [((1, 1), (4, 1)), ((1, 1), (1, 6)), ((4, 1), (4, 6))]:
        # a dearer curve: the static grid (searched exhaustively) and the oracle only slow down
        assert regimes[dear]["best_static"]["simulated_speedup"] \
            < regimes[cheap]["best_static"]["simulated_speedup"]
        assert regimes[dear]["oracle"] < regimes[cheap]["oracle"]
    for slope in (1, 6):
        table = (config.plots / "regimes" / f"verify_slope_{slope}.csv").read_text().split()
        assert table[0] == "c,winner_vs_confidence_tree,winner_vs_best_static"
        assert len(table) == 3


def test_the_reach_retunes_the_winner_with_its_predictor_moved_toward_the_outcomes(trained):
    folder, config, store, report = trained
    metrics = json.loads(config.metrics.read_text())
    replay, winner = metrics["replay"], metrics["replay"]["winner"]["family"]
    reach = replay["reach"]
    assert [e["strength"] for e in reach] == [0, 1, 3]
    own = reach[0]  # strength 0: the winner's own p, tuned as in the comparison
    assert own["auc"] == pytest.approx(metrics[winner]["auc"])
    assert own["simulated_speedup"] == pytest.approx(
        replay["policies"][winner]["simulated_speedup"])
    assert own["vs_confidence_tree"] == pytest.approx(replay["winner"]["vs_confidence_tree"])
    assert reach[0]["auc"] < reach[1]["auc"] < reach[2]["auc"] <= 1.0
    assert own["simulated_speedup"] <= reach[2]["simulated_speedup"] \
        <= replay["oracle"]["simulated_speedup"]
    table = (config.plots / "reach.csv").read_text().split()
    assert table[0] == "auc,vs_confidence_tree,vs_best_static" and len(table) == 4


def test_sanity_floor_and_ablation_cover_every_family_and_feature_group(trained):
    folder, config, store, report = trained
    metrics = json.loads(config.metrics.read_text())
    floor = metrics["sanity_floor"]
    assert floor["best_raw_feature"] in data.FEATURE_NAMES and 0.5 <= floor["best_raw_auc"] <= 1
    for family, row in floor["families"].items():
        low, high = row["minus_best_raw_ci95"]
        assert low <= row["auc"] - floor["best_raw_auc"] <= high, family
    ablation = metrics["ablation"]
    assert ablation["family"] == metrics["replay"]["winner"]["family"]
    assert set(ablation) == {"family", "all", *(f"without_{g}" for g in FEATURE_GROUPS)}
    # the synthetic acceptance is a function of q_token alone: holding the draft's own
    # features costs AUC, holding the history (random here) does not
    assert ablation["without_draft"]["auc"] < ablation["without_history"]["auc"]


def test_saved_models_reproduce_the_predictions(trained):
    folder, config, store, report = trained
    X = report.bench.X[:50]
    summary = json.loads((config.out / "summary.json").read_text())
    assert summary["winner"] in ("logistic", "lightgbm", "mlp")
    assert summary["feature_schema_version"] == SCHEMA_VERSION and len(summary["dataset_digest"]) == 64
    lr = json.loads((config.out / "logistic.json").read_text())
    anchor = Anchor.from_dict(lr["anchor"])
    Z = np.concatenate([X, anchor.logit(X)[:, None]], axis=1)
    logit = ((Z - lr["mean"]) / lr["scale"]) @ np.array(lr["coef"]) + lr["intercept"]
    assert 1 / (1 + np.exp(-logit)) == pytest.approx(
        report.entries["logistic"].model.predict_proba(X), abs=1e-5)
    booster = lgb.Booster(model_file=str(config.out / "lightgbm.txt"))
    spec = json.loads((config.out / "lightgbm.json").read_text())
    raw = booster.predict(X, raw_score=True) + Anchor.from_dict(spec["anchor"]).logit(X) \
        - spec["logit_offset"]
    assert 1 / (1 + np.exp(-raw)) == pytest.approx(
        report.entries["lightgbm"].model.predict_proba(X), abs=1e-6)
    spec = json.loads((config.out / "mlp.json").read_text())
    net = StopNet(spec["n_features"], spec["hidden"], spec["dropout"],
                  Anchor.from_dict(spec["anchor"])).eval()
    net.load_state_dict(load_file(config.out / "mlp.safetensors"))
    with torch.no_grad():
        p = torch.sigmoid(net(torch.tensor(X))).numpy()
    assert p == pytest.approx(report.entries["mlp"].model.predict_proba(X), abs=1e-6)


def test_one_mlflow_run_per_family_and_the_baselines(trained):
    import mlflow

    folder, config, store, report = trained
    client = mlflow.MlflowClient(store.uri)
    experiment_id = client.get_experiment_by_name(store.experiment).experiment_id
    runs = {r.info.run_name: r for r in client.search_runs([experiment_id])}
    assert {"logistic", "lightgbm", "mlp", "baselines"} <= set(runs)
    mlp = runs["mlp"].data
    for key in ("auc", "log_loss", "brier", "calibration_error", "simulated_speedup",
                "fraction_of_oracle", "decision_latency_ms"):
        assert key in mlp.metrics
    assert len(mlp.params["dataset_digest"]) == 64 \
        and mlp.params["feature_schema_version"] == str(SCHEMA_VERSION)
    artifacts = {a.path for a in client.list_artifacts(runs["lightgbm"].info.run_id)}
    assert {"roc.png", "calibration.png", "speedup_vs_threshold.png",
            "feature_importance.png"} <= artifacts
    baselines = runs["baselines"]
    assert "tree_budget.png" in {a.path for a in client.list_artifacts(baselines.info.run_id)}
    assert "replay.confidence_tree.simulated_speedup" in baselines.data.metrics
    winner = json.loads((config.out / "summary.json").read_text())["winner"]
    parent = runs[f"ablation-{winner}"].info.run_id
    nested = [r for r in runs.values() if r.data.tags.get("mlflow.parentRunId") == parent]
    assert {r.data.params["without"] for r in nested} == set(FEATURE_GROUPS)
    assert all("auc" in r.data.metrics and "tree_speedup" in r.data.metrics for r in nested)


def test_train_prompts_are_held_out_whole():
    groups = np.repeat(np.arange(10), 5)
    y = np.tile([0, 1, 0, 0, 0], 10).astype(np.float32)
    fit = fit_data(np.zeros((50, 2), np.float32), y, groups, "balanced", 0.3, seed=0)
    assert len(fit.y_stop) == 15 and len(fit.y) == 35
    assert fit.logit_offset == pytest.approx(np.log(4))  # 1 positive in 5: odds shifted 4x


def test_the_anchor_is_the_logistic_regression_on_the_logit_of_q_token():
    rng = np.random.default_rng(0)
    X = np.zeros((20000, 3), np.float32)
    X[:, feature_index("q_token")] = q = rng.uniform(0.01, 0.99, 20000)
    truth = 1 / (1 + np.exp(-(2.0 * np.log(q / (1 - q)) - 1.0)))
    soft = fit_anchor(X, truth.astype(np.float32), np.ones(20000, np.float32))
    assert (soft.slope, soft.intercept) == pytest.approx((2.0, -1.0), abs=0.01)
    hard = fit_anchor(X, (rng.uniform(size=20000) < truth).astype(np.float32),
                      np.ones(20000, np.float32))
    assert (hard.slope, hard.intercept) == pytest.approx((2.0, -1.0), abs=0.15)
    assert hard.logit(X) == pytest.approx(hard.slope * np.log(q / (1 - q)) + hard.intercept,
                                          abs=1e-5)


def test_soft_labels_and_a_search_with_nested_runs(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    make_collect(tmp_path / "collect", prompts={"train": 10, "val": 4}, rounds=10)
    params = params_for(tmp_path, label="soft", families=["logistic"], search_trials=2)
    train.run(params)
    metrics = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert metrics["logistic"]["simulated_speedup"] > 0 and "first_rejection_speedup" \
        not in metrics["oracle"]
    runs = mlflow.MlflowClient(params.mlflow.tracking_uri).search_runs(["1"])
    parent = next(r.info.run_id for r in runs if r.info.run_name == "logistic")
    trials = [r for r in runs if r.info.run_name.startswith("logistic-trial-")]
    assert len(trials) == 2 and all(r.data.tags["mlflow.parentRunId"] == parent for r in trials)


def rewrite(folder, change) -> None:
    """Apply `change(dict of columns)` to the train part."""
    path = folder / "parts" / "train-00000.parquet"
    columns = read_parts(folder).to_pydict()
    keep = [i for i, s in enumerate(columns["split"]) if s == "train"]
    columns = {k: [v[i] for i in keep] for k, v in columns.items()}
    change(columns)
    write_part(pa.table(columns, schema=ROW_SCHEMA), path)


def test_bad_inputs_give_one_line_errors(tmp_path):
    with pytest.raises(DataError, match="no logged parts"):
        data.load(tmp_path / "missing")
    folder = make_collect(tmp_path / "collect", prompts={"train": 3, "val": 2}, rounds=3)
    rewrite(folder, lambda c: c.update(label=[0 if v == 1 else v for v in c["label"]]))
    with pytest.raises(DataError, match="split 'train' has one class only"):
        data.load(folder)
    with pytest.raises(SpecstopError, match="one class only"):
        train.run(params_for(tmp_path, families=["logistic"]))
    rewrite(folder, lambda c: c.update(prompt_id=["val-0"] * len(c["prompt_id"])))
    with pytest.raises(DataError, match="prompt 'val-0' is in more than one split"):
        data.load(folder)
    for part in (folder / "parts").glob("*.parquet"):
        write_part(pa.table({n: [] for n in ROW_SCHEMA.names}, schema=ROW_SCHEMA), part)
    with pytest.raises(DataError, match="hold no rows"):
        data.load(folder)
    with pytest.raises(SpecstopError, match="unknown key"):
        validate({"train": {"lerning_rate": 1}})


def test_a_temperature_the_parts_do_not_hold_is_refused_before_any_work(tmp_path):
    make_collect(tmp_path / "collect", prompts={"train": 3, "val": 2}, rounds=3,
                 temperatures=(0.0, 0.7))
    for overrides in ({"replay_temperatures": [1.0]}, {"sampling_temperature": 0.5}):
        with pytest.raises(SpecstopError, match=r"collect: no rounds logged at temperature (1|0.5) "
                           r"\(train.sampling_temperature, train.replay_temperatures; the "
                           r"parts hold 0, 0.7: add it to collect.temperatures\)$"):
            train.run(params_for(tmp_path, **{"sampling_temperature": 0.7, **overrides}))
    assert not (tmp_path / "train").exists() and not (tmp_path / "metrics").exists()


def test_rounds_with_nan_features_are_dropped_and_counted(tmp_path):
    folder = make_collect(tmp_path / "collect", prompts={"train": 3, "val": 2}, rounds=3)
    before = data.load(folder)

    def poison(columns):
        columns["q_token"][0] = float("nan")  # round 0 of the first prompt

    rewrite(folder, poison)
    after = data.load(folder)
    assert after.dropped_rounds == 1
    assert len(after.train.rows) == len(before.train.rows) - 12  # 3 candidates x 4 levels


def test_the_winner_is_reported_against_ar_with_its_round_gate(trained):
    folder, config, store, report = trained
    winner = json.loads(config.metrics.read_text())["replay"]["winner"]
    assert winner["tree_vs_ar"] == pytest.approx(winner["simulated_speedup"])
    assert winner["vs_ar"] >= winner["tree_vs_ar"] > 1.0 and winner["fallback"] is None
    assert winner["round_gate"] == (winner["gated_share"] > 0)
    entry = json.loads((config.out / "summary.json").read_text())["families"][winner["family"]]
    assert entry["gated_speedup"] == winner["vs_ar"] and entry["fallback"] is None
    assert (entry["round_gate"] is not None) == winner["round_gate"]


def test_each_family_names_the_static_shape_that_beat_its_tree(trained):
    """The summary's `static_tree` is the best grid shape where it replayed faster than the
    family's tree behind its gate (and `ar`), else null; the sampling one likewise."""
    folder, config, store, report = trained
    static = json.loads(config.metrics.read_text())["replay"]["policies"]["static_tree"]
    for family, entry in json.loads((config.out / "summary.json").read_text())[
            "families"].items():
        beaten = static["simulated_speedup"] > max(entry["gated_speedup"], 1.0)
        expected = {"widths": static["widths"], "depth": static["depth"],
                    "speedup": static["simulated_speedup"]} if beaten else None
        assert entry["static_tree"] == expected, family
        assert "sampling_static_tree" in entry


@pytest.mark.parametrize("speeds, named", [((1.3, 1.2), True), ((1.2, 1.3), False),
                                           ((0.9, 0.8), False)])
def test_the_static_fallback_needs_the_shape_to_beat_the_tree_and_ar(speeds, named):
    from specstop.models.tree_report import SamplingComparison
    from specstop.replay.tree_replay import TreeResult, Tuned

    static, tree = speeds

    def tuned(name: str, speed: float, setting: dict) -> Tuned:
        return Tuned(name, TreeResult(speed, 2.0, 3.0, 2.0), setting, [])

    comparison = SamplingComparison(0.7, {
        "static_tree": tuned("static_tree", static, {"widths": [3, 1, 1], "depth": 2}),
        "logistic": tuned("logistic", tree, {"expand": 0.1})}, {}, ("logistic",),
        tuned("ceiling", max(speeds), {"expand": 0.1}))
    fallback = comparison.static_fallback("logistic", tree)
    assert fallback == ({"widths": [3, 1, 1], "depth": 2, "speedup": static} if named else None)
