"""Trained decision models (stage `train`'s files) as TorchScript with one interface:
`forward(features [N, F] float32) -> P(accept) [N]`, the prior correction included.

Logistic regression and the MLP are `torch.jit.script`-ed; LightGBM's trees are compiled to
tensor operations by hummingbird-ml (raw scores, traced) and wrapped in the same scripted
`Probability` head.  Each family also comes back with its trained reference predictions (the
saved arithmetic, NumPy / LightGBM), so the export can check that the file predicts the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from specstop.common.errors import SpecstopError
from specstop.common.files import write_atomic
from specstop.decoder.stop_model import GATE_KEYS, SAMPLING_KEYS, STATIC_KEYS, STOP_MODEL_META
from specstop.features import FEATURES, SCHEMA_VERSION

from .anchor import Anchor
from .families import LightGBM, logistic_proba
from .mlp import MLP, StopNet

FORMAT = "specstop-stop-model"
INTERFACE = "forward(features: float32 [N, F]) -> P(accept) [N]"


class LinearLogit(nn.Module):
    """features [n, F] -> logit [n]: the features and the anchor's logit, standardised, then a
    linear model."""

    def __init__(self, mean: list[float], scale: list[float], coef: list[float],
                 intercept: float, anchor: Anchor) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("scale", torch.tensor(scale, dtype=torch.float32))
        self.register_buffer("coef", torch.tensor(coef, dtype=torch.float32))
        self.register_buffer("intercept", torch.tensor(intercept, dtype=torch.float32))
        self.anchor = anchor.module()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.cat([x, self.anchor(x)[:, None]], dim=1)
        return ((z - self.mean) / self.scale) @ self.coef + self.intercept


class AnchoredLogit(nn.Module):
    """features [n, F] -> logit [n]: the anchor's plus a correction model's (LightGBM's trees)."""

    def __init__(self, correction: nn.Module, anchor: Anchor) -> None:
        super().__init__()
        self.correction = correction
        self.anchor = anchor.module()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.anchor(x) + self.correction(x).reshape(-1)


class Probability(nn.Module):
    """P(accept) [n] = sigmoid(logit(features) - offset); offset: the class-weight prior
    correction where the logit model does not carry it itself."""

    def __init__(self, logit: nn.Module, offset: float = 0.0) -> None:
        super().__init__()
        self.logit = logit
        self.offset = offset

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [n, F] -> [n]
        return torch.sigmoid(self.logit(features).reshape(-1) - self.offset)


@dataclass
class Exportable:
    family: str
    module: torch.jit.ScriptModule
    reference: Callable[[np.ndarray], np.ndarray]  # the trained model: X [n, F] -> P [n]


def exportable(folder: Path, family: str, example: np.ndarray,
               tree_implementation: str = "tree_trav") -> Exportable:
    """The scripted module and reference predictions of a family saved in `folder`; `example`
    [k, F] traces LightGBM's trees."""
    loaders = {"logistic": _logistic, "lightgbm": _lightgbm, "mlp": _mlp}
    if family not in loaders:
        raise SpecstopError(f"cannot export family '{family}' (known: {', '.join(loaders)})")
    try:
        module, reference = loaders[family](Path(folder), example, tree_implementation)
    except FileNotFoundError as err:
        raise SpecstopError(f"{folder}: {family} model file missing ({err.filename}); run "
                            f"`specstop train`") from err
    return Exportable(family, torch.jit.script(module.eval()), reference)


def _logistic(folder: Path, example: np.ndarray, tree_implementation: str):
    spec = json.loads((folder / "logistic.json").read_text())
    mean, scale, coef = (np.asarray(spec[k]) for k in ("mean", "scale", "coef"))
    anchor = Anchor.from_dict(spec["anchor"])

    def reference(X: np.ndarray) -> np.ndarray:
        return logistic_proba(X, mean, scale, coef, spec["intercept"], anchor)

    return Probability(LinearLogit(spec["mean"], spec["scale"], spec["coef"],
                                   spec["intercept"], anchor)), reference


def _lightgbm(folder: Path, example: np.ndarray, tree_implementation: str):
    import lightgbm as lgb
    from hummingbird.ml import convert

    path = folder / "lightgbm.txt"
    if not path.is_file():
        raise FileNotFoundError(2, "missing", str(path))
    booster = float32_splits(lgb.Booster(model_file=str(path)))
    spec = json.loads((folder / "lightgbm.json").read_text())
    offset, anchor = spec["logit_offset"], Anchor.from_dict(spec["anchor"])
    trees = convert(booster, "torch.jit", example.astype(np.float32),
                    extra_config={"tree_implementation": tree_implementation,
                                  "n_threads": torch.get_num_threads()}).model  # else all cores
    return (Probability(AnchoredLogit(trees, anchor), offset),
            LightGBM(booster, anchor, offset, {}).predict_proba)


def float32_splits(booster):
    """The booster with every numerical split's threshold t replaced by the largest float32 <= t.

    For a float32 feature x (what the runtime computes), x <= t exactly when x <= that float32,
    so the booster predicts as before on float32 features; hummingbird casts thresholds to
    float32 by rounding to nearest, which sends an x just above t left where LightGBM sends it
    right (a smoke run's val rows: raw scores off by up to 0.075).  With float32 thresholds the
    two decide every split alike (off by float32 rounding of the sums, 1e-7)."""
    import lightgbm as lgb

    lines, threshold = booster.model_to_string().splitlines(), None
    for i, line in enumerate(lines):
        if line.startswith("threshold="):
            threshold = i
        elif line.startswith("decision_type=") and threshold is not None:
            types = [int(v) for v in line.removeprefix("decision_type=").split()]
            values = [float(v) for v in lines[threshold].removeprefix("threshold=").split()]
            lines[threshold] = "threshold=" + " ".join(
                repr(t if kind & 1 else _float32_at_most(t)) for t, kind in zip(values, types))
            threshold = None  # bit 0 of a decision type: a categorical split, kept
    kept = [line for line in lines if not line.startswith("tree_sizes=")]  # byte offsets
    return lgb.Booster(model_str="\n".join(kept) + "\n")


def _float32_at_most(t: float) -> float:
    below = np.float32(t)
    if float(below) > t:
        below = np.nextafter(below, np.float32(-np.inf))
    return float(below)


def _mlp(folder: Path, example: np.ndarray, tree_implementation: str):
    spec = json.loads((folder / "mlp.json").read_text())
    anchor = Anchor.from_dict(spec["anchor"])
    net = StopNet(spec["n_features"], spec["hidden"], spec["dropout"], anchor)
    net.load_state_dict(load_file(folder / "mlp.safetensors"))
    return Probability(net.eval()), MLP(net, anchor, spec["hyperparameters"]).predict_proba


def metadata(family: str, summary: dict) -> dict:
    """The `specstop.json` carried inside the file: what the runtime checks and applies."""
    entry = summary["families"][family]
    return {"format": FORMAT, "interface": INTERFACE, "family": family,
            "features": [f.name for f in FEATURES],
            "feature_schema_version": summary["feature_schema_version"],
            "rule": entry["rule"], "threshold": entry["threshold"], "rho": entry["rho"],
            "marginal_cost": entry["marginal_cost"],
            "rule_text": summary[f"{entry['rule']}_rule"],
            "simulated_speedup": entry[f"{entry['rule']}_speedup"],
            "tree_rule": entry["tree_rule"], "tree_rule_text": summary["tree_rule"],
            "tree_speedup": entry["tree_speedup"], "tree_costs": entry.get("tree_costs"),
            **{key: entry.get(key) for key in SAMPLING_KEYS},
            **{key: entry.get(key) for key in GATE_KEYS},
            **{key: entry.get(key) for key in STATIC_KEYS.values()},
            "lookup_model": summary.get("lookup_model"),
            "label": summary["label"], "dataset_digest": summary["dataset_digest"],
            "mlflow_run_id": entry["run_id"], "mlflow_experiment": summary["experiment"]}


def save(module: torch.jit.ScriptModule, meta: dict, path: Path,
         check: Callable[[Path], None] | None = None) -> None:
    """torch.jit.save with the metadata as `_extra_files`, atomically: `check(file)` runs on
    the written file before it replaces `path`; if it raises, `path` is left as it was."""
    if meta["feature_schema_version"] != SCHEMA_VERSION:
        raise SpecstopError(f"the models were trained on feature schema version "
                            f"{meta['feature_schema_version']}, this specstop computes "
                            f"{SCHEMA_VERSION}; re-run collect and train")
    extra = {STOP_MODEL_META: json.dumps(meta, indent=1)}
    def write(tmp: Path) -> None:
        torch.jit.save(module, str(tmp), _extra_files=extra)
        if check is not None:
            check(tmp)

    write_atomic(path, write)
