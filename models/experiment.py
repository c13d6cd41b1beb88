"""Stage `train` as library code: fit every family, score it and the baselines on val by replay,
track it in MLflow, save the models, metrics and plot data.

The headline comparison is the tree replay (`models.tree_report`): static shapes, Sequoia's
tree, the EAGLE-2-style dynamic tree and each family's dynamic tree on the val rounds
(metrics `replay`); the winner is the family whose dynamic tree is fastest.  Beside it: the
sanity floor (each family's AUC against the best single raw feature, with an interval over
prompts) and an ablation of the winner by feature group (nested MLflow runs).

Every entry (family or baseline) gets probability metrics on the labelled val rows (hard
labels) and a stopping rule tuned on val for simulated speed (`replay.rules`); a family's
speed is the better of its plain threshold and its cost-aware rule.  The oracle
(`Replay.oracle`) is the upper bound; `fraction_of_gap` is (speed - best fixed) / (oracle -
best fixed).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specstop.collection import data
from specstop.collection.rows import read_lookup_rows
from specstop.common import tracking
from specstop.common.errors import SpecstopError
from specstop.common.files import write_json
from specstop.common.params import StopTrainConfig, TrackingStore
from specstop.decoder.costs import CostModel
from specstop.decoder.policy import confidence_score, continues, entropy_score
from specstop.evaluation import plots
from specstop.features import FEATURE_GROUPS, feature_index
from specstop.replay import rules
from specstop.replay.simulate import Replay, SimResult

from . import evaluate, scripted, tree_report
from .families import FITTERS, StopModel, search_space
from .fit_data import FitData, fit_data

log = logging.getLogger(__name__)

MODEL_FILES = {"logistic": "logistic.json", "lightgbm": "lightgbm.txt", "mlp": "mlp.safetensors"}
TRANSFORMERS_THRESHOLD = 0.4
CONTEXTS = {"train": "training", "val": "validation"}  # MLflow dataset context of each split


@dataclass(frozen=True)
class Bench:
    """What every entry is scored against: the val replay and labelled rows."""

    replay: Replay
    costs: CostModel
    X: np.ndarray  # [n, F] every val row (the policies' inputs)
    X_labelled: np.ndarray  # [m, F] labelled val rows
    y_labelled: np.ndarray  # [m] hard labels
    groups_labelled: np.ndarray  # [m] prompt of each labelled row
    static: rules.Tuned  # best fixed gamma
    oracle: SimResult
    config: StopTrainConfig
    store: TrackingStore  # where the runs are logged
    tree_implementation: str  # how stage export scripts LightGBM's trees (a decision's time)


@dataclass
class Entry:
    name: str
    quality: dict
    rules: dict[str, rules.Tuned]
    latency: float | None = None  # seconds per decision (a learned model)
    model: StopModel | None = None
    importance: dict[str, float] | None = None
    run_id: str | None = None

    @property
    def best(self) -> rules.Tuned:
        return max(self.rules.values(), key=lambda t: t.result.speedup)

    def metrics(self, bench: Bench) -> dict:
        best, static, oracle = self.best.result, bench.static.result, bench.oracle
        gap = oracle.speedup - static.speedup
        out = {**self.quality, **best.as_dict(),
               "fraction_of_oracle": best.speedup / oracle.speedup,
               "fraction_of_gap": (best.speedup - static.speedup) / gap if gap > 0 else None,
               "rule": self.best.rule, "parameter": self.best.parameter}
        if len(self.rules) > 1:
            out.update({f"{r}_speedup": t.result.speedup for r, t in self.rules.items()})
        if self.latency is not None:
            out["decision_latency_ms"] = self.latency * 1e3
        return out


@dataclass(frozen=True)
class Report:
    entries: dict[str, Entry]
    bench: Bench
    winner: str | None
    metrics: dict


def run(config: StopTrainConfig, store: TrackingStore, tree_implementation: str = "tree_trav"
        ) -> Report:
    """Train, score, track and save; returns what was written to the metrics file.
    `tree_implementation`: export's, with which each family's decision is timed."""
    uri = tracking.tracking_uri(store.uri)
    tracking.check(uri)  # fails fast, before the work
    data.check_temperatures(config.data, [t for t in [config.sampling_temperature,
                                                      *config.replay_temperatures] if t],
                            "train.sampling_temperature, train.replay_temperatures")
    dataset = data.load(config.data, config.label)
    bench = _bench(dataset, config, store, tree_implementation)
    tracking.start(uri, store.experiment)
    entries = _baselines(bench)
    common = {"label": config.label, "class_weight": config.class_weight,
              "feature_schema_version": dataset.schema_version,
              "dataset_digest": dataset.digest, "dropped_rounds": dataset.dropped_rounds}
    for family in tqdm(config.families, desc="train", unit="family"):
        entries[family] = _family(family, dataset, bench, common)
    probabilities = _probabilities(bench, entries)
    trees = _trees(dataset, bench, probabilities)
    sampling = _sampling_trees(config, bench, entries, trees, config.sampling_temperature) \
        if config.sampling_temperature else None
    sampling_at = {f"{t:g}": _sampling_trees(config, bench, entries, trees, t).metrics()
                   for t in tqdm(config.replay_temperatures, desc="replay", unit="temperature")}
    ablation = _ablation(entries[trees.winner], dataset, bench, trees) if trees.winner else {}
    regimes = _regimes(config, bench, trees, probabilities)
    reach = _reach(config, trees, probabilities)
    with tracking.run("baselines") as run_id:
        _log_datasets(dataset, config, ("val",))  # tuned and scored on val only
        _log_baselines(entries, bench, common)
        _log_trees(trees)
    for name in entries:
        if entries[name].model is None:
            entries[name].run_id = run_id
    replay = {**trees.metrics(), "sampling": sampling.metrics() if sampling else None,
              "sampling_at": sampling_at, "regimes": regimes, "reach": reach}
    metrics = {**_metrics(entries, bench, config), "replay": replay, "ablation": ablation,
               "sanity_floor": _sanity_floor(entries, bench, config.families)}
    winner = trees.winner
    _save(entries, bench, dataset, winner, metrics, trees, sampling)
    return Report(entries, bench, winner, metrics)


def _probabilities(bench: Bench, entries: dict[str, Entry]) -> dict[str, tuple[np.ndarray, float]]:
    """Each family's p of every val row and its decision latency, charged per draft step."""
    charge = bench.config.charge_decision_latency
    return {f: (entries[f].model.predict_proba(bench.X), entries[f].latency if charge else 0.0)
            for f in bench.config.families}


