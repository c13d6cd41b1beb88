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


def run(params: Params) -> None:
    config = params.train
    start = time.perf_counter()
    try:
        report = experiment.run(config, params.mlflow.store("train"))
    except DataError as err:
        raise SpecstopError(str(err)) from err
    print(table(report))
    print(f"train: {time.perf_counter() - start:.0f} s; metrics in {config.metrics}, "
          f"models in {config.out}")


def table(report: Report) -> str:
    """One line per family and baseline (val), then the oracle and the targets."""
    rows = [f"{'':16}" + "".join(f"{c[:12]:>13}" for c in COLUMNS) + "  rule"]
    for name, values in report.metrics.items():
        if name in ("oracle", "targets"):
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
    return "\n".join(rows)


def _cell(value) -> str:
    return "-" if value is None else f"{value:.4f}"
