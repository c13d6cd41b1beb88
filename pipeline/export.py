"""Stage `export`: every trained decision model as TorchScript, the winner registered
(`specstop.models.export`)."""

from __future__ import annotations

import time

from specstop.common.params import Params
from specstop.models.export import WINNER_FILE, export


def run(params: Params) -> dict:
    config = params.export
    start = time.perf_counter()
    metrics = export(config, params.mlflow.store("train"))
    print(table(metrics))
    print(f"export: {time.perf_counter() - start:.0f} s; {config.out / WINNER_FILE} "
          f"({metrics['winner']}), registered as {metrics['registered_model']} version "
          f"{metrics['model_version']}; metrics in {config.metrics}")
    return {"families": len(metrics["families"]), "winner": metrics["winner"]}


def table(metrics: dict) -> str:
    rows = [f"{'family':12}{'rule':>12}{'sim. speedup':>14}{'max |diff|':>12}{'ms/decision':>13}"]
    for family, m in metrics["families"].items():
        mark = "  <- winner" if family == metrics["winner"] else ""
        rows.append(f"{family:12}{m['rule']:>12}{m['simulated_speedup']:>14.4f}"
                    f"{m['max_abs_diff']:>12.2e}{m['decision_latency_ms']:>13.4f}{mark}")
    return "\n".join(rows)