def _trees(dataset: data.Dataset, bench: Bench, families: dict[str, tuple[np.ndarray, float]]
           ) -> tree_report.TreeComparison:
    """Every tree policy on the val rounds, each family's with its `families` entry."""
    return tree_report.compare(dataset.train.rows, dataset.val.rows, bench.costs,
                               confidence_score(bench.X), families,
                               read_lookup_rows(bench.config.data))


def _regimes(config: StopTrainConfig, bench: Bench, trees: tree_report.TreeComparison,
             families: dict[str, tuple[np.ndarray, float]]) -> list[dict]:
    """The winner's greedy tree against the best static shape and the confidence tree on the
    `train.regimes` grid of cost curves (none without a winner or a grid)."""
    grid = config.regimes
    if trees.winner is None or not grid.draft_cost or not grid.verify_slope:
        return []
    p, latency = families[trees.winner]
    return tree_report.regimes(trees, confidence_score(bench.X), trees.winner, p, latency,
                               grid.draft_cost, grid.verify_slope)


def _reach(config: StopTrainConfig, trees: tree_report.TreeComparison,
           families: dict[str, tuple[np.ndarray, float]]) -> list[dict]:
    """The winner's greedy tree with better predictors (`tree_report.reach`, the strengths of
    `train.reach`; none without a winner or strengths)."""
    if trees.winner is None or not config.reach:
        return []
    p, latency = families[trees.winner]
    return tree_report.reach(trees, p, latency, config.reach)


