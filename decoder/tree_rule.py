"""The dynamic tree's budget rule: which drafted nodes to expand and which to verify.

Every node of a round's tree has a *survival* s: the chance it is accepted, the product along its
path of P(node accepted | parent accepted) (a policy's calibrated prediction; EAGLE-2 uses the
draft's own path confidence instead).  One round spends draft steps (one per level, its cost
growing with the number of nodes fed) and one target pass over the verified nodes (its cost
`verify_cost[n]` in `ar` steps: `decoder.costs.CostCurve.prices`, what the decode loop pays for
a pass over n tokens, padding included, at every n a round of the rule can verify).  With rho
the throughput to beat (tokens per `ar` step), the round maximises  expected tokens - rho *
cost:

- expand: after a level is drafted, feed the draft the candidates whose survival exceeds
  `expand` (at most `max_width` of them, the most likely first); their children are the next
  level's candidates (the draft's top `branching[d]`, in sampling order).  No candidate: stop.
- verify: the drafted nodes kept for the target pass are the n most likely, n maximising
  sum(s of the kept) - rho * verify_cost[1 + n]; the set is closed under parents and earlier
  siblings (a child is kept only with its parent and the siblings ranked before it, so the
  multi-candidate rule sees a prefix of each node's sampling order).  `prune` off keeps every
  drafted node: with sampling, dropping a node for its own token's score would bias the output.

The sampling rule (`rank_accept` set, Sequoia-style, cost-aware): r[d][j] estimates the chance
that the j-th child drafted at level d + 1 is accepted given its parent was and its earlier
siblings were not (fitted on sampled rounds' exact `accept_prob`, non-increasing in j). After
level d is drafted, the slot (node i, its j-th child) is worth s_i * r[d][j] expected tokens;
the level gets the k most valuable slots (k <= `max_width`; ties to the earlier node and rank)
where k maximises their worth minus rho * the verify cost they add, and none unless that gain
exceeds `expand`, what drafting the level costs in tokens. So a wide first level and no second
(the best static tree when deeper levels do not pay) is one of its trees. Each node's children
are a prefix of its sampling order; every drafted node is verified. Why it is exact: the number
k_i of candidates tested at node i is a function of the tree drafted before i's children (i's
own token, its ancestors, the other nodes of i's level) and of the fitted table, never of i's
children's draws or of the verification uniforms. Conditional on the path reaching i and on that
history, the k_i candidates are a fresh i.i.d. or without-replacement sample from q(.|path), and
multi-candidate speculative sampling emits exactly p(.|path) for any fixed k (k = 0: the bonus,
drawn from p); by induction along the path the output is target-only decoding's. What breaks it
is a node whose own inclusion depends on its own token (greedy `verify_set` under sampling): the
candidates tested are then a filtered sample of q and the residual is taken against the wrong q.

Fixed shapes, the draft's confidence and a learned model are instances: they differ only in
where s comes from.  The arithmetic is NumPy on one round; the decode loop and the replay
(`specstop.replay.tree_replay`) call the same functions, so what the replay tunes is what runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np


@dataclass(frozen=True)
class TreeRule:
    branching: tuple[int, ...]  # candidate children per fed node at levels 1..max_depth
    expand: float  # feed a candidate whose survival exceeds this
    rho: float  # tokens per `ar` step to beat
    max_width: int  # nodes fed per draft step at most (sampling rule: nodes per level)
    verify_cost: tuple[float, ...]  # [n] `ar` steps of a pass over n tokens (index 0 unused):
    # `CostCurve.prices`, up to 1 + max_nodes at least
    prune: bool = True  # drop drafted nodes not worth verifying (greedy decoding only)
    rank_accept: tuple[tuple[float, ...], ...] = ()  # [level][rank] r: the sampling rule (empty:
    # feed by survival, every child of a fed node)

    def __post_init__(self) -> None:
        if not self.branching or any(k < 1 for k in self.branching):
            raise ValueError(f"tree branching must be a non-empty list of widths >= 1, "
                             f"got {list(self.branching)}")
        if self.max_width < 1 or self.rho < 0 or not np.isfinite(self.expand):
            raise ValueError(f"max_width must be >= 1, rho >= 0 and expand finite, got "
                             f"{self.max_width}, {self.rho}, {self.expand}")
        if len(self.verify_cost) < 2 + self.max_nodes:
            raise ValueError(f"verify_cost must price every pass the rule can verify, up to "
                             f"1 + {self.max_nodes} tokens; it has {len(self.verify_cost)} "
                             f"entries")
        if self.rank_accept and (
                len(self.rank_accept) != self.max_depth
                or any(len(r) != k or any(b > a for a, b in zip(r, r[1:]))
                       for r, k in zip(self.rank_accept, self.branching))):
            raise ValueError("rank_accept needs one non-increasing row per level, as wide as "
                             f"its branching {list(self.branching)}")

    @property
    def max_depth(self) -> int:
        return len(self.branching)

    @property
    def max_nodes(self) -> int:
        """The most nodes a round drafts below the root: the root's `branching[0]` children,
        then at most min(level's nodes, max_width) nodes fed a level, `branching[d]` each (the
        sampling rule's levels hold at most max_width nodes, fewer still)."""
        level, total = self.branching[0], self.branching[0]
        for k in self.branching[1:]:
            level = min(level, self.max_width) * k
            total += level
        return total

    def exact_under(self, greedy: bool) -> "TreeRule":
        """The rule as exact decoding applies it: `prune` only under greedy decoding."""
        return self if greedy or not self.prune else replace(self, prune=False)

    def cost(self, n: int) -> float:
        """`ar` steps of a pass over n tokens (n <= 1 + max_nodes)."""
        return self.verify_cost[n]

    def as_dict(self) -> dict:
        return {**asdict(self), "branching": list(self.branching),
                "verify_cost": list(self.verify_cost),
                "rank_accept": [list(r) for r in self.rank_accept]}

    @classmethod
    def from_dict(cls, raw: dict) -> "TreeRule":
        return cls(tuple(int(k) for k in raw["branching"]), float(raw["expand"]),
                   float(raw["rho"]), int(raw["max_width"]),
                   tuple(float(c) for c in raw["verify_cost"]), bool(raw.get("prune", True)),
                   tuple(tuple(float(a) for a in r) for r in raw.get("rank_accept", ())))


def feed(survival: np.ndarray, rule: TreeRule) -> np.ndarray:
    """[m] bool: which candidates of the level just drafted to feed the draft (expand)."""
    keep = survival > rule.expand
    if keep.sum() > rule.max_width:
        order = np.lexsort((np.arange(len(survival)), -survival))
        keep = np.zeros(len(survival), dtype=bool)
        keep[order[: rule.max_width]] = True
        keep &= survival > rule.expand
    return keep


def children(survival: np.ndarray, level: int, rule: TreeRule,
             groups: np.ndarray | None = None, nodes: np.ndarray | int = 1) -> np.ndarray:
    """[m] children to draft below each node of `level` (0: the root) with survival [m]: all
    `branching[level]` of a fed node (`feed`; the root always), or the sampling rule's prefix
    (`_sampling_children`); `groups` [m]: the replay's rounds (one group by default), `nodes`
    [groups]: the nodes each round's tree holds so far, the root included."""
    width = rule.branching[level]
    if not rule.rank_accept:
        fed = np.ones(1, dtype=bool) if level == 0 else feed(survival, rule)
        return np.where(fed, width, 0)
    group = np.zeros(len(survival), np.int64) if groups is None else groups
    if np.isscalar(nodes):
        nodes = np.full(int(group.max(initial=0)) + 1, nodes)
    counts = _sampling_children(survival, np.asarray(rule.rank_accept[level]), group,
                                np.asarray(nodes), rule)
    return np.maximum(counts, 1) if level == 0 else counts  # the root: its first child at least


def _sampling_children(survival: np.ndarray, r: np.ndarray, group: np.ndarray,
                       nodes: np.ndarray, rule: TreeRule) -> np.ndarray:
    """[m] the sampling rule's children of each node: a slot (node i, its j-th child) is worth
    s_i * r[j] expected tokens; per group the k most valuable slots (k <= max_width) where k
    maximises their worth minus rho * the verify cost they add (a pass over nodes + k tokens
    instead of nodes), and none unless that gain exceeds `expand` (what drafting a level costs,
    in tokens)."""
    width = len(r)
    if len(survival) == 0:
        return np.zeros(0, dtype=np.int64)
    value = (survival[:, None] * r[None, :]).ravel()  # [m * width]
    slot_group = np.repeat(group, width)
    rank = _rank_within(value, slot_group)
    order = np.lexsort((rank, slot_group))  # each group's slots, most valuable first
    g, k = slot_group[order], rank[order] + 1
    first = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    run = np.repeat(np.arange(len(first)), np.diff(np.r_[first, len(g)]))
    worth = np.cumsum(value[order])
    worth -= np.r_[0.0, worth][first][run]  # the k most valuable slots of the group
    cost = np.asarray(rule.verify_cost)
    wider = nodes[g] + np.minimum(k, rule.max_width)  # the pass's tokens (k <= max_width)
    gain = np.where(k <= rule.max_width, worth - rule.rho * (cost[wider] - cost[nodes[g]]),
                    -np.inf)
    best = np.maximum.reduceat(gain, first)
    size = np.minimum.reduceat(np.where(gain == best[run], k, width + 1), first)  # the fewest
    # slots with the best gain
    size[best <= rule.expand] = 0
    keep = np.empty(len(value), dtype=bool)
    keep[order] = k <= size[run]
    return keep.reshape(-1, width).sum(axis=1)


def _rank_within(value: np.ndarray, group: np.ndarray) -> np.ndarray:
    """[n] each entry's rank within its group by value (descending, ties to the lower index)."""
    order = np.lexsort((np.arange(len(value)), -value, group))
    ordered = group[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    first = np.repeat(starts, np.diff(np.r_[starts, len(order)]))
    rank = np.empty(len(value), dtype=np.int64)
    rank[order] = np.arange(len(order)) - first
    return rank


def closed_survival(survival: np.ndarray, parent: np.ndarray, previous_sibling: np.ndarray
                    ) -> np.ndarray:
    """[n] survival capped by the parent's and the previous sibling's (nodes in tree order,
    parents and earlier siblings first; -1 for none): the ranking key whose every prefix is
    closed under parents and earlier siblings."""
    key = survival.astype(np.float64).copy()
    for i in range(len(key)):
        if parent[i] >= 0:
            key[i] = min(key[i], key[parent[i]])
        if previous_sibling[i] >= 0:
            key[i] = min(key[i], key[previous_sibling[i]])
    return key


def verify_set(survival: np.ndarray, parent: np.ndarray, previous_sibling: np.ndarray,
               rule: TreeRule) -> np.ndarray:
    """[n] bool: the drafted nodes (below the root, tree order; `parent` -1 for the root's
    children) kept for the target pass."""
    n = len(survival)
    if not rule.prune or n == 0:
        return np.ones(n, dtype=bool)
    key = closed_survival(survival, parent, previous_sibling)
    order = np.lexsort((np.arange(n), -key))
    gain = np.concatenate([[0.0], np.cumsum(survival[order])])
    cost = np.array([rule.cost(1 + k) for k in range(n + 1)])
    best = int(np.argmax(gain - rule.rho * cost))
    keep = np.zeros(n, dtype=bool)
    keep[order[:best]] = True
    return keep
