"""Stage `train`: fit the decision-model families, tune their stopping rules and the baselines'
on val by replay, track everything in MLflow; writes data/train/ and metrics/train.json."""

from __future__ import annotations

import time

from specstop.common.errors import DataError, SpecstopError
from specstop.common.params import Params
from specstop.models import experiment
from specstop.models.experiment import Report

COLUMNS = ["auc", "log_loss", "brier", "calibration_error", "simulated_speedup",
           "fraction_of_oracle", "fraction_of_gap"]
SECTIONS = ("oracle", "targets", "replay", "sanity_floor", "ablation")  # not one entry each


def run(params: Params) -> dict:
    config = params.train
    start = time.perf_counter()
    try:
        report = experiment.run(config, params.mlflow.store("train"),
                                params.export.tree_implementation)
    except DataError as err:
        raise SpecstopError(str(err)) from err
    print(table(report))
    print(f"train: {time.perf_counter() - start:.0f} s; metrics in {config.metrics}, "
          f"models in {config.out}")
    return {"families": len(config.families), "val_rows": int(report.bench.X.shape[0]),
            "val_labelled": int(report.bench.y_labelled.shape[0]), "winner": report.winner}


def table(report: Report) -> str:
    """One line per family and baseline (val, level-wise stop), the oracle and the targets;
    then the tree replay, one line per policy, and the sanity floor."""
    rows = [f"{'':16}" + "".join(f"{c[:12]:>13}" for c in COLUMNS) + "  rule"]
    for name, values in report.metrics.items():
        if name in SECTIONS:
            continue
        cells = "".join(f"{_cell(values.get(c)):>13}" for c in COLUMNS)
        rows.append(f"{name:16}{cells}  {values['rule']} {values['parameter']:.4g}")
    oracle = report.metrics["oracle"]["simulated_speedup"]
    rows.append(f"{'oracle':16}{'':52}{oracle:>13.4f}")
    targets = report.metrics["targets"]
    rows.append(f"winner: {report.winner}; every family beats the best fixed γ: "
                f"{targets['all_beat_best_fixed']}; best ≥ 10% over it: "
                f"{targets['best_10pct_over_fixed']}; best ≥ 3% over the tuned confidence "
                f"threshold: {targets['best_3pct_over_confidence']}")
    return "\n".join(rows + tree_table(report.metrics))


def tree_table(metrics: dict) -> list[str]:
    """The tree replay (speed vs ar, vs the best static, nodes verified) and the floor."""
    replay = metrics["replay"]
    rows = [f"tree replay (val): best static {replay['best_static']['method']} "
            f"{replay['best_static']['simulated_speedup']:.4f}, oracle "
            f"{replay['oracle']['simulated_speedup']:.4f}",
            f"{'':16}{'speedup':>10}{'vs static':>10}{'verified':>10}{'steps':>8}  setting"]
    for name, row in replay["policies"].items():
        setting = {k: v for k, v in row.items() if k in ("widths", "depth", "nodes", "expand",
                                                         "max_width", "rho")}
        rows.append(f"{name:16}{row['simulated_speedup']:>10.4f}{row['vs_best_static']:>10.3f}"
                    f"{row['verified_nodes']:>10.2f}{row['draft_steps']:>8.2f}  {setting}")
    floor = metrics.get("sanity_floor") or {}
    if floor:
        rows.append(f"sanity floor: best raw feature {floor['best_raw_feature']} AUC "
                    f"{floor['best_raw_auc']:.4f}; families " + ", ".join(
                        f"{f} {v['auc']:.4f} (diff CI [{v['minus_best_raw_ci95'][0]:+.4f}, "
                        f"{v['minus_best_raw_ci95'][1]:+.4f}])"
                        for f, v in floor["families"].items()))
    return rows


def _cell(value) -> str:
    return "-" if value is None else f"{value:.4f}"
