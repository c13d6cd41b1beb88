"""Stage `export` and the TorchScript stopping policy: round trip of every family, metadata,
MLflow registration, one-line errors, the rules' semantics against the simulator, and
`specstop generate --stop-model` on a tiny model."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pandas as pd
import pytest
import torch

from specstop.common.errors import SpecstopError
from specstop.common.params import ExportConfig, SettleConfig
from specstop.decoder.costs import CostCurve, CostModel
from specstop.decoder.loop import DecodeConfig
from specstop.decoder.policy import ConfidenceThreshold, FixedDepth, decoding_rule
from specstop.decoder.stop_model import (BRANCH_WAYS, CONFIDENCE_WAY, LOOKUP_KEYS, LOOKUP_WAY,
                                        STATIC_KEYS, STATIC_WAY, TREE_WAY, LearnedPolicy,
                                        load_stop_model, read_stop_model)
from specstop.decoder.tree_rule import TreeRule
from specstop.features import FEATURES, SCHEMA_VERSION, feature_index
from specstop.drafts.loading import load_runtime
from specstop.models import experiment, scripted, settle
from specstop.models.export import export
from specstop.replay import rules
from specstop.replay.simulate import Replay

from stop_models import linear_module, metadata, write_stop_model
from synthetic_rows import make_collect
from test_cli import SUMMARY, run_specstop
from test_train import params_for

DEPTH, Q_TOKEN = feature_index("depth"), feature_index("q_token")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Synthetic rows -> stage train (every family) -> stage export, in a temp folder."""
    folder = tmp_path_factory.mktemp("export")
    make_collect(folder / "collect", prompts={"train": 16, "val": 6}, rounds=12,
                 temperatures=(0.0, 0.7, 1.0))
    params = params_for(folder, sampling_temperature=0.7, replay_temperatures=[1.0])
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        store = params.mlflow.store("train")
        report = experiment.run(params.train, store)
        config = ExportConfig(train=folder / "train", data=folder / "collect",
                              out=folder / "export", metrics=folder / "metrics" / "export.json")
        metrics = export(config, store)
    return config, store, report, metrics


def test_every_family_predicts_as_trained(exported):
    config, store, report, metrics = exported
    X = report.bench.X
    for family in ("logistic", "lightgbm", "mlp"):
        module, meta = read_stop_model(config.out / f"{family}.pt")
        with torch.inference_mode():
            p = module(torch.tensor(X)).double().numpy()
        assert np.max(np.abs(p - report.entries[family].model.predict_proba(X))) <= 1e-5, family
        assert metrics["families"][family]["max_abs_diff"] <= 1e-5
        assert metrics["families"][family]["decision_latency_ms"] > 0


def test_files_carry_their_metadata(exported):
    config, store, report, metrics = exported
    summary = json.loads((config.train / "summary.json").read_text())
    for family in ("logistic", "lightgbm", "mlp"):
        _, meta = read_stop_model(config.out / f"{family}.pt")
        entry = summary["families"][family]
        assert meta["features"] == [f.name for f in FEATURES]
        assert meta["feature_schema_version"] == SCHEMA_VERSION
        assert (meta["family"], meta["rule"], meta["threshold"], meta["rho"]) == \
            (family, entry["rule"], entry["threshold"], entry["rho"])
        assert meta["marginal_cost"] == entry["marginal_cost"]
        assert meta["dataset_digest"] == summary["dataset_digest"]
        assert meta["mlflow_run_id"] == entry["run_id"]
        assert meta["tree_rule"] == entry["tree_rule"] and meta["tree_costs"] is None
        policy = LearnedPolicy(*read_stop_model(config.out / f"{family}.pt"))
        assert policy.tree_rule == TreeRule.from_dict(entry["tree_rule"])
        # sampled, the policy decodes with the rule tuned on the sampled rounds
        assert meta["sampling_temperature"] == 0.7 and meta["sampling_tree_speedup"] > 0
        assert policy.sampling_rule == TreeRule.from_dict(entry["sampling_tree_rule"])
        assert policy.sampling_rule.rank_accept and not policy.sampling_rule.prune
        assert decoding_rule(policy, greedy=False) == policy.sampling_rule
        assert decoding_rule(policy, greedy=True) is policy.tree_rule
    replay = json.loads(report.bench.config.metrics.read_text())["replay"]
    sampled = replay["sampling"]
    assert sampled["temperature"] == 0.7 and sampled["winner"]["family"] in summary["families"]
    assert sampled["best_static"]["method"] in sampled["policies"]
    # the ceiling: the same rule knowing each node's exact acceptance, above every model's
    best = max(sampled["policies"][n]["simulated_speedup"]
               for n in ("confidence_tree", *summary["families"]))
    assert sampled["ceiling"]["simulated_speedup"] >= best
    # T 1.0 replayed for the report: its own tuned policies, not the exported rule
    hot = replay["sampling_at"]["1"]
    assert hot["temperature"] == 1.0 and hot["best_static"]["method"] in hot["policies"]
    assert {"confidence_tree", *summary["families"]} <= set(hot["policies"])
    assert hot["policies"] != sampled["policies"]


