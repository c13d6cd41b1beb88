"""Offline policy evaluation: replay logged rounds under the recorded cost model.

A round was logged drafted to its full depth (`cap`, the tree's depth or less where the token
budget ended the generation).  A policy is applied as in `specstop.decoder.loop`: after drafting
level d it sees the features of every node of level d (those below a rejection too: the runtime
cannot know) and the round goes on while any node says continue, so a round is cut at a depth
1 <= D <= cap.  A round cut at D yields `gain[D] + 1` tokens (the accepted tokens plus the
target's own next token) and costs D draft steps (each at the width of the level it extends,
plus the feature/decision latency) and one target pass over the tree cut at D, as the decode
loop pays it (`CostModel.round_cost`).  `ar` costs one `ar` step (a one-token pass as the loop
pays it) per token, the unit of every cost, so the speedup vs `ar` is tokens per unit of cost.

`gain[D]` is the expected number of accepted levels of the tree cut at D.  Hard labels (greedy):
the number of levels up to D with an accepted node, exact.  Soft labels (sampling), with
s = min(1, p/q): along one chain, sum_j prod_{i<=j} s_i, exact; where a node has several
children they are taken as tried in rank order, independently, each accepted with its s
(multi-candidate recursive rejection with independent candidates; an approximation).

A run of the replayed policy starts its rounds at other positions of the output than the
logging run did: where a round of it yields more tokens it passes the text faster and starts
fewer rounds there.  `run_means` corrects for it (renewal weighting): the logging run started
a round every `logged` tokens, the replayed one every `tokens`, so a logged round stands for
logged / tokens of the replayed run's rounds, and every figure is a mean over the replayed run's
rounds.  Approximation: the text is the logging run's (exact under greedy decoding) and a round's
outcome is a function of its start position; context features (accepted history) were logged
under the logging policy, not the replayed one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from specstop.decoder.costs import CostModel

from specstop.collection.data import ROUND_KEYS


@dataclass(frozen=True)
class SimResult:
    speedup: float  # tokens per second relative to ar
    tokens_per_call: float  # mean accepted tokens (+ the target's own) per target call
    wasted_steps: float  # mean drafted levels per round beyond the accepted ones
    mean_depth: float  # mean drafted levels per round

    def as_dict(self) -> dict:
        return {"simulated_speedup": self.speedup, "tokens_per_call": self.tokens_per_call,
                "wasted_draft_steps": self.wasted_steps, "mean_depth": self.mean_depth}


@dataclass(frozen=True)
class Replay:
    """The rounds of one split, ready to score any stopping policy."""

    round_index: np.ndarray  # [n] round of each row (0..R-1)
    level: np.ndarray  # [n] level of each row (1 = first drafted)
    parent_row: np.ndarray  # [n] row of the parent, -1 where the parent is a root
    cap: np.ndarray  # [R] deepest drafted level of each round
    gain: np.ndarray  # [R, max_depth + 1] expected accepted levels of the round cut at D
    max_depth: int

    @property
    def logged(self) -> np.ndarray:
        """[R] the tokens each logged round yielded (drafted to its cap)."""
        return self.gain[np.arange(self.rounds), self.cap] + 1

    @classmethod
    def from_rows(cls, rows: pd.DataFrame, label: str) -> "Replay":
        """`rows` ordered by (prompt, round, node), as `collection.data.Split.rows`."""
        round_index = rows.groupby(ROUND_KEYS, sort=False).ngroup().to_numpy()
        level = rows["depth"].to_numpy().astype(np.int64)
        parent_row = parent_rows(round_index, rows["node"].to_numpy(), rows["parent"].to_numpy())
        cap = np.zeros(round_index.max() + 1, dtype=np.int64)
        np.maximum.at(cap, round_index, level)
        accept = ((rows["label"] == 1) if label == "hard" else rows["soft_label"]).to_numpy(float)
        gain = _gain(round_index, level, parent_row, accept, rows["parent"].to_numpy(),
                     len(cap), int(level.max()))
        return cls(round_index, level, parent_row, cap, gain, int(level.max()))

    @property
    def rounds(self) -> int:
        return len(self.cap)

    def level_max(self, score: np.ndarray) -> np.ndarray:
        """[R, max_depth] max of a per-row score over each level's nodes (-inf: not drafted)."""
        out = np.full((self.rounds, self.max_depth), -np.inf)
        np.maximum.at(out, (self.round_index, self.level - 1), score)
        return out

    def path_product(self, p: np.ndarray) -> np.ndarray:
        """[n] product of a per-row probability along each row's branch, from level 1."""
        return path_product(p, self.level, self.parent_row)

    def cut(self, go_on: np.ndarray) -> np.ndarray:
        """[R] depth D of each round given go_on [R, max_depth]: after level d, draft d + 1."""
        levels = np.arange(1, self.max_depth + 1)
        go_on = go_on & (levels[None, :] < self.cap[:, None])
        return np.argmin(go_on, axis=1) + 1

    def fixed(self, gamma: int) -> np.ndarray:
        return np.minimum(gamma, self.cap)

    def simulate(self, depth: np.ndarray, costs: CostModel, extra: float = 0.0) -> SimResult:
        """Replay every round cut at `depth` [R]."""
        accepted = self.gain[np.arange(self.rounds), depth]
        tokens = accepted + 1
        cost = costs.round_cost(extra)[depth]
        return SimResult(*run_means(tokens, cost, self.logged, depth - accepted, depth))

    def first_rejection(self) -> np.ndarray:
        """Hard labels: stop right after the first rejected level, D = min(a + 1, cap): the
        rejected level is drafted, as by a perfect predictor of the token just drafted."""
        accepted = self.gain[np.arange(self.rounds), self.cap].astype(np.int64)
        return np.minimum(accepted + 1, self.cap)

    def oracle(self, costs: CostModel, iterations: int = 10) -> np.ndarray:
        """The upper bound: per round, the D maximising gain[D] + 1 - rho * cost(D), rho the
        resulting speedup (Dinkelbach), i.e. knowing each round's acceptance in advance.  Hard
        labels: D = max(a, 1), it stops exactly at the first rejection without drafting the
        rejected level (no wasted step, but at least one level: the loop drafts before asking)."""
        cost = costs.round_cost()
        levels = np.arange(self.max_depth + 1)
        allowed = (levels[None, :] >= 1) & (levels[None, :] <= self.cap[:, None])
        rho = 1.0
        for _ in range(iterations):
            value = np.where(allowed, self.gain + 1 - rho * cost[None, :], -np.inf)
            depth = np.argmax(value, axis=1)
            rho = self.simulate(depth, costs).speedup
        return depth