def _sampling_trees(config: StopTrainConfig, bench: Bench, entries: dict[str, Entry],
                    trees: tree_report.TreeComparison, temperature: float
                    ) -> tree_report.SamplingComparison:
    """Every tree policy on the val rounds sampled at `temperature` (the same models: their p
    as survival), each family's latency charged per draft step, and with the lookup chains
    collect verified beside them (the lookup model `trees` fitted on the greedy chains)."""
    sampled = data.load(config.data, config.label, temperature)
    X = sampled.val.features
    charge = config.charge_decision_latency
    families = {f: (entries[f].model.predict_proba(X), entries[f].latency if charge else 0.0)
                for f in config.families}
    return tree_report.compare_sampling(sampled.train.rows, sampled.val.rows, bench.costs,
                                        confidence_score(X), families, temperature,
                                        read_lookup_rows(config.data), trees.lookup_model)


def _ablation(entry: Entry, dataset: data.Dataset, bench: Bench,
              trees: tree_report.TreeComparison) -> dict[str, dict]:
    """The winning family refitted with each feature group (`FEATURE_GROUPS`) held at its
    training mean: val AUC, calibration and dynamic-tree speed, one nested MLflow run each."""
    config, family = bench.config, entry.name
    latency = entry.latency if config.charge_decision_latency else 0.0
    X, y, groups = dataset.train.examples(config.label)
    out = {"family": family, "all": {**entry.quality,
                                     "tree_speedup": trees.tuned[family].result.speedup}}
    with tracking.run(f"ablation-{family}"):
        for group, names in tqdm(FEATURE_GROUPS.items(), desc="ablation", unit="group"):
            columns = [data.FEATURE_NAMES.index(n) for n in names]
            mean = X[:, columns].mean(axis=0)

            def held(A: np.ndarray) -> np.ndarray:
                A = np.array(A)
                A[:, columns] = mean
                return A

            fit = fit_data(held(X), y, groups, config.class_weight, config.early_stop_fraction,
                           config.seed)
            with tracking.run(f"{family}-without-{group}", nested=True):
                model = FITTERS[family](fit, config.hyperparameters(family), config.seed)
                quality = evaluate.quality(bench.y_labelled,
                                           model.predict_proba(held(bench.X_labelled)))
                tuned, _ = trees.tune(group, model.predict_proba(held(bench.X)), latency)
                out[f"without_{group}"] = {**quality,
                                           "tree_speedup": tuned.result.speedup}
                tracking.log(params={"family": family, "without": group,
                                     "features_held": ",".join(names)},
                             metrics=out[f"without_{group}"])
    return out


def _log_trees(trees: tree_report.TreeComparison) -> None:
    flat = {f"replay.{name}.{key}": value for name, row in trees.metrics()["policies"].items()
            for key, value in row.items() if isinstance(value, (int, float))}
    tracking.log(metrics=flat)
    tracking.log_figure(tree_report.budget_figure(trees), "tree_budget.png")


def _sanity_floor(entries: dict[str, Entry], bench: Bench, families: tuple[str, ...]) -> dict:
    """Each family's val AUC against the best single raw feature's (either orientation), with
    a 95% interval of the difference over val prompts."""
    y, X = bench.y_labelled, bench.X_labelled
    raw = evaluate.feature_aucs(y, X, data.FEATURE_NAMES)
    if not raw:
        return {}
    best = max(raw, key=lambda n: raw[n][0])
    score = raw[best][1] * X[:, data.FEATURE_NAMES.index(best)]
    out = {"best_raw_feature": best, "best_raw_auc": raw[best][0], "families": {}}
    for f in families:
        p = entries[f].model.predict_proba(X)
        low, high = evaluate.auc_difference_interval(y, p, score, bench.groups_labelled)
        out["families"][f] = {"auc": entries[f].quality["auc"],
                              "minus_best_raw_ci95": [low, high]}
    out["families_above"] = all(v["auc"] is not None and v["auc"] >= raw[best][0]
                                for v in out["families"].values())
    return out