def test_export_retunes_the_tree_rules_for_another_machines_costs(exported, tmp_path):
    """A flat verify curve (a GPU's): wider trees pay, the same predictions choose them."""
    config, store, report, metrics = exported
    costs = json.loads((config.data / "costs.json").read_text())
    costs["target"]["seconds"] = {n: 0.04 for n in costs["target"]["seconds"]}
    flat = tmp_path / "gpu_costs.json"
    flat.write_text(json.dumps(costs))
    other = config.model_copy(update={"costs": flat, "out": tmp_path / "export",
                                      "metrics": tmp_path / "export.json"})
    retuned = export(other, store)
    before = json.loads((config.train / "summary.json").read_text())["families"]
    for family in ("logistic", "lightgbm", "mlp"):
        _, meta = read_stop_model(other.out / f"{family}.pt")
        assert meta["tree_costs"] == str(flat)
        assert meta["tree_rule"]["verify_cost"][5] == pytest.approx(1.0)  # flat: every width 1
        assert meta["tree_speedup"] > before[family]["tree_speedup"]  # verifying is free
        assert retuned["families"][family]["tree_speedup"] == meta["tree_speedup"]


def test_export_refuses_a_bad_cost_file_before_any_work(exported, tmp_path):
    config, store, report, metrics = exported
    bad = tmp_path / "costs.json"
    bad.write_text('{"tree_sizes": [1, 4]}')
    other = config.model_copy(update={"costs": bad, "out": tmp_path / "export"})
    with pytest.raises(SpecstopError, match=r"export.costs: .*costs.json: not a cost model"):
        export(other, store)
    assert not (tmp_path / "export").exists()


def test_a_failed_check_leaves_the_exported_files_as_they_were(exported, monkeypatch):
    config, store, report, metrics = exported
    before = {p.name: p.read_bytes() for p in sorted(config.out.iterdir())}
    real = scripted.exportable

    def off_by_one(*args, **kwargs) -> scripted.Exportable:
        model = real(*args, **kwargs)
        return dataclasses.replace(model, reference=lambda X: model.reference(X) + 1.0)

    monkeypatch.setattr(scripted, "exportable", off_by_one)
    with pytest.raises(SpecstopError, match="differ from the trained .* not written"):
        export(config, store)
    assert {p.name: p.read_bytes() for p in sorted(config.out.iterdir())} == before


def test_the_winner_is_copied_and_registered(exported):
    import mlflow

    config, store, report, metrics = exported
    winner = metrics["winner"]
    speed = {f: m["tree_speedup"] for f, m in metrics["families"].items()}
    assert speed[winner] == max(speed.values())
    assert (config.out / "stop_model.pt").read_bytes() == (config.out / f"{winner}.pt").read_bytes()
    assert json.loads(config.metrics.read_text())["winner"] == winner
    client = mlflow.MlflowClient(store.uri)
    version = client.get_model_version(config.registered_model, str(metrics["model_version"]))
    assert version.run_id == read_stop_model(config.out / "stop_model.pt")[1]["mlflow_run_id"]
    loaded = mlflow.pytorch.load_model(f"models:/{config.registered_model}/"
                                       f"{metrics['model_version']}")
    x = torch.tensor(report.bench.X[:5])
    assert torch.allclose(loaded(x), read_stop_model(config.out / "stop_model.pt")[0](x))


