"""The draft's own confidence as every family's starting point.

A decision model that cannot beat the draft's probability of its token (`q_token`, the sanity
floor's best raw feature) is worse than no model, and on a few thousand labelled rows the
families fell just below it (README, the learned policy).  So each family predicts a
*correction* to an anchor, the one-feature logistic regression slope * logit(q_token) +
intercept fitted first on the same rows and weights: LightGBM boosts from it (`init_score`),
the MLP adds it to its output (its head starts at zero), and logistic regression takes it as
one more input, so its linear span holds the anchor itself.  Where the other features carry
nothing the held-out prompts can confirm, early stopping leaves a model at the anchor.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from torch import nn

from specstop.features import feature_index

FEATURE = "q_token"
EPS = 1e-6  # probabilities are clipped to [EPS, 1 - EPS] before the logit


@dataclass(frozen=True)
class Anchor:
    """slope * logit(X[:, feature]) + intercept."""

    feature: int
    slope: float
    intercept: float

    def logit(self, X: np.ndarray) -> np.ndarray:  # [n, F] -> [n]
        q = np.clip(X[:, self.feature].astype(np.float64), EPS, 1 - EPS)
        return self.slope * np.log(q / (1 - q)) + self.intercept

    def with_logit(self, X: np.ndarray) -> np.ndarray:  # [n, F] -> [n, F + 1]
        """The features and the anchor's logit as one more column (logistic regression)."""
        return np.concatenate([X, self.logit(X)[:, None].astype(X.dtype)], axis=1)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "Anchor":
        return cls(int(raw["feature"]), float(raw["slope"]), float(raw["intercept"]))

    def module(self) -> "AnchorLogit":
        return AnchorLogit(self)


def fit_anchor(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> Anchor:
    """The anchor fitted on rows X [n, F] with labels y [n] in [0, 1] and weights w [n] (soft
    labels as a weighted row of each class)."""
    feature = feature_index(FEATURE)
    q = np.clip(X[:, feature].astype(np.float64), EPS, 1 - EPS)
    z = np.log(q / (1 - q))
    n = len(y)
    weights = np.concatenate([w * y, w * (1 - y)])
    keep = weights > 0
    classes = np.concatenate([np.ones(n), np.zeros(n)])[keep]
    if len(np.unique(classes)) < 2:  # one class only: the logit of its weighted rate
        rate = float(np.clip(np.sum(w * y) / max(np.sum(w), EPS), EPS, 1 - EPS))
        return Anchor(feature, 0.0, float(np.log(rate / (1 - rate))))
    fit = LogisticRegression(C=1e6, max_iter=1000).fit(
        np.concatenate([z, z])[keep, None], classes, sample_weight=weights[keep])
    return Anchor(feature, float(fit.coef_[0, 0]), float(fit.intercept_[0]))


class AnchorLogit(nn.Module):
    """features [n, F] -> the anchor's logit [n] (the exported and the trained MLP's form), in
    float64 like the NumPy form: in float32, 1 - EPS is off by 3% of EPS."""

    def __init__(self, anchor: Anchor) -> None:
        super().__init__()
        self.feature = anchor.feature
        self.eps = EPS
        self.register_buffer("slope", torch.tensor(anchor.slope, dtype=torch.float64))
        self.register_buffer("intercept", torch.tensor(anchor.intercept, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x[:, self.feature].double().clamp(self.eps, 1 - self.eps)
        return (self.slope * torch.log(q / (1 - q)) + self.intercept).to(x.dtype)