def _bench(dataset: data.Dataset, config: StopTrainConfig, store: TrackingStore,
           tree_implementation: str) -> Bench:
    costs = CostModel.load(config.data / "costs.json")
    replay = Replay.from_rows(dataset.val.rows, config.label)
    if replay.max_depth > costs.max_depth:
        raise SpecstopError(f"{config.data}: rows reach level {replay.max_depth} but the cost "
                            f"model stops at {costs.max_depth}")
    X_labelled, y_labelled = dataset.val.labelled()
    groups = dataset.val.examples("hard")[2]
    return Bench(replay, costs, dataset.val.features, X_labelled, y_labelled, groups,
                 rules.best_fixed(replay, costs), replay.simulate(replay.oracle(costs), costs),
                 config, store, tree_implementation)


def _baselines(bench: Bench) -> dict[str, Entry]:
    """Fixed gamma, q_token threshold (tuned and transformers' 0.4), entropy threshold."""
    q_token, q_labelled = confidence_score(bench.X), confidence_score(bench.X_labelled)
    minus_entropy = entropy_score(bench.X)
    e_labelled = -entropy_score(bench.X_labelled)
    replay, costs, grid = bench.replay, bench.costs, bench.config.threshold_grid
    level_q = replay.level_max(q_token)
    default = replay.simulate(replay.cut(continues(level_q, TRANSFORMERS_THRESHOLD)), costs)
    return {
        "fixed": Entry("fixed", _no_quality(), {"fixed": bench.static}),
        "confidence": Entry("confidence", evaluate.quality(bench.y_labelled, q_labelled),
                            {"threshold": rules.tune_threshold(replay, costs, q_token, grid)}),
        "confidence_0.4": Entry("confidence_0.4",
                                evaluate.quality(bench.y_labelled, q_labelled),
                                {"threshold": rules.Tuned("threshold", TRANSFORMERS_THRESHOLD,
                                                          default)}),
        "entropy": Entry("entropy", {**_no_quality(), "auc": evaluate.quality(
            bench.y_labelled, 1 / (1 + e_labelled))["auc"]},
            {"threshold": _entropy_rule(replay, costs, minus_entropy, grid)}),
    }


def _entropy_rule(replay: Replay, costs: CostModel, minus_entropy: np.ndarray, grid: int
                  ) -> rules.Tuned:
    """Continue while the entropy < t: a threshold on -entropy, reported as t."""
    tuned = rules.tune_threshold(replay, costs, minus_entropy, grid)
    return rules.Tuned("threshold", -tuned.parameter, tuned.result,
                       [(-t, s) for t, s in tuned.curve])


def _no_quality() -> dict:
    return {"auc": None, "log_loss": None, "brier": None, "calibration_error": None}


def _family(family: str, dataset: data.Dataset, bench: Bench, common: dict) -> Entry:
    """Fit (after an optional search), score, log one MLflow run, return the entry."""
    config = bench.config
    X, y, groups = dataset.train.examples(config.label)
    fit = fit_data(X, y, groups, config.class_weight, config.early_stop_fraction, config.seed)
    with tracking.run(family) as run_id:
        _log_datasets(dataset, config, ("train", "val"))
        hp = config.hyperparameters(family)
        if config.search_trials > 0:
            hp = _search(family, fit, hp, config)
        model = FITTERS[family](fit, hp, config.seed)
        entry = _score(family, model, bench)
        entry.run_id = run_id
        tracking.log(params={**common, **{f"hp.{k}": v for k, v in model.hyperparameters.items()},
                             "train_rows": len(fit.y), "early_stop_rows": len(fit.y_stop)},
                     metrics=entry.metrics(bench), tags={"family": family})
        _log_figures(entry, bench)
        model.log_model(bench.X[bench.replay.level == 1][:3])
    return entry