@pytest.mark.parametrize("case", ["missing", "garbage", "no-metadata", "schema-version",
                                  "feature-list"])
def test_bad_files_give_one_line_errors(tmp_path, case):
    path = tmp_path / "model.pt"
    if case == "garbage":
        path.write_text("not a model")
    elif case == "no-metadata":
        torch.jit.save(linear_module({"q_token": 1.0}), str(path))
    elif case == "schema-version":
        write_stop_model(path, feature_schema_version=SCHEMA_VERSION + 1)
    elif case == "feature-list":
        names = [f.name for f in FEATURES]
        names[3], names[4] = names[4], names[3]
        write_stop_model(path, features=names)
    expected = {"missing": "stop model not found", "garbage": "not a TorchScript stop model",
                "no-metadata": "no specstop.json metadata", "schema-version": "schema version",
                "feature-list": "column 3"}[case]
    with pytest.raises(SpecstopError, match=expected) as err:
        load_stop_model(path)
    assert len(str(err.value).splitlines()) == 1 and str(path) in str(err.value)


def level_features(p: list[float], depth: int) -> torch.Tensor:
    """[n, F] with q_token = p (the hand-made model's input) at a depth."""
    x = torch.zeros(len(p), len(FEATURES))
    x[:, Q_TOKEN] = torch.tensor(p)
    x[:, DEPTH] = depth
    return x


def identity_policy(**meta) -> LearnedPolicy:
    """A policy whose P(accept) is the q_token column (sigmoid(logit(q)))."""

    class QToken(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, 0]  # Q_TOKEN

    assert Q_TOKEN == 0

    return LearnedPolicy(torch.jit.script(QToken()), metadata(**meta))


def test_a_tree_s_model_calls_are_counted_as_decisions():
    """A `tree` round asks the model for probabilities alone: those calls are the decisions
    the bench's latency reports, as a level-wise stop's are."""
    policy = identity_policy(threshold=0.5)
    policy.probabilities(level_features([0.2, 0.9], 1))
    policy(level_features([0.2, 0.5, 0.9], 1), torch.zeros(3, dtype=torch.long))
    assert policy.calls == 2 and policy.seconds > 0


def test_a_loaded_model_counts_no_decision_before_it_decodes(tmp_path):
    """Its probe calls (the checks, TorchScript's profiling runs) are not the bench's
    decisions."""
    policy = load_stop_model(write_stop_model(tmp_path / "stop_model.pt"))
    assert (policy.calls, policy.seconds) == (0, 0.0)
    policy.probabilities(level_features([0.2, 0.9], 1))
    assert policy.calls == 1 and policy.seconds > 0


def test_threshold_rule_continues_above_t():
    policy = identity_policy(threshold=0.5)
    go_on = policy(level_features([0.2, 0.5, 0.9], 1), torch.zeros(3, dtype=torch.long))
    assert go_on.tolist() == [False, False, True] and go_on.dtype == torch.bool


def ti_mcsd_rounds(rounds: int = 6, width: int = 3, levels: int = 4,
                   seed: int = 0) -> tuple[pd.DataFrame, list[list[list[float]]]]:
    """Logged ti-mcsd rounds (`width` branches, `levels` levels, q_token random per node) as
    replay rows, and the same q_token values per round and level."""
    rng = np.random.default_rng(seed)
    q = rng.uniform(0.05, 1.0, (rounds, levels, width)).round(3).tolist()
    rows = [{"prompt_id": "a", "round": r, "depth": d + 1, "node": 1 + width * d + b,
             "parent": 0 if d == 0 else 1 + width * (d - 1) + b, "label": -1, "p": q[r][d][b]}
            for r in range(rounds) for d in range(levels) for b in range(width)]
    return pd.DataFrame(rows), q


COSTS = CostModel((1, 4, 7, 10, 13),
                  CostCurve({1: 0.04, 4: 0.041, 7: 0.043, 10: 0.046, 13: 0.05}),
                  CostCurve({1: 0.005, 3: 0.006}), 1e-5)


