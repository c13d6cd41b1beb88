"""Stage `export`'s work: every trained decision model as one TorchScript file, the winner
copied to `stop_model.pt` and registered in the MLflow model registry; writes
metrics/export.json.

Each file is checked on the val rows after a round trip through the file: its predictions must
equal the trained model's within `tolerance`, or the stage fails.  The winner is the family
whose dynamic tree (`tree_rule` in the metadata) is fastest in the val replay; ties go to the
lower decision latency of the exported file.  Where the winner's tree and the best static
shape replayed within `export.settle.margin` of each other, the two are decoded on val prompts
beside the tree with the lookup branch (greedy also the confidence tree with it), and the
fastest is what the file decodes (`models.settle`; this machine's only).  With
`export.costs` (another machine's costs.json) every family's tree rule is re-tuned on val for
that cost curve before export: the same predictions, the trees that pay there, and their round
gates (`models.round_gate`):
where no drafting policy beats `ar` on that curve the exported rule says `fallback: ar`, and
where the best static shape beats the tree and `ar` there the file names it (`static_tree`, the
shape the decoder then drafts; none sampled, `sampling_static_tree`, whose replay was this
machine's).
metrics/export.json's `vs_ar` gives the winner's replay against `ar` on this machine's cost
curve (`own`, stage train's) and on `export.costs` (`export_costs`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from specstop.collection import data
from specstop.common import tracking
from specstop.common.errors import DataError, SpecstopError
from specstop.common.files import read_json, write_atomic, write_json
from specstop.common.params import ExportConfig, SettleConfig, TrackingStore
from specstop.decoder.costs import CostModel
from specstop.decoder.policy import confidence_score
from specstop.decoder.stop_model import STATIC_KEYS, LearnedPolicy, read_stop_model
from specstop.features import feature_index

from . import evaluate, scripted, settle, tree_report


WINNER_FILE = "stop_model.pt"


def export(config: ExportConfig, store: TrackingStore,
           decoding: settle.DecodingSource | None = None) -> dict:
    """Export, check and time every family; settle the winner's way of decoding by decoding
    (`decoding`: what to decode with; none: the replay decides); copy and register the winner;
    write the metrics."""
    tracking.check(tracking.tracking_uri(store.uri))  # before the work, not after
    own = summary = _summary(config.train)
    costs = _costs(config.costs)
    dataset = _dataset(config.data, summary)
    if costs is None and decoding is not None:
        decoding.check()
    X = dataset.val.features
    if costs is not None:
        summary = _retuned(summary, dataset, costs, X, config)
    level = torch.tensor(X[X[:, feature_index("depth")] == 1][:3])  # one level of ti-mcsd
    families, metas = {}, {}
    for family in tqdm(summary["families"], desc="export", unit="model"):
        families[family], metas[family] = _export_one(family, summary, X, level, config)
    winner = _winner(families)
    if costs is None and decoding is not None:
        metas[winner] = _settled(config.out / f"{winner}.pt", metas[winner], summary,
                                 config.settle, decoding.load)
    path = config.out / WINNER_FILE
    write_atomic(path, lambda tmp: shutil.copyfile(config.out / f"{winner}.pt", tmp))
    registered = _register(path, metas[winner], families[winner], config, store)
    metrics = {"winner": winner, "file": str(path), "val_rows": int(len(X)),
               "tolerance": config.tolerance,
               "max_abs_diff": families[winner]["max_abs_diff"], **registered,
               "settled": metas[winner].get("settled"),
               "vs_ar": {"own": _vs_ar(own["families"][winner]),
                         "export_costs": _vs_ar(summary["families"][winner]) if costs else None},
               "families": families}
    write_json(config.metrics, metrics)
    return metrics


def _summary(folder: Path) -> dict:
    path = folder / "summary.json"
    summary = read_json(path, "train")
    if not summary.get("families"):
        raise SpecstopError(f"{path}: no trained decision model to export")
    return summary


def _dataset(folder: Path, summary: dict) -> data.Dataset:
    """The rows the models were trained and scored on; refuses data changed since training."""
    try:
        dataset = data.load(folder, summary["label"])
    except DataError as err:
        raise SpecstopError(str(err)) from err
    if dataset.digest != summary["dataset_digest"]:
        raise SpecstopError(f"{folder} changed since stage train (digest {dataset.digest[:12]} "
                            f"vs {summary['dataset_digest'][:12]}); re-run `specstop train`")
    return dataset


def _costs(path: Path | None) -> CostModel | None:
    """export.costs: another machine's cost model (checked before any work)."""
    if path is None:
        return None
    try:
        return CostModel.load(path)
    except DataError as err:
        raise SpecstopError(f"export.costs: {err}") from err


