"""Stage `bench`: every method side by side on the held-out test prompts (`specstop.bench.run`),
logged as one MLflow run linked to the registered model version (`specstop.bench.tracking`)."""

from specstop.bench import report
from specstop.bench import run as bench
from specstop.bench import tracking
from specstop.common.params import Params


def run(params: Params) -> dict:
    store = params.mlflow.store("bench")
    tracking.check_store(store)  # before the bench's work, not after
    metrics = bench.run(params.bench, params.models, params.collect, params.costs)
    tracking.log_bench(metrics, params.bench.metrics, params.bench.plots, params.export.metrics,
                       store)
    setup = metrics["setup"]
    return {"prompts": setup["prompts"], "max_new_tokens": setup["max_new_tokens"],
            "greedy_methods": len(report.methods(metrics)),
            "sampling_methods": len(report.methods(metrics["sampling"]))}