def replay_cut(rule: str, replay: Replay, p: np.ndarray, parameter: float) -> np.ndarray:
    """[R] the depth each round is cut at by replay.rules' replay of `rule`."""
    if rule == "fixed":
        return replay.fixed(int(parameter))
    if rule == "cost_aware":
        score = rules.cost_aware_scores(replay, COSTS, p)
    else:  # confidence, or a learned threshold: the model here predicts p = q_token
        score = p
    return replay.cut(replay.level_max(score) > parameter)


def runtime_policy(rule: str, parameter: float):
    if rule == "fixed":
        return FixedDepth(int(parameter))
    if rule == "confidence":
        return ConfidenceThreshold(parameter)
    marginal = COSTS.marginal_cost()[1:-1].tolist()
    return identity_policy(rule=rule, threshold=parameter, rho=parameter,
                           marginal_cost=marginal)


@pytest.mark.parametrize("rule, parameter", [
    ("fixed", 1), ("fixed", 3), ("confidence", 0.8), ("confidence", 0.9),
    ("threshold", 0.85), ("threshold", 0.95), ("cost_aware", 1.0), ("cost_aware", 3.0)])
def test_every_runtime_rule_cuts_rounds_as_the_replay(rule, parameter):
    """Each stopping rule the runtime applies (decode loop: after level d, draft d + 1 while any
    node of level d says go on), fed level by level with parents as the loop passes them, cuts
    every logged round at the depth replay.rules' replay gives it."""
    frame, q = ti_mcsd_rounds()
    replay = Replay.from_rows(frame, "hard")
    expected = replay_cut(rule, replay, frame["p"].to_numpy(), parameter)
    got = []
    for levels in q:
        policy, depth = runtime_policy(rule, parameter), 0
        for d, level in enumerate(levels):
            depth = d + 1
            parents = torch.zeros(len(level), dtype=torch.long) if d == 0 else \
                torch.arange(len(level))
            if not bool(policy(level_features(level, depth).double(), parents).any()):
                break
        got.append(depth)
    assert got == expected.tolist()
    assert len(set(got)) > 1 or rule == "fixed"  # the rounds are not all cut alike


def test_cost_aware_rule_follows_parents_within_a_level():
    policy = identity_policy(rule="cost_aware", rho=1.0, marginal_cost=[1.0, 1.0, 1.0])
    policy(level_features([1.0, 0.5, 0.25], 1), torch.zeros(3, dtype=torch.long))
    policy(level_features([1.0, 1.0, 1.0], 2), torch.tensor([2, 0, 1]))
    assert torch.allclose(policy._product, torch.tensor([0.25, 1.0, 0.5], dtype=torch.float64))
    policy(level_features([1.0], 1), torch.zeros(1, dtype=torch.long))  # a new round: reset
    assert policy._product.tolist() == [1.0]