def run_means(tokens: np.ndarray, cost: np.ndarray, logged: np.ndarray,
              *values: np.ndarray) -> tuple[float, ...]:
    """(speed, tokens per round, the mean of each of `values`) over the rounds a run of the
    replayed policy starts, from [R] per logged round: its `tokens` (expected, >= 1) and `cost`,
    and the `logged` tokens the logging run passed from there (renewal weighting).  The run
    starts logged / tokens rounds per logged round, so its speed is
    sum(logged) / sum(logged * cost / tokens): for the logging policy itself (tokens ==
    logged), sum(tokens) / sum(cost) over the logged rounds, the logging run's own speed."""
    w = logged / tokens
    return (float((w * tokens).sum() / (w * cost).sum()), float(np.average(tokens, weights=w)),
            *(float(np.average(v, weights=w)) for v in values))


def path_product(p: np.ndarray, level: np.ndarray, parent_row: np.ndarray) -> np.ndarray:
    """[n] product of a per-row probability along each row's path from level 1 (rows of a
    round in tree order, `parent_row` -1 below the root)."""
    out = p.astype(np.float64).copy()
    for d in range(2, int(level.max(initial=1)) + 1):
        rows = np.flatnonzero((level == d) & (parent_row >= 0))
        out[rows] *= out[parent_row[rows]]
    return out


def parent_rows(round_index: np.ndarray, node: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """[n] the row of each row's parent within its round, -1 where the parent is a root."""
    width = int(node.max()) + 1
    lookup = np.full((round_index.max() + 1) * width, -1, dtype=np.int64)
    lookup[round_index * width + node] = np.arange(len(node))
    return np.where(parent >= 0, lookup[round_index * width + np.clip(parent, 0, None)], -1)


def _gain(round_index: np.ndarray, level: np.ndarray, parent_row: np.ndarray,
          accept: np.ndarray, parent: np.ndarray, rounds: int, max_depth: int) -> np.ndarray:
    """[R, max_depth + 1] expected accepted levels; children of a node tried in rank order."""
    siblings = pd.Series(1.0 - accept).groupby([round_index, parent])
    before = siblings.cumprod().groupby([round_index, parent]).shift(1, fill_value=1.0)
    reach = before.to_numpy() * accept  # this child is the one accepted at its parent
    gain = np.zeros((rounds, max_depth + 1))
    for depth in range(1, max_depth + 1):
        below = np.zeros(len(level))  # expected accepted levels below each row, cut at depth
        for d in range(depth, 0, -1):
            rows = np.flatnonzero(level == d)
            value = reach[rows] * (1.0 + below[rows])
            inner = parent_row[rows] >= 0
            np.add.at(below, parent_row[rows[inner]], value[inner])
            np.add.at(gain[:, depth], round_index[rows[~inner]], value[~inner])
    return gain
