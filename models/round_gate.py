"""The round gate (`decoder.round_gate`) fitted and tuned on logged rounds; `ar` as a policy.

Fit: a logistic regression on the train rounds' context features (`GATE_FEATURES`, the same on
every row of a round) predicting whether the round accepts at least one drafted token of the
superset tree (hard labels).  Tune: with a family's tuned tree rule, the threshold (a quantile
of the val rounds' predictions) maximising the val replay's speed, the rounds below it gated
off (the root alone, `ar`'s step).  Threshold 1 gates every round off: `ar` itself, speedup
exactly 1.  The gate is kept only when it beats the ungated rule on val; when `ar` is the
fastest, the exported rule says `fallback: ar`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
from sklearn.linear_model import LogisticRegression

from specstop.decoder.round_gate import GATE_FEATURES, RoundGate
from specstop.decoder.tree_rule import TreeRule

from specstop.collection.data import ROUND_KEYS
from specstop.replay.tree_replay import TreeCosts, TreeReplay, TreeResult

QUANTILES = tuple(np.round(np.arange(0.05, 0.65, 0.05), 2))  # shares of rounds gated off


@dataclass(frozen=True)
class GateChoice:
    gate: RoundGate | None  # None: every round drafts
    result: TreeResult  # the replay with the gate (`ar`: speedup 1)
    ungated: TreeResult  # the tree rule alone
    gated_share: float  # val rounds gated off

    @property
    def fallback(self) -> str | None:
        return "ar" if self.gate is not None and self.gate.never else None

    @property
    def kept(self) -> bool:
        """A gate that drafts some rounds."""
        return self.gate is not None and not self.gate.never

    def as_dict(self) -> dict:
        """The summary's and the stop model's fields."""
        return {"round_gate": self.gate.as_dict() if self.kept else None,
                "fallback": self.fallback, "gated_speedup": self.result.speedup,
                "gated_share": self.gated_share}

    def metrics(self) -> dict:
        """The replay's figures against `ar` (speedup 1): the tree rule alone and gated."""
        return {"vs_ar": self.result.speedup, "tree_vs_ar": self.ungated.speedup,
                "gated_share": self.gated_share, "round_gate": self.kept,
                "fallback": self.fallback}


def round_features(rows: pd.DataFrame) -> np.ndarray:
    """[R, len(GATE_FEATURES)] float64, rounds in `TreeReplay.from_rows` order."""
    grouped = rows.groupby(ROUND_KEYS, sort=False, observed=True)
    return grouped[list(GATE_FEATURES)].first().to_numpy(np.float64)


def round_accepts(rows: pd.DataFrame) -> np.ndarray:
    """[R] bool: the round accepted at least one drafted token."""
    hit = rows["label"].eq(1)
    return hit.groupby([rows[k] for k in ROUND_KEYS], sort=False, observed=True).any().to_numpy()


def fit(rows: pd.DataFrame, seed: int = 0) -> RoundGate | None:
    """The gate's logistic model on standardised features, folded back to raw ones (threshold
    0: always drafts, until tuned); None where the rounds hold one class only."""
    X, y = round_features(rows), round_accepts(rows)
    if y.all() or not y.any():
        return None
    mean, scale = X.mean(axis=0), X.std(axis=0)
    scale[scale == 0] = 1.0
    model = LogisticRegression(max_iter=1000, random_state=seed).fit((X - mean) / scale, y)
    coef = model.coef_[0] / scale
    return RoundGate(tuple(coef.tolist()), float(model.intercept_[0] - coef @ mean), 0.0)


def choose(replay: TreeReplay, p: np.ndarray, rule: TreeRule, costs: TreeCosts,
           fitted: RoundGate | None, X: np.ndarray) -> GateChoice:
    """The fastest of: no gate, the fitted gate at each quantile threshold, `ar` (X [R] the val
    rounds' gate features)."""
    ungated = replay.dynamic(p, rule, costs)
    best = GateChoice(None, ungated, ungated, 0.0)
    gates = [RoundGate.closed()]
    if fitted is not None:
        thresholds = np.unique(np.quantile(fitted.probability(X), QUANTILES))
        gates += [replace(fitted, threshold=float(t)) for t in thresholds]
    for gate in gates:
        off = ~gate.drafting(X)
        result = replay.dynamic(p, rule, costs, off)
        if result.speedup > best.result.speedup:
            best = GateChoice(gate, result, ungated, float(off.mean()))
    return best