def test_generate_with_a_stop_model(tmp_path, tiny_model_dir):
    good = write_stop_model(tmp_path / "stop_model.pt")
    bad = write_stop_model(tmp_path / "old.pt", feature_schema_version=SCHEMA_VERSION - 1)
    argv = ["generate", "--target", str(tiny_model_dir), "--draft", str(tiny_model_dir),
            "--dtype", "float32", "--max-new-tokens", "8", "--prompt", "hi"]
    result = run_specstop([*argv, "--stop-model", str(good)], tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert SUMMARY.fullmatch(lines[-1]) and lines[-2].startswith("stop model: logistic")
    result = run_specstop([*argv, "--stop-model", str(bad)], tmp_path)
    assert result.returncode != 0 and len(result.stderr.splitlines()) == 1
    assert "feature schema version" in result.stderr


def test_generate_a_dynamic_tree_with_a_stop_model(tmp_path, tiny_model_dir):
    model = write_stop_model(tmp_path / "stop_model.pt")
    argv = ["generate", "--method", "tree", "--target", str(tiny_model_dir), "--draft",
            str(tiny_model_dir), "--dtype", "float32", "--max-new-tokens", "8", "--prompt", "hi"]
    result = run_specstop([*argv, "--stop-model", str(model)], tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert SUMMARY.fullmatch(lines[-1])
    assert re.fullmatch(r"stop model: logistic, tree rule \(expand 0\.3, max width 2, rho 0\.8\); "
                        r"decisions \d+\.\d\d% of the decode time", lines[-2]), lines[-2]
    result = run_specstop(argv, tmp_path)
    assert result.returncode != 0 and result.stderr.strip().endswith(
        "--method tree needs --stop-model FILE (an exported decision model; its tree rule "
        "decides what to draft and verify)")


def test_where_nothing_pays_the_exported_rule_is_ar(exported, tmp_path, tiny_model_dir):
    """Verification as dear as decoding each token (a slow CPU's curve): no tree beats `ar`; the
    exported rule says so, and decoding with it gives `ar`'s output and says why."""
    config, store, report, metrics = exported
    own = json.loads((config.train / "summary.json").read_text())["families"][metrics["winner"]]
    assert metrics["vs_ar"] == {"own": {
        "tree_vs_ar": own["tree_speedup"], "vs_ar": own["gated_speedup"],
        "gated_share": own["gated_share"], "fallback": None,
        "round_gate": own["round_gate"] is not None, "static_tree": own["static_tree"],
        "sampling_static_tree": own["sampling_static_tree"]}, "export_costs": None}
    assert own["gated_speedup"] >= own["tree_speedup"] > 1.0  # drafting pays on its own curve
    costs = json.loads((config.data / "costs.json").read_text())
    costs["target"]["seconds"] = {n: 0.04 * int(n) for n in costs["target"]["seconds"]}
    dear = tmp_path / "dear_costs.json"
    dear.write_text(json.dumps(costs))
    other = config.model_copy(update={"costs": dear, "out": tmp_path / "export",
                                      "metrics": tmp_path / "export.json"})
    retuned = export(other, store)
    _, meta = read_stop_model(other.out / "stop_model.pt")
    assert (meta["fallback"], meta["round_gate"], meta["gated_speedup"], meta["gated_share"]) \
        == ("ar", None, 1.0, 1.0)
    assert meta["tree_speedup"] < 1.0
    assert retuned["vs_ar"]["export_costs"] == {
        "tree_vs_ar": meta["tree_speedup"], "vs_ar": 1.0, "gated_share": 1.0, "fallback": "ar",
        "round_gate": False, "static_tree": None, "sampling_static_tree": None}  # no static
    # shape beats `ar` there either
    argv = ["generate", "--target", str(tiny_model_dir), "--draft", str(tiny_model_dir),
            "--dtype", "float32", "--max-new-tokens", "8", "--prompt", "hi"]
    ar = run_specstop([*argv, "--method", "ar"], tmp_path)
    tree = run_specstop([*argv, "--method", "tree", "--stop-model",
                         str(other.out / "stop_model.pt")], tmp_path)
    assert tree.returncode == 0, tree.stderr
    lines = tree.stdout.splitlines()
    assert lines[:-2] == ar.stdout.splitlines()[:-1]  # the same text
    assert re.fullmatch(r"stop model: \w+ falls back to ar: no drafting policy beat ar in the "
                        r"replay on its cost curve \(its tree 0\.\d{3}x ar\); decoded without "
                        r"drafting", lines[-2]), lines[-2]


def test_lightgbm_splits_decide_alike_in_float32():
    """LightGBM splits at a double between two float32 feature values; hummingbird rounds it to
    the nearest float32, which can be the upper value, and sends that value down the other
    branch.  `float32_splits` rounds every threshold down instead: the booster predicts as
    before on float32 features, and the converted trees agree with it."""
    import lightgbm as lgb
    from hummingbird.ml import convert

    low = np.nextafter(np.float32(1.0), np.float32(2))  # odd mantissa: the midpoint above it
    high = np.nextafter(low, np.float32(2))  # rounds to nearest (even) onto this one
    X = np.array([[low]] * 50 + [[high]] * 50, dtype=np.float32)
    booster = lgb.train({"objective": "binary", "num_leaves": 2, "min_data_in_leaf": 1,
                         "min_data_in_bin": 1, "verbose": -1},
                        lgb.Dataset(X, np.repeat([0, 1], 50)), num_boost_round=1)
    rounded = scripted.float32_splits(booster)
    assert np.array_equal(rounded.predict(X, raw_score=True), booster.predict(X, raw_score=True))

    def converted_error(model) -> float:
        trees = convert(model, "torch", X[:3]).model
        return float(np.abs(trees(torch.tensor(X)).double().numpy().ravel()
                            - model.predict(X, raw_score=True)).max())

    assert converted_error(booster) > 0.1  # the mismatch, without the rounding
    assert converted_error(rounded) < 1e-6


def test_a_close_replay_is_settled_in_the_exported_file(exported, tmp_path, tiny_model_dir):
    """Every replay counted as close (margin 1): the winner is decoded both ways on a tiny
    model, and the winner's file, `stop_model.pt` and metrics/export.json carry what was
    measured, the static shape set exactly where it decoded faster; the other files as
    trained."""
    config, store, _, _ = exported
    summary = json.loads((config.train / "summary.json").read_text())
    runtime = load_runtime(str(tiny_model_dir), str(tiny_model_dir), "float32", "cpu")
    prompts = [runtime.encode(t, chat=False, special_tokens=False) for t in ("a b c", "1 2 3")]
    rule = TreeRule.from_dict(summary["families"][summary["winner"]]["tree_rule"])
    decoding = settle.Decoding(runtime, prompts, DecodeConfig(
        method="tree", max_new_tokens=6, max_depth=4, mcsd_branching=rule.branching), 5)
    other = config.model_copy(update={"out": tmp_path / "export", "metrics": tmp_path / "e.json",
                                      "settle": SettleConfig(margin=1.0)})
    metrics = export(other, store, settle.DecodingSource(lambda: None, lambda: decoding))
    _, meta = read_stop_model(other.out / "stop_model.pt")
    _, own = read_stop_model(other.out / f"{metrics['winner']}.pt")
    assert meta == own and metrics["settled"] == meta["settled"]
    assert set(meta["settled"]) == {"greedy", "sampling"}
    for greedy, mode in settle.MODES.items():
        settled = meta["settled"][mode]
        assert settled["static_tree"] == summary["static_shapes"][mode]
        assert settled["prompts"] == 2
        speeds = {settled["replay_decodes"]: 1.0,
                  **{way: r["ratio"] for way, r in settled["vs_replay"].items()}}
        assert {TREE_WAY, STATIC_WAY} <= set(speeds) and min(speeds.values()) > 0
        assert (LOOKUP_WAY in speeds) == bool(meta.get("lookup_model"))
        assert (CONFIDENCE_WAY in speeds) == (greedy and bool(meta.get("lookup_model")))
        assert settled["decodes"] == max(speeds, key=speeds.get)
        faster = speeds[STATIC_WAY] > speeds[TREE_WAY]
        assert meta[STATIC_KEYS[greedy]] == (settled["static_tree"] if faster else None)
        assert meta[LOOKUP_KEYS[greedy]] == (settled["decodes"] in BRANCH_WAYS)
        assert (greedy and meta["confidence_tree"] is not None) == \
            (settled["decodes"] == CONFIDENCE_WAY)
    for family in set(summary["families"]) - {metrics["winner"]}:
        assert "settled" not in read_stop_model(other.out / f"{family}.pt")[1]
    assert export(config.model_copy(update={"out": tmp_path / "far", "metrics": tmp_path / "f.json",
                                            "settle": SettleConfig(margin=0.0, lookup=False)}),
                         store, settle.DecodingSource(lambda: None,
                                                      lambda: pytest.fail("decoded with margin 0"))
                  )["settled"] is None


def test_the_settle_s_inputs_are_checked_before_any_work(exported, tmp_path):
    """After the export's own inputs (tracking, summary, rows) and before any file is written."""
    config, store, _, _ = exported
    other = config.model_copy(update={"out": tmp_path / "export", "metrics": tmp_path / "e.json"})

    def missing() -> None:
        raise SpecstopError("data/prompts/val.parquet: prompts not found")

    with pytest.raises(SpecstopError, match="val.parquet"):
        export(other, store, settle.DecodingSource(missing, lambda: pytest.fail("loaded")))
    assert not other.out.exists() and not other.metrics.exists()
