"""The rows a decision model is fitted on: class weights, the prompts held out of them, and the
anchor every family corrects (`anchor.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specstop.common.errors import DataError

from .anchor import Anchor, fit_anchor


@dataclass(frozen=True)
class FitData:
    """Training rows and the prompts held out of them for early stopping and search."""

    X: np.ndarray  # [n, F] float32
    y: np.ndarray  # [n] in [0, 1]
    w: np.ndarray  # [n] class weights
    X_stop: np.ndarray  # [m, F] early-stopping rows (other prompts)
    y_stop: np.ndarray  # [m]
    w_stop: np.ndarray  # [m]
    logit_offset: float  # log(w1 / w0): subtract from the fitted logit
    anchor: Anchor  # fitted on (X, y, w): the logit a family starts from


def fit_data(X: np.ndarray, y: np.ndarray, groups: np.ndarray, class_weight: str,
             stop_fraction: float, seed: int) -> FitData:
    """Hold out a fraction of the training prompts (never rows of a prompt) and weight classes."""
    if class_weight not in ("balanced", "none"):
        raise DataError(f"train.class_weight must be 'balanced' or 'none', got '{class_weight}'")
    prompts = np.unique(groups)
    rng = np.random.default_rng(seed)
    held = rng.choice(prompts, size=max(1, int(round(stop_fraction * len(prompts)))),
                      replace=False) if len(prompts) > 1 else np.array([])
    stop = np.isin(groups, held)
    w1, w0 = _class_weights(y[~stop], class_weight)
    weights = (w1 * y + w0 * (1 - y)).astype(np.float32)
    return FitData(X[~stop], y[~stop], weights[~stop], X[stop], y[stop], weights[stop],
                   float(np.log(w1 / w0)), fit_anchor(X[~stop], y[~stop], weights[~stop]))


def _class_weights(y: np.ndarray, class_weight: str) -> tuple[float, float]:
    """(w1, w0): each class weighs half of the total when balanced."""
    if class_weight == "none":
        return 1.0, 1.0
    positive = float(np.clip(y.mean(), 1e-6, 1 - 1e-6))
    return 0.5 / positive, 0.5 / (1 - positive)
