"""Probability quality (AUC, log-loss, Brier, calibration error), curves, decision latency,
feature importance."""

from __future__ import annotations

import statistics
import time
from typing import Callable, TypeVar

import numpy as np
from sklearn.metrics import brier_score_loss, log_loss, roc_auc_score, roc_curve

EPS = 1e-7
Rows = TypeVar("Rows")  # a level's feature rows: numpy (a fitted model) or torch (a module)


def quality(y: np.ndarray, p: np.ndarray, bins: int = 15) -> dict[str, float | None]:
    """auc, log_loss, brier, ece of probabilities p for hard labels y (None if undefined)."""
    p = np.clip(p, EPS, 1 - EPS)
    both = y.min() != y.max() if y.size else False
    return {"auc": float(roc_auc_score(y, p)) if both else None,
            "log_loss": float(log_loss(y, p, labels=[0, 1])) if y.size else None,
            "brier": float(brier_score_loss(y, p)) if y.size else None,
            "calibration_error": expected_calibration_error(y, p, bins) if y.size else None}


def expected_calibration_error(y: np.ndarray, p: np.ndarray, bins: int = 15) -> float:
    """Row-weighted mean |observed rate - mean prediction| over equal-count bins."""
    table = calibration_table(y, p, bins)
    return float(sum(n * abs(obs - pred) for pred, obs, n in table) / len(y))


def calibration_table(y: np.ndarray, p: np.ndarray, bins: int = 15
                      ) -> list[tuple[float, float, int]]:
    """(mean prediction, observed rate, rows) per equal-count bin of p."""
    order = np.argsort(p, kind="stable")
    return [(float(p[idx].mean()), float(y[idx].mean()), len(idx))
            for idx in np.array_split(order, min(bins, len(p))) if len(idx)]


def roc_points(y: np.ndarray, p: np.ndarray, points: int = 200) -> list[tuple[float, float]]:
    """(fpr, tpr) thinned to about `points` points (empty if one class only)."""
    if y.min() == y.max():
        return []
    fpr, tpr, _ = roc_curve(y, p)
    keep = np.unique(np.linspace(0, len(fpr) - 1, min(points, len(fpr))).astype(int))
    return list(zip(fpr[keep].tolist(), tpr[keep].tolist()))


def decision_latency(predict: Callable[[Rows], object], level: Rows, repeats: int = 200
                     ) -> float:
    """Median seconds of one prediction for a batch of one level's feature rows."""
    predict(level)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        predict(level)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def permutation_importance(predict: Callable[[np.ndarray], np.ndarray], X: np.ndarray,
                           y: np.ndarray, names: list[str], seed: int = 0) -> dict[str, float]:
    """Drop in AUC when one feature column is shuffled (0 where AUC is undefined)."""
    if y.min() == y.max():
        return {name: 0.0 for name in names}
    rng = np.random.default_rng(seed)
    base = roc_auc_score(y, predict(X))
    out = {}
    for j, name in enumerate(names):
        shuffled = X.copy()
        shuffled[:, j] = rng.permutation(shuffled[:, j])
        out[name] = float(base - roc_auc_score(y, predict(shuffled)))
    return out


def feature_aucs(y: np.ndarray, X: np.ndarray, names: list[str]) -> dict[str, tuple[float, float]]:
    """{name: (AUC, sign)} of every non-constant raw feature column as a score, in the better
    orientation (sign -1: lower values mean accepted); empty where y has one class."""
    if y.min() == y.max():
        return {}
    out = {}
    for j, name in enumerate(names):
        if X[:, j].min() < X[:, j].max():
            auc = float(roc_auc_score(y, X[:, j]))
            out[name] = (max(auc, 1 - auc), 1.0 if auc >= 0.5 else -1.0)
    return out


def auc_difference_interval(y: np.ndarray, a: np.ndarray, b: np.ndarray, groups: np.ndarray,
                            resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of AUC(a) - AUC(b) on the same rows, prompts resampled with
    replacement (rows of a prompt are not independent)."""
    codes, members = np.unique(groups, return_inverse=True)
    rows = [np.flatnonzero(members == g) for g in range(len(codes))]
    rng = np.random.default_rng(seed)
    differences = []
    for _ in range(resamples):
        pick = np.concatenate([rows[g] for g in rng.integers(0, len(rows), len(rows))])
        if y[pick].min() != y[pick].max():
            differences.append(roc_auc_score(y[pick], a[pick]) - roc_auc_score(y[pick], b[pick]))
    if not differences:
        return float("nan"), float("nan")
    low, high = np.percentile(differences, [2.5, 97.5])
    return float(low), float(high)