def _decision_latency(family: str, model: StopModel, bench: Bench) -> float:
    """Seconds of one level's decision (three rows) as the decoder makes it: the family's
    TorchScript module, scripted as stage export scripts it.  LightGBM's trees there took
    0.093 ms against its booster's 0.021 (stop 53), enough to tip the choice of winner."""
    level = bench.X[bench.replay.level == 1][:3]
    with tempfile.TemporaryDirectory() as folder:
        model.save(Path(folder))
        module = scripted.exportable(Path(folder), family, level,
                                     bench.tree_implementation).module
    rows = torch.from_numpy(level).float()
    with torch.inference_mode():
        return evaluate.decision_latency(module, rows)


def _log_datasets(dataset: data.Dataset, config: StopTrainConfig, splits: tuple[str, ...]
                  ) -> None:
    """The runs table's Dataset column: each split the run used, e.g. `collect-train`."""
    for split in splits:
        tracking.log_dataset(f"{config.data.name}-{split}", dataset.digest, config.data,
                             len(getattr(dataset, split).rows), CONTEXTS[split])


def _score(name: str, model: StopModel, bench: Bench) -> Entry:
    config = bench.config
    latency = _decision_latency(name, model, bench)
    extra = latency if config.charge_decision_latency else 0.0
    p = model.predict_proba(bench.X)
    tuned = {
        "threshold": rules.tune_threshold(bench.replay, bench.costs, p, config.threshold_grid,
                                          extra),
        "cost_aware": rules.tune_cost_aware(bench.replay, bench.costs, p,
                                            bench.static.result.speedup, config.rho_iterations,
                                            config.threshold_grid, extra)}
    quality = evaluate.quality(bench.y_labelled, model.predict_proba(bench.X_labelled))
    importance = evaluate.permutation_importance(model.predict_proba, bench.X_labelled,
                                                 bench.y_labelled, data.FEATURE_NAMES)
    return Entry(name, quality, tuned, latency, model, importance)


