"""Stopping rules scored by the replay, and their tuning on val.

Every rule is "after drafting level d, draft level d + 1 while some node of level d has a score
above a threshold"; the scores and the comparison are the runtime's own (`decoder.policy`):

- fixed gamma: depth < gamma (`Replay.fixed`), gamma tuned over 1..max_depth;
- confidence (transformers' rule): score = q_token, the draft's probability of its own token;
- entropy: score = -q_entropy (continue while the entropy is below t);
- a learned model, plain threshold: score = p-hat, the predicted acceptance of the token;
- a learned model, cost-aware (STOPPING.md): continue while P_d * a-hat > rho * (c + v).
  After level d is drafted the runtime has, per node, p-hat_d (its acceptance given its branch
  so far) and P_d = prod_{i<=d} p-hat_i along the branch (every drafted token of the branch
  accepted).  The next token's acceptance a-hat_{d+1} is unknown until level d + 1 is drafted,
  so the last prediction stands in for it: a-hat_{d+1} := p-hat_d.  c + v is the measured cost
  (`ar` steps) of drafting level d + 1 and widening the target pass by it, decision latency
  included (`CostModel.marginal_cost`), so the threshold depends on d.  rho is found by
  Dinkelbach's iteration: start at the best static speed, replay, set rho to the speed, repeat.

Thresholds are tuned on the split replayed (val): the reported speeds are optimistic by the
tuning; the test split stays for the measured benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specstop.decoder.costs import CostModel
from specstop.decoder.policy import continues, cost_aware_score

from .simulate import Replay, SimResult


@dataclass(frozen=True)
class Tuned:
    rule: str
    parameter: float  # gamma, threshold or rho
    result: SimResult
    curve: list[tuple[float, float]] = field(default_factory=list)  # (parameter, speedup)


def best_fixed(replay: Replay, costs: CostModel) -> Tuned:
    """The best static draft length on the replayed split."""
    results = [(g, replay.simulate(replay.fixed(g), costs))
               for g in range(1, replay.max_depth + 1)]
    gamma, best = max(results, key=lambda r: r[1].speedup)
    return Tuned("fixed", float(gamma), best, [(float(g), r.speedup) for g, r in results])


def tune_threshold(replay: Replay, costs: CostModel, score: np.ndarray, grid: int,
                   extra: float = 0.0, rule: str = "threshold") -> Tuned:
    """The threshold t maximising simulated speed for "continue while any score > t"."""
    level_max = replay.level_max(score)
    curve = []
    best: tuple[float, SimResult] | None = None
    for t in _candidates(level_max, grid):
        result = replay.simulate(replay.cut(continues(level_max, t)), costs, extra)
        curve.append((float(t), result.speedup))
        if best is None or result.speedup > best[1].speedup:
            best = (float(t), result)
    return Tuned(rule, best[0], best[1], curve)


def cost_aware_scores(replay: Replay, costs: CostModel, p: np.ndarray,
                      extra: float = 0.0) -> np.ndarray:
    """[n] the cost-aware score of every row: the rule continues while it exceeds rho."""
    return cost_aware_score(replay.path_product(p), p, costs.marginal_cost(extra), replay.level)


def tune_cost_aware(replay: Replay, costs: CostModel, p: np.ndarray, start_rho: float,
                    iterations: int, grid: int, extra: float = 0.0) -> Tuned:
    """rho by Dinkelbach's iteration from `start_rho`; the curve sweeps rho for the plots."""
    score = cost_aware_scores(replay, costs, p, extra)
    level_max = replay.level_max(score)
    rho, visited = start_rho, []
    for _ in range(max(iterations, 1)):
        result = replay.simulate(replay.cut(continues(level_max, rho)), costs, extra)
        visited.append((rho, result))
        if abs(result.speedup - rho) < 1e-9:
            break
        rho = result.speedup
    rho, result = max(visited, key=lambda v: v[1].speedup)
    sweep = tune_threshold(replay, costs, score, grid, extra).curve
    return Tuned("cost_aware", float(rho), result, sweep)


def _candidates(level_max: np.ndarray, grid: int) -> np.ndarray:
    """Quantiles of the drafted levels' scores, plus "always stop" and "never stop"."""
    values = level_max[np.isfinite(level_max)]
    quantiles = np.quantile(values, np.linspace(0, 1, grid)) if values.size else np.array([])
    return np.unique(np.concatenate([[-np.inf, np.inf], quantiles]))
