"""Speed ratios of two methods timed on the same prompts, with paired bootstrap intervals.

A ratio is throughput over throughput, (Σ tokens_a / Σ seconds_a) / (Σ tokens_b / Σ seconds_b)
over the prompts, the figure the bench table prints; its 95% interval resamples prompts with
replacement, the same prompts for both methods (paired), BCa (`scipy.stats.bootstrap`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Ratio:
    ratio: float
    ci95: tuple[float, float] | None  # None: fewer than 2 prompts, or every resample the same

    def as_dict(self) -> dict:
        return {"ratio": self.ratio, "ci95": None if self.ci95 is None else list(self.ci95)}


def speed_ratio(tokens_a: list[int], seconds_a: list[float], tokens_b: list[int],
                seconds_b: list[float], resamples: int = 10_000, seed: int = 0) -> Ratio:
    """Method a's throughput over method b's on the same prompts (per-prompt lists, same
    order), with a paired 95% bootstrap interval."""
    data = tuple(np.asarray(x, dtype=float) for x in (tokens_a, seconds_a, tokens_b, seconds_b))
    if len({len(x) for x in data}) != 1:
        raise ValueError("per-prompt lists of different lengths")
    ratio = float(_throughput_ratio(*data))
    if len(data[0]) < 2:
        return Ratio(ratio, None)
    with warnings.catch_warnings():  # a ratio the same in every resample: no interval
        warnings.simplefilter("ignore", (RuntimeWarning, stats.DegenerateDataWarning))
        result = stats.bootstrap(data, _throughput_ratio, paired=True, vectorized=True,
                                 n_resamples=resamples, confidence_level=CONFIDENCE,
                                 method="BCa", rng=np.random.default_rng(seed))
    low, high = result.confidence_interval
    if not (np.isfinite(low) and np.isfinite(high)):
        return Ratio(ratio, None)
    return Ratio(ratio, (float(low), float(high)))


def _throughput_ratio(tokens_a, seconds_a, tokens_b, seconds_b, axis: int = -1):
    return (tokens_a.sum(axis) / seconds_a.sum(axis)) / (tokens_b.sum(axis) / seconds_b.sum(axis))
