"""Hand-made exported stop models (no training): a scripted linear model over chosen features
with the metadata `specstop export` writes, and the files the bench reads beside them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specstop.features import FEATURES, SCHEMA_VERSION, feature_index
from specstop.decoder.stop_model import STOP_MODEL_META
from specstop.models.anchor import Anchor
from specstop.models.scripted import LinearLogit, Probability

N = len(FEATURES)
TREE_RULE = {"branching": [2, 1, 1], "expand": 0.3, "rho": 0.8, "max_width": 2,
             "verify_cost": [0.0, 1.0, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7], "prune": True}


def linear_module(weights: dict[str, float], bias: float = 0.0) -> torch.jit.ScriptModule:
    """P = sigmoid(bias + sum of weight * feature), unscaled (the anchor's column weighs 0)."""
    coef = [0.0] * (N + 1)
    for name, w in weights.items():
        coef[feature_index(name)] = w
    anchor = Anchor(feature_index("q_token"), 1.0, 0.0)
    return torch.jit.script(Probability(LinearLogit([0.0] * (N + 1), [1.0] * (N + 1), coef,
                                                    bias, anchor)).eval())


def metadata(family: str = "logistic", rule: str = "threshold", threshold: float = 0.5,
             rho: float = 1.0, marginal_cost: list[float] | None = None, **changes) -> dict:
    return {"format": "specstop-stop-model", "family": family,
            "features": [f.name for f in FEATURES], "feature_schema_version": SCHEMA_VERSION,
            "rule": rule, "threshold": threshold, "rho": rho,
            "marginal_cost": marginal_cost or [0.2] * 7, "simulated_speedup": 1.1,
            "tree_rule": TREE_RULE, "tree_speedup": 1.2,
            "label": "hard", "dataset_digest": "0" * 64, "mlflow_run_id": None,
            "mlflow_experiment": "specstop-train", **changes}


def write_stop_model(path: Path, module: torch.jit.ScriptModule | None = None,
                     **meta) -> Path:
    """A file laid out as `specstop export` writes it, with any metadata (default: continue
    while q_token > 0.25)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.save(module or linear_module({"q_token": 8.0}, -2.0), str(path),
                   _extra_files={STOP_MODEL_META: json.dumps(metadata(**meta))})
    return path


def write_trained_outputs(root: Path, families: tuple[str, ...] = ("logistic", "mlp"),
                          gamma: int = 2) -> None:
    """data/export (stop_model.pt = the first family), data/train/summary.json and
    metrics/train.json as stages export and train leave them, under `root`."""
    for i, family in enumerate(families):
        write_stop_model(root / "data/export" / f"{family}.pt", family=family,
                         threshold=0.4 + 0.1 * i)
    (root / "data/export/stop_model.pt").write_bytes(
        (root / "data/export" / f"{families[0]}.pt").read_bytes())
    summary = {"winner": families[0], "best_fixed_gamma": gamma,
               "families": {f: {"rule": "threshold", "tree_rule": TREE_RULE} for f in families},
               "confidence_tree_rule": {**TREE_RULE, "expand": 0.5}}
    (root / "data/train").mkdir(parents=True, exist_ok=True)
    (root / "data/train/summary.json").write_text(json.dumps(summary))
    policies = {"static_tree": {"simulated_speedup": 1.0, "widths": [2, 1, 1], "depth": 2},
                "confidence_tree": {"simulated_speedup": 1.1}}
    train = {"fixed": {"simulated_speedup": 1.0},
             "confidence": {"simulated_speedup": 1.05, "parameter": 0.3},
             "replay": {"policies": policies}}
    (root / "metrics").mkdir(exist_ok=True)
    (root / "metrics/train.json").write_text(json.dumps(train))
