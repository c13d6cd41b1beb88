"""Stage `bench` in MLflow: one run per bench in the experiment `<experiment>-bench`, with the
setup as params, the headline figures as metrics, bench.json, the results table, per-prompt CSV
and plots as artifacts, linked both ways to the registered model version the export made."""

from __future__ import annotations

import json
import re
from pathlib import Path

from specstop.common import tracking
from specstop.common.params import TrackingStore

from .report import methods

ARTIFACTS = ("*.md", "*.csv", "*.png")  # of the plots folder (its subfolders are DVC plot data)
HEADLINE = ("speedup_vs_ar", "tokens_per_s")  # per method
BAD_NAME = re.compile(r"[^\w\-. /]")  # what MLflow refuses in a metric name ('+' of a method)


def check_store(store: TrackingStore) -> None:
    """Fail fast, before the bench's work, on a store MLflow cannot use."""
    tracking.check(tracking.tracking_uri(store.uri))


def log_bench(metrics: dict, bench_json: Path, plots: Path, export_metrics: Path,
              store: TrackingStore) -> str:
    """Log one bench run (bench.json's content `metrics`) and link it to the registered model
    version in `export_metrics`, where the store has it; returns the run id."""
    import mlflow

    uri = tracking.tracking_uri(store.uri)
    tracking.start(uri, store.experiment)
    model = _registered(export_metrics)
    with tracking.run("bench") as run_id:
        tracking.log(params=_params(metrics), metrics=_metrics(metrics),
                     tags=_model_tags(model) if model else None)
        mlflow.log_artifact(str(bench_json))
        for pattern in ARTIFACTS:
            for path in sorted(plots.glob(pattern)):
                mlflow.log_artifact(str(path))
    if model:
        _tag_version(model, run_id, metrics.get("summary") or {})
    print(f"bench: MLflow run {run_id} in experiment {store.experiment} ({uri})")
    return run_id


def _registered(export_metrics: Path) -> dict | None:
    """export.json's registered model version where the store has it; else None, said why."""
    import mlflow

    if not export_metrics.is_file():
        return _unlinked(f"{export_metrics} not found (run `specstop export` first)")
    try:
        export = json.loads(export_metrics.read_text())
    except json.JSONDecodeError as err:
        return _unlinked(f"{export_metrics} is not JSON ({err.msg})")
    name, version = export.get("registered_model"), export.get("model_version")
    if not name or version is None:
        return _unlinked(f"{export_metrics} names no registered model version")
    try:
        mlflow.MlflowClient().get_model_version(name, str(version))
    except mlflow.exceptions.MlflowException:
        return _unlinked(f"model {name} version {version} is not in this tracking store")
    return export


def _unlinked(why: str) -> None:
    print(f"bench: MLflow run not linked to a registered model: {why}")
    return None


def _params(metrics: dict) -> dict:
    """The setup, and the summary's facts that are not ratios (winner, prompts, domains)."""
    return {**_flat(metrics.get("setup") or {}),
            **_flat(_facts(metrics.get("summary") or {}), "summary.")}


def _facts(summary: dict) -> dict:
    """The summary less its ratios (the sampled block's too)."""
    return {k: _facts(v) if isinstance(v, dict) and not _is_ratio(v) else v
            for k, v in summary.items() if not _is_ratio(v)}


def _metrics(metrics: dict) -> dict:
    """Per method (greedy, and sampled under `sampling.`) its speedup over ar and tokens/s; per
    summary ratio (the sampled ones under `summary.sampling.`, prompt lookup's under
    `summary.lookup.<comparison>.<all | domain>`) its value and 95% interval."""
    out = {}
    for prefix, mode in (("", metrics), ("sampling.", metrics.get("sampling") or {})):
        for name, method in methods(mode).items():
            if not isinstance(method, dict):
                continue
            out.update({_name(f"{prefix}{name}.{key}"): method[key]
                        for key in HEADLINE if method.get(key) is not None})
    summary = metrics.get("summary") or {}
    blocks = (("summary.", summary), ("summary.sampling.", summary.get("sampling") or {}),
              *((f"summary.lookup.{key}.", entries)
                for key, entries in (summary.get("lookup") or {}).items() if entries))
    for prefix, block in blocks:
        for key, entry in block.items():
            if _is_ratio(entry):
                out[f"{prefix}{key}.ratio"] = entry["ratio"]
                if entry.get("ci95"):
                    out[f"{prefix}{key}.ci95_lo"], out[f"{prefix}{key}.ci95_hi"] = entry["ci95"]
    return out


def _model_tags(export: dict) -> dict:
    """The registered model version benched, its export run and model URI."""
    tags = {"registered_model": export["registered_model"],
            "model_version": export["model_version"],
            "model_run_id": export.get("mlflow_run_id"), "model_uri": export.get("model_uri")}
    return {key: str(value) for key, value in tags.items() if value is not None}


def _tag_version(export: dict, run_id: str, summary: dict) -> None:
    """The registered version names the bench run, and its headline ratio over ar."""
    import mlflow

    client = mlflow.MlflowClient()
    name, version = export["registered_model"], str(export["model_version"])
    client.set_model_version_tag(name, version, "bench_run_id", run_id)
    headline = summary.get("winner_vs_ar")
    if _is_ratio(headline):
        client.set_model_version_tag(name, version, "bench_winner_vs_ar",
                                     f"{headline['ratio']:.3f}")


def _is_ratio(value: object) -> bool:
    return isinstance(value, dict) and value.get("ratio") is not None


def _flat(value: dict, prefix: str = "") -> dict:
    """Nested dicts as dotted keys; None left out."""
    out = {}
    for key, item in value.items():
        if isinstance(item, dict):
            out.update(_flat(item, f"{prefix}{key}."))
        elif item is not None:
            out[_name(f"{prefix}{key}")] = item
    return out


def _name(key: str) -> str:
    return BAD_NAME.sub("_", key)