def _retuned(summary: dict, dataset: data.Dataset, costs: CostModel, X: np.ndarray,
             config: ExportConfig) -> dict:
    """The summary with every family's tree rule re-tuned on val for `costs` (no retraining:
    the same predictions, another machine's cost curve)."""
    families = {f: (scripted.exportable(config.train, f, X[:3], config.tree_implementation)
                    .reference(X), entry["decision_latency_s"] or 0.0)
                for f, entry in summary["families"].items()}
    trees = tree_report.compare(dataset.train.rows, dataset.val.rows, costs,
                                confidence_score(X), families)
    out = json.loads(json.dumps(summary))
    for f, entry in out["families"].items():
        entry.update(tree_rule=trees.rules[f].as_dict(), **trees.gates[f].as_dict(),
                     tree_speedup=trees.tuned[f].result.speedup, tree_costs=str(config.costs),
                     static_tree=trees.static_fallback(f, trees.gates[f].result.speedup),
                     sampling_static_tree=None)  # this machine's sampled replay: not there
    return out


def _settled(path: Path, meta: dict, summary: dict, config: SettleConfig,
             decoding: Callable[[], settle.Decoding]) -> dict:
    """The winner's metadata after the settle (`models.settle`), its file (`path`) re-written
    with it where the settle decoded."""
    module, _ = read_stop_model(path)
    settled = settle.settle(module, meta, summary.get("static_shapes") or {}, config.margin,
                            config.lookup, decoding, summary.get("confidence_tree_rule"))
    if settled is not meta:
        scripted.save(module, settled, path)
    return settled


def _vs_ar(entry: dict) -> dict:
    """A family's replay against `ar` (speedup 1): its tree rule alone, and behind its gate."""
    return {"tree_vs_ar": entry["tree_speedup"], "vs_ar": entry.get("gated_speedup"),
            "gated_share": entry.get("gated_share"), "fallback": entry.get("fallback"),
            "round_gate": entry.get("round_gate") is not None,
            **{key: entry.get(key) for key in STATIC_KEYS.values()}}


def _export_one(family: str, summary: dict, X: np.ndarray, level: torch.Tensor,
                config: ExportConfig) -> tuple[dict, dict]:
    """Script, save, reload, compare with the trained model on val, time one decision;
    returns (metrics, metadata)."""
    model = scripted.exportable(config.train, family, X[:3], config.tree_implementation)
    path = config.out / f"{family}.pt"
    loaded: dict = {}

    def check(written: Path) -> None:  # on the written file, before it replaces `path`
        module, meta = read_stop_model(written)
        with torch.inference_mode():
            exported = module(torch.tensor(X)).double().numpy()
        diff = float(np.max(np.abs(exported - model.reference(X))))
        if not diff <= config.tolerance:
            raise SpecstopError(f"{path}: exported predictions differ from the trained {family} "
                                f"model by {diff:.3g} on val (tolerance {config.tolerance:g}); "
                                f"not written")
        loaded.update(module=module, meta=meta, diff=diff)

    scripted.save(model.module, scripted.metadata(family, summary), path, check)
    module, meta, diff = loaded["module"], loaded["meta"], loaded["diff"]
    policy = LearnedPolicy(module, meta, str(path))
    latency = evaluate.decision_latency(lambda x: policy(x, None), level)
    return {"file": str(path), "bytes": path.stat().st_size, "rule": meta["rule"],
            "simulated_speedup": meta["simulated_speedup"],
            "tree_speedup": meta["tree_speedup"], "max_abs_diff": diff,
            "decision_latency_ms": latency * 1e3, "mlflow_run_id": meta["mlflow_run_id"]}, meta


def _winner(families: dict[str, dict]) -> str:
    """Fastest simulated dynamic tree; ties go to the lower exported decision latency."""
    return min(families, key=lambda f: (-round(families[f]["tree_speedup"], 9),
                                        families[f]["decision_latency_ms"]))


def _register(path: Path, meta: dict, exported: dict, config: ExportConfig,
              store: TrackingStore) -> dict:
    """Log the winner (an MLflow PyTorch model holding the exact file) to its training run, or
    to a new run where the store does not have it, and register it."""
    import mlflow

    uri = tracking.tracking_uri(store.uri)
    tracking.start(uri, store.experiment)
    run_id = meta["mlflow_run_id"] if _has_run(meta["mlflow_run_id"]) else None
    module, _ = read_stop_model(path)
    with mlflow.start_run(run_id=run_id, run_name=None if run_id else f"export-{meta['family']}"):
        tracking.log(metrics={"export_max_abs_diff": exported["max_abs_diff"],
                              "export_decision_latency_ms": exported["decision_latency_ms"]},
                     tags={"stop_model": "winner"})
        logging.getLogger("mlflow.pytorch").setLevel(logging.ERROR)  # a ScriptModule is
        info = mlflow.pytorch.log_model(  # saved by torch.jit.save, not pickled, despite the name
            module, name="stop_model", extra_files=[str(path)], metadata=meta,
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
            registered_model_name=config.registered_model, serialization_format="pickle")
        active = mlflow.active_run().info.run_id
    return {"registered_model": config.registered_model,
            "model_version": int(info.registered_model_version), "mlflow_run_id": active,
            "model_uri": info.model_uri, "tracking_uri": uri}


def _has_run(run_id: str | None) -> bool:
    import mlflow

    if not run_id:
        return False
    try:
        mlflow.MlflowClient().get_run(run_id)
    except mlflow.exceptions.MlflowException:
        return False
    return True