def _search(family: str, fit: FitData, base: dict, config: StopTrainConfig) -> dict:
    """Optuna: minimise the held-out prompts' cross-entropy; one nested run per trial."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def objective(trial) -> float:
        hp = {**base, **search_space(family, trial)}
        with tracking.run(f"{family}-trial-{trial.number}", nested=True):
            p = np.clip(FITTERS[family](fit, hp, config.seed).predict_proba(fit.X_stop),
                        1e-7, 1 - 1e-7)
            loss = float(-np.mean(fit.y_stop * np.log(p) + (1 - fit.y_stop) * np.log(1 - p)))
            tracking.log(params=trial.params, metrics={"early_stop_log_loss": loss})
        return loss

    study = optuna.create_study(direction="minimize",
                                sampler=optuna.samplers.TPESampler(seed=config.seed))
    study.optimize(objective, n_trials=config.search_trials)
    best = {**base, **search_space(family, optuna.trial.FixedTrial(study.best_params))}
    tracking.log(params={"search_trials": config.search_trials,
                         "search_best": study.best_params})
    return best


def _log_figures(entry: Entry, bench: Bench) -> None:
    p = entry.model.predict_proba(bench.X_labelled)
    y = bench.y_labelled
    tracking.log_figure(plots.roc_figure({entry.name: evaluate.roc_points(y, p)}), "roc.png")
    tracking.log_figure(plots.calibration_figure(
        {entry.name: evaluate.calibration_table(y, p)}), "calibration.png")
    tracking.log_figure(plots.speedup_figure(
        {f"{entry.name} {r}": t.curve for r, t in entry.rules.items()},
        bench.static.result.speedup, bench.oracle.speedup), "speedup_vs_threshold.png")
    tracking.log_figure(plots.importance_figure(entry.importance), "feature_importance.png")
    tracking.log_dict(entry.importance, "feature_importance.json")


def _log_baselines(entries: dict[str, Entry], bench: Bench, common: dict) -> None:
    """The baselines' and the oracle's metrics, and the figures comparing every entry."""
    metrics = {"oracle.simulated_speedup": bench.oracle.speedup}
    for name, entry in entries.items():
        if entry.model is None:
            metrics.update({f"{name}.{k}": v for k, v in entry.metrics(bench).items()})
    tracking.log(params=common, metrics=metrics, tags={"family": "baselines"})
    curves, tables, speed = _curves(entries, bench)
    tracking.log_figure(plots.roc_figure(curves), "roc.png")
    tracking.log_figure(plots.calibration_figure(tables), "calibration.png")
    tracking.log_figure(plots.speedup_figure(speed, bench.static.result.speedup,
                                             bench.oracle.speedup), "speedup_vs_threshold.png")


def _curves(entries: dict[str, Entry], bench: Bench) -> tuple[dict, dict, dict]:
    """ROC and calibration of every probability (families, q_token), speed curves of every rule."""
    y = bench.y_labelled
    probs = {"confidence": bench.X_labelled[:, feature_index("q_token")]}
    probs.update({n: e.model.predict_proba(bench.X_labelled)
                  for n, e in entries.items() if e.model is not None})
    roc = {n: evaluate.roc_points(y, p) for n, p in probs.items()}
    calibration = {n: evaluate.calibration_table(y, p) for n, p in probs.items()}
    speed = {f"{n}_{r}" if e.model is not None else n: t.curve
             for n, e in entries.items() for r, t in e.rules.items() if t.curve}
    return roc, calibration, speed


def _metrics(entries: dict[str, Entry], bench: Bench, config: StopTrainConfig) -> dict:
    out = {name: entry.metrics(bench) for name, entry in entries.items()}
    replay = bench.replay
    out["oracle"] = bench.oracle.as_dict()
    if config.label == "hard":
        first = replay.simulate(replay.first_rejection(), bench.costs)
        out["oracle"]["first_rejection_speedup"] = first.speedup
    out["targets"] = _targets(entries, bench, config.families)
    return out


def _targets(entries: dict[str, Entry], bench: Bench, families: tuple[str, ...]) -> dict:
    """Gains over the best fixed gamma and the tuned confidence threshold (STOPPING.md)."""
    static = bench.static.result.speedup
    confidence = entries["confidence"].best.result.speedup
    gains = {f: {"vs_best_fixed": entries[f].best.result.speedup / static - 1,
                 "vs_confidence": entries[f].best.result.speedup / confidence - 1}
             for f in families}
    best = max(gains.values(), key=lambda g: g["vs_best_fixed"]) if gains else None
    return {**gains,
            "all_beat_best_fixed": all(g["vs_best_fixed"] > 0 for g in gains.values()),
            "best_10pct_over_fixed": bool(best and best["vs_best_fixed"] >= 0.10),
            "best_3pct_over_confidence": bool(best and best["vs_confidence"] >= 0.03)}


def _save(entries: dict[str, Entry], bench: Bench, dataset: data.Dataset, winner: str | None,
          metrics: dict, trees: tree_report.TreeComparison,
          sampling: tree_report.SamplingComparison | None) -> None:
    config = bench.config
    for entry in entries.values():
        if entry.model is not None:
            entry.model.save(config.out)
    write_json(config.out / "summary.json",
               _summary(entries, bench, dataset, winner, trees, sampling))
    _write_plot_data(entries, bench)
    tree_report.write_plot_data(trees, config.plots)
    tree_report.write_regimes(metrics["replay"]["regimes"], config.plots)
    tree_report.write_reach(metrics["replay"]["reach"], config.plots)
    write_json(config.metrics, metrics)


def _summary(entries: dict[str, Entry], bench: Bench, dataset: data.Dataset,
             winner: str | None, trees: tree_report.TreeComparison,
             sampling: tree_report.SamplingComparison | None) -> dict:
    """What the export (issue 6) needs: the winner, each family's file and tuned rules."""
    config = bench.config
    families = {
        name: {"file": MODEL_FILES[name], "run_id": e.run_id, "rule": e.best.rule,
               "threshold": e.rules["threshold"].parameter,
               "rho": e.rules["cost_aware"].parameter,
               "threshold_speedup": e.rules["threshold"].result.speedup,
               "cost_aware_speedup": e.rules["cost_aware"].result.speedup,
               "decision_latency_s": e.latency,
               "marginal_cost": bench.costs.marginal_cost(
                   e.latency if config.charge_decision_latency else 0.0)[1:-1].tolist(),
               "tree_rule": trees.rules[name].as_dict(),
               "tree_speedup": trees.tuned[name].result.speedup, **trees.gates[name].as_dict(),
               "static_tree": trees.static_fallback(name, trees.gates[name].result.speedup),
               **_sampling_entry(sampling, name)}
        for name, e in entries.items() if e.model is not None}
    return {"winner": winner, "feature_schema_version": dataset.schema_version,
            "dataset_digest": dataset.digest, "label": config.label,
            "tracking_uri": tracking.tracking_uri(bench.store.uri),
            "experiment": bench.store.experiment, "families": families,
            "baselines_run_id": entries["fixed"].run_id,
            "best_fixed_gamma": int(bench.static.parameter),
            "threshold_rule": "after level d, continue while some node has p > threshold",
            "cost_aware_rule": "after level d (1-based), continue while some node has "
                               "P_d * p / marginal_cost[d - 1] > rho, P_d the product of p "
                               "along its branch",
            "oracle_speedup": bench.oracle.speedup,
            "confidence_tree_rule": trees.rules[tree_report.CONFIDENCE_TREE].as_dict(),
            "lookup_model": None if trees.lookup_model is None else trees.lookup_model.as_dict(),
            "best_static_tree": {"method": trees.best_static,
                                 **trees.tuned[trees.best_static].setting},
            "static_shapes": {"greedy": trees.static_shape(),  # what the export settles against
                              "sampling": None if sampling is None else sampling.static_shape()},
            "tree_rule": "per node survival s = product of p along its path; after each draft "
                         "step feed the candidates with s > expand (at most max_width); verify "
                         "the n best by s (closed under parents and earlier siblings), n "
                         "maximising sum(s) - rho * verify_cost[1 + n]"}


