"""The round gate: before drafting, draft this round or emit the root alone (`ar`'s step).

It reads what is known before the first draft step (`GATE_FEATURES`: the position, the
acceptance history, the target's root distribution and the root's probability) and drafts iff
a logistic score `coef . x + intercept` exceeds the logit of `threshold`: a dot product per round
(one host read of the 7 features, on a GPU a sync before drafting).  A round gated off is one
one-token target pass, exactly `ar`'s step; its draft catches up on the committed tokens the
next time it drafts (`Drafter.commit` with nothing fed).  A gate whose threshold is 1 never
drafts: the stop model's `fallback: ar` (no drafting policy beats `ar` on the cost curve it was
tuned for), and the loop then runs no draft at all.  The replay (`specstop.models.round_gate`)
fits the gate and tunes its threshold with `drafting`, the same arithmetic on arrays.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from specstop.features import RoundContext

# the order of RoundContext.scalars, then the root token's target probability
GATE_FEATURES = ("tokens_generated", "prev_accepted", "running_acceptance", "accepted_ema",
                 "root_entropy", "root_margin", "root_target_prob")


@dataclass(frozen=True)
class RoundGate:
    coef: tuple[float, ...]  # [len(GATE_FEATURES)] on the raw features
    intercept: float
    threshold: float  # draft when the predicted probability exceeds it (1: never)

    def __post_init__(self) -> None:
        if len(self.coef) != len(GATE_FEATURES) or not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"a round gate needs {len(GATE_FEATURES)} coefficients and a "
                             f"threshold in [0, 1], got {len(self.coef)} and {self.threshold}")

    @classmethod
    def closed(cls) -> "RoundGate":
        """The gate that never drafts (`fallback: ar`)."""
        return cls((0.0,) * len(GATE_FEATURES), 0.0, 1.0)

    @property
    def never(self) -> bool:
        return self.threshold >= 1.0

    @property
    def margin(self) -> float:
        """The logit of the threshold: draft iff the score exceeds it."""
        t = self.threshold
        return math.inf if t >= 1.0 else -math.inf if t <= 0.0 else math.log(t / (1 - t))

    def probability(self, X: np.ndarray) -> np.ndarray:  # [n, len(GATE_FEATURES)] -> [n]
        return 1 / (1 + np.exp(-(X @ np.array(self.coef) + self.intercept)))

    def drafting(self, X: np.ndarray) -> np.ndarray:  # [n, len(GATE_FEATURES)] -> [n] bool
        """The replay's `drafts`: which rounds draft."""
        return X @ np.array(self.coef) + self.intercept > self.margin

    def drafts(self, context: RoundContext | None, root_prob: torch.Tensor) -> bool:
        """Whether this round drafts; `root_prob` [1] the root's target probability."""
        if self.never or context is None:
            return False
        x = torch.cat([context.scalars, root_prob.float().to(context.scalars.device)]).tolist()
        return sum(c * v for c, v in zip(self.coef, x)) + self.intercept > self.margin

    def as_dict(self) -> dict:
        return {**asdict(self), "coef": list(self.coef), "features": list(GATE_FEATURES)}

    @classmethod
    def from_dict(cls, raw: dict) -> "RoundGate":
        if list(raw.get("features", GATE_FEATURES)) != list(GATE_FEATURES):
            raise ValueError(f"round gate features {raw['features']} are not "
                             f"{list(GATE_FEATURES)}")
        return cls(tuple(float(c) for c in raw["coef"]), float(raw["intercept"]),
                   float(raw["threshold"]))
