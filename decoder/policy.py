"""Stopping policies: after each draft step, decide whether to draft one level deeper; tree
policies: how likely each drafted token is to be accepted (the `tree` method's survival).

A policy is batch-first: it sees the feature vectors [n, F] of the tokens just drafted (one row
per tree node of that level, `specstop.features`) and returns bool [n], True where drafting
should go on below that token.  The decode loop continues while any node says so; the level
just drafted is always verified.  No `.item()` inside a policy.  `parents` [n] gives each
node's parent as a row of the previous call's level (depth > 1; at depth 1 the parents are
roots), so a policy may keep per-branch state within a round (e.g. a product of predictions).
A policy drafts at most `max_levels` levels (None: no cap); one that does not `reads_features`
decides from the depth alone (`FixedDepth`): the loop computes no features for it and never
calls it, so its rounds take no decision and no sync.

A `TreePolicy` instead predicts p-hat [n] = P(token accepted | parent accepted) from the same
features; its `tree_rule` (`tree_rule.py`) turns the products of p-hat along each path into
which nodes to expand and which to verify.  One may name a `StaticShape` it decodes instead,
greedy or sampled (`static_shape`): the static tree that beat it in its replay.

The rules' arithmetic is written once, below, on arrays of either kind (torch here, NumPy in
the replay, `specstop.replay.rules`), so what the replay tunes is what the runtime applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specstop.features import feature_index

from .lookup import LookupModel
from .tree_rule import TreeRule

DEPTH = feature_index("depth")
Q_TOKEN = feature_index("q_token")
Q_ENTROPY = feature_index("q_entropy")


def continues(score, threshold):  # [n] scores -> [n] bool
    """Every threshold rule: draft below a node while its score exceeds the threshold."""
    return score > threshold


def confidence_score(features):  # [n, F] -> [n]
    """transformers' rule: the draft's probability of its own token."""
    return features[:, Q_TOKEN]


def entropy_score(features):  # [n, F] -> [n]
    """Minus the draft distribution's entropy (continue while the entropy is below -t)."""
    return -features[:, Q_ENTROPY]


def cost_aware_score(path_product, p, marginal, level):  # [n] each -> [n]
    """P_d * p-hat_d / (c + v)_d: the chance the branch so far and the next token are accepted
    (p-hat_d standing in for the next token's) per unit cost of drafting and verifying level
    d + 1, `marginal[d]` in target steps (index d = `level`, 1 = the first drafted level)."""
    return path_product * p / marginal[level]


class StoppingPolicy(Protocol):
    name: str
    max_levels: int | None
    reads_features: bool

    def __call__(self, features: torch.Tensor,
                 parents: torch.Tensor | None = None) -> torch.Tensor:  # [n, F] -> [n] bool
        ...


class FixedDepth:
    """Static draft length γ: draft exactly γ levels (or fewer at the tree's or budget's end)."""

    reads_features = False

    def __init__(self, gamma: int) -> None:
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.gamma = self.max_levels = gamma
        self.name = f"fixed-{gamma}"

    def __call__(self, features: torch.Tensor, parents: torch.Tensor | None = None) -> torch.Tensor:
        return features[:, DEPTH] < self.gamma


class ConfidenceThreshold:
    """Go on while the draft's probability of its own token exceeds t (transformers' rule)."""

    max_levels = None
    reads_features = True

    def __init__(self, threshold: float) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold
        self.name = f"confidence-{threshold:g}"

    def __call__(self, features: torch.Tensor, parents: torch.Tensor | None = None) -> torch.Tensor:
        return continues(confidence_score(features), self.threshold)


@runtime_checkable
class TreePolicy(Protocol):
    name: str
    tree_rule: TreeRule
    sampling_rule: TreeRule | None  # the rule tuned on sampled rounds (`decoding_rule`)
    lookup_model: LookupModel | None  # a lookup chain's P(accepted | parent accepted) (None:
    # certain)

    def probabilities(self, features: torch.Tensor) -> torch.Tensor:  # [n, F] -> [n] float
        ...


@dataclass(frozen=True)
class StaticShape:
    """A static tree every round: `widths` children per node at levels 1, 2, ... (then 1),
    drafted `depth` levels deep (`mcsd`'s tree, `FixedDepth`)."""

    widths: tuple[int, ...]
    depth: int

    @classmethod
    def from_dict(cls, raw: dict) -> "StaticShape":
        """{"widths": [...], "depth": d} (other keys ignored); a ValueError names the field."""
        shape = cls(tuple(int(w) for w in raw["widths"]), int(raw["depth"]))
        if not shape.widths or min(shape.widths) < 1 or shape.depth < 1:
            raise ValueError(f"a static shape needs widths >= 1 and depth >= 1, got {raw!r}")
        return shape


def static_shape(policy: object, greedy: bool) -> StaticShape | None:
    """The static shape a tree policy decodes instead of its tree, greedy or sampled (its
    `static_shapes`; none for a policy without)."""
    return getattr(policy, "static_shapes", {}).get(greedy)


def exported_lookup_branch(policy: object, greedy: bool) -> bool:
    """Whether a tree policy's file decodes its tree with the lookup branch, greedy or sampled
    (its `lookup_branches`; no for a policy without)."""
    return getattr(policy, "lookup_branches", {}).get(greedy, False)


def decoding_rule(policy: TreePolicy, greedy: bool) -> TreeRule:
    """The rule a decode applies: greedy, the policy's tree rule; sampling, its sampling rule
    (exact by construction) where it has one, else its tree rule verifying all it drafts."""
    rule = policy.tree_rule if greedy or policy.sampling_rule is None else policy.sampling_rule
    return rule.exact_under(greedy)


class ConfidenceTree:
    """EAGLE-2's dynamic tree: p-hat is the draft's probability of its own token, so a node's
    survival is the draft's confidence in its path."""

    def __init__(self, rule: TreeRule, sampling_rule: TreeRule | None = None,
                 lookup_model: LookupModel | None = None) -> None:
        self.tree_rule, self.sampling_rule = rule, sampling_rule
        self.lookup_model = lookup_model
        self.name = f"confidence-tree-{rule.expand:g}"

    def probabilities(self, features: torch.Tensor) -> torch.Tensor:
        return confidence_score(features)