def _sampling_entry(sampling: tree_report.SamplingComparison | None, family: str) -> dict:
    """A family's sampling tree rule, its replayed speed and the static shape decoded instead
    where one replayed faster (none without sampled rounds)."""
    if sampling is None:
        return {"sampling_tree_rule": None, "sampling_tree_speedup": None,
                "sampling_temperature": None, "sampling_static_tree": None}
    speed = sampling.tuned[family].result.speedup
    return {"sampling_tree_rule": sampling.rules[family].as_dict(),
            "sampling_tree_speedup": speed, "sampling_temperature": sampling.temperature,
            "sampling_static_tree": sampling.static_fallback(family, speed)}


def _write_plot_data(entries: dict[str, Entry], bench: Bench) -> None:
    roc, calibration, speed = _curves(entries, bench)
    folder = bench.config.plots
    for name, points in roc.items():
        plots.write_csv(folder / "roc" / f"{name}.csv", ["fpr", "tpr"], points)
    for name, table in calibration.items():
        plots.write_csv(folder / "calibration" / f"{name}.csv",
                        ["predicted", "observed", "rows"], table)
    for name, curve in speed.items():
        finite = [(t, s) for t, s in curve if np.isfinite(t)]
        plots.write_csv(folder / "speedup" / f"{name}.csv", ["threshold", "speedup"], finite)
