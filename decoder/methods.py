"""The round methods `ar`, `sd`, `mcsd`, `ti-mcsd`, `tree` and `lookup`: `DecodeConfig` names one,
and `round_method` picks, once, the `RoundMethod` that holds what differs between them, so the
loop (`loop.py`) compares no method names:

- its largest static tree (`tree_shape`; `ar` and `tree` the root alone, `tree` building its
  trees per round);
- what it runs on: a draft model (`drafts`), draft features every round whatever the policy reads
  (`reads_features`), the text's n-grams (`looks_up`);
- the policy it takes, its round gate and its depth cap (`depth_cap`: the deepest level a round
  proposes below its roots, before the budget);
- how a round proposes (`propose`): the root alone (`ar`), the static tree level by level
  while the stopping policy goes on (with `lookup_branch` the round's whole lookup chain beside
  it, as collect verifies its sampled rounds), the dynamic tree (`dynamic.propose_tree`, with the lookup
  chain as one more source with `lookup_branch`), the chain a look-up
  finds (`lookup.lookup_proposal`); and how a round the gate keeps from drafting proposes
  (`propose_gated`): the root alone, or in `tree` rounds with `lookup_branch` the root
  and the prefix of the chain that pays.

A `tree` decode whose policy names a static shape for its sampling (`policy.static_shape`: it
replayed faster than the policy's tree) is that shape's `mcsd` decode (`with_static_fallback`);
a greedy one with the lookup branch whose policy names a confidence tree (it decoded faster than
the policy's own tree) is that `ConfidenceTree`'s decode (`with_confidence_tree`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from specstop.common.params import METHODS
from specstop.features import RoundContext, draft_features, feature_index

from .contracts import Proposal
from .drafter import Drafter, draft_level
from .dynamic import propose_chain, propose_tree
from .lookup import Lookup, LookupBranch, lookup_branch, lookup_proposal, with_chain
from .policy import ConfidenceTree, FixedDepth, StoppingPolicy, TreePolicy, static_shape
from .round_gate import RoundGate
from .sampling import Sampling
from .tree import Tree

MAX_DEPTH = 64
MAX_TREE_NODES = 4096
PATH_CONFIDENCE = feature_index("path_confidence")
LOOKUP_AGREES = feature_index("lookup_agrees")


@dataclass(frozen=True)
class DecodeConfig:
    method: str = "sd"
    max_new_tokens: int = 128
    sampling: Sampling = Sampling()
    max_depth: int = 8  # deepest tree level the mask is built for
    mcsd_branching: tuple[int, ...] = (2, 2)  # leading widths of the mcsd tree, then 1s
    ti_width: int = 3  # branches of ti-mcsd
    lossy: bool = False  # ti-mcsd only: the published DynaSD selection
    without_replacement: bool = True
    lookup_ngram: int = 2  # lookup: the longest n-gram matched (then shorter ones, down to 1)
    lookup_branch: bool = False  # `tree`: the lookup chain as one more source of
    # candidates (a round the gate keeps from drafting proposes it alone); a static tree
    # (collect's sampled rounds): the whole chain beside the drafted tree (`lookup.with_chain`)
    lookup_tokens: int = 0  # the longest lookup branch (0: as deep as the round proposes)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method '{self.method}' (choose from {', '.join(METHODS)})")
        if self.lossy and self.method != "ti-mcsd":
            raise ValueError("--lossy applies to ti-mcsd only")
        if self.lookup_branch and (not round_method(self.method).drafts or self.lossy):
            raise ValueError("a lookup branch (lookup_branch) joins a drafted tree (tree, sd, "
                             f"mcsd, exact ti-mcsd), not '{self.method}'"
                             f"{' --lossy' if self.lossy else ''}")
        if self.max_new_tokens < 1 or self.max_depth < 1 or self.lookup_ngram < 1 \
                or self.lookup_tokens < 0:
            raise ValueError("max_new_tokens, max_depth and lookup_ngram must be >= 1, "
                             "lookup_tokens >= 0")
        if self.max_depth > MAX_DEPTH:
            raise ValueError(f"max_depth must be <= {MAX_DEPTH}, got {self.max_depth}")
        if self.ti_width < 1 or any(k < 1 for k in self.mcsd_branching):
            raise ValueError(f"ti_width and mcsd_branching must be >= 1, got {self.ti_width} "
                             f"and {list(self.mcsd_branching)}")
        roots, branching = round_method(self.method).tree_shape(self)
        nodes = level = roots
        for k in branching:
            level *= k
            nodes += level
        if nodes > MAX_TREE_NODES:
            raise ValueError(f"the {self.method} tree would have {nodes} nodes "
                             f"(at most {MAX_TREE_NODES}); lower the widths or max_depth")


@dataclass(frozen=True)
class Round:
    """What one round proposes below: its roots, drawn from r, at `root_position` (the committed
    length), at most `levels` deep (the depth cap, or less at the budget's end)."""

    roots: torch.Tensor  # [roots] long
    r: torch.Tensor  # [V] the distribution the roots were drawn from
    root_position: int
    levels: int
    context: RoundContext | None  # None: no features (no drafter, or nobody reads them)


class Proposed(NamedTuple):
    """A round's proposal, the tree it is a slice of, and the wall time of the policy's
    decisions (timing, kept out of the Proposal's data)."""

    tree: Tree
    proposal: Proposal
    decision_seconds: float


class RoundMethod:
    """A static-tree method (`sd`, `mcsd`, `ti-mcsd`): a draft model drafts the method's tree
    level by level while the stopping policy goes on.  The other methods override what differs."""

    drafts = True  # runs a draft model
    reads_features = False  # its rounds read draft features whatever the policy reads
    looks_up = False  # proposes what the text's n-grams look up (`lookup.py`)

    def tree_shape(self, config: DecodeConfig) -> tuple[int, tuple[int, ...]]:
        """(roots, children per node at levels 1..max_depth) of the method's largest tree."""
        return 1, (1,) * config.max_depth  # a chain

    def checked_policy(self, config: DecodeConfig, tree: Tree, drafter: Drafter | None,
                       policy: StoppingPolicy | TreePolicy | None
                       ) -> StoppingPolicy | TreePolicy:
        """The rounds' policy (default: the tree's full depth), or a ValueError when the method
        lacks what it needs."""
        if self.drafts and drafter is None:
            raise ValueError(f"method '{config.method}' needs a drafter")
        return policy or FixedDepth(max(tree.max_depth, 1))

    def round_gate(self, policy: StoppingPolicy | TreePolicy) -> RoundGate | None:
        """The gate that may keep a round from drafting (`round_gate.py`); static methods have
        none."""
        return None

    def depth_cap(self, config: DecodeConfig, tree: Tree,
                  policy: StoppingPolicy | TreePolicy) -> int:
        """The deepest level a round proposes below its roots: the tree's, at most the policy's
        `max_levels`."""
        if policy.max_levels is None:
            return tree.max_depth
        return min(tree.max_depth, policy.max_levels)

    def propose(self, round: Round, drafter: Drafter | None, policy: StoppingPolicy | TreePolicy,
                tree: Tree, lookup: Lookup | None, config: DecodeConfig,
                generator: torch.Generator | None) -> Proposed:
        """Draft `tree` (the method's largest) below the round's roots (`propose`), with
        `lookup_branch` the round's whole lookup chain beside it (`lookup.with_chain`)."""
        proposal, decision_seconds = propose(drafter, tree.on(round.r.device), round, policy,
                                             config, generator)
        chain = lookup.chain(chain_tokens(round, config)) if config.lookup_branch else []
        if chain:
            tree, proposal = with_chain(tree, proposal, chain)
        return Proposed(tree, proposal, decision_seconds)

    def propose_gated(self, round: Round, policy: StoppingPolicy | TreePolicy, tree: Tree,
                      lookup: Lookup | None, config: DecodeConfig) -> Proposed:
        """A round its round gate keeps from drafting: the root alone, `ar`'s step."""
        return Proposed(tree, Proposal.root_alone(round.roots, round.root_position, round.r),
                        0.0)


class MultiCandidate(RoundMethod):
    """`mcsd`: mcsd_branching's leading widths, then chains."""

    def tree_shape(self, config: DecodeConfig) -> tuple[int, tuple[int, ...]]:
        d = config.max_depth
        widths = tuple(config.mcsd_branching[:d])
        return 1, widths + (1,) * (d - len(widths))


class TargetInitialized(RoundMethod):
    """`ti-mcsd`: ti_width chains below the root, or (lossy) below the target's top-W roots."""

    def tree_shape(self, config: DecodeConfig) -> tuple[int, tuple[int, ...]]:
        d = config.max_depth
        if config.lossy:  # the target's top-W tokens start W chains
            return config.ti_width, (1,) * d
        return 1, (config.ti_width,) + (1,) * (d - 1)  # exact: prune to the target's own root


class Autoregressive(RoundMethod):
    """`ar`: the root alone, nothing drafted."""

    drafts = False

    def tree_shape(self, config: DecodeConfig) -> tuple[int, tuple[int, ...]]:
        return 1, ()

    def propose(self, round: Round, drafter: Drafter | None, policy: StoppingPolicy | TreePolicy,
                tree: Tree, lookup: Lookup | None, config: DecodeConfig,
                generator: torch.Generator | None) -> Proposed:
        return self.propose_gated(round, policy, tree, lookup, config)


class PromptLookup(RoundMethod):
    """`lookup`: the chain the text's last n-gram looks up (at most the policy's depth, a fixed
    γ), no draft model."""

    drafts = False
    looks_up = True

    def propose(self, round: Round, drafter: Drafter | None, policy: StoppingPolicy | TreePolicy,
                tree: Tree, lookup: Lookup | None, config: DecodeConfig,
                generator: torch.Generator | None) -> Proposed:
        return Proposed(tree, lookup_proposal(lookup, round.roots, round.r, round.root_position,
                                              round.levels), 0.0)


class DynamicTree(RoundMethod):
    """`tree`: a dynamic tree per round, drafted and cut by a TreePolicy (`dynamic.py`), whose
    round gate may keep a round from drafting."""

    reads_features = True

    def tree_shape(self, config: DecodeConfig) -> tuple[int, tuple[int, ...]]:
        return 1, ()  # its rounds build their own trees

    def checked_policy(self, config: DecodeConfig, tree: Tree, drafter: Drafter | None,
                       policy: StoppingPolicy | TreePolicy | None
                       ) -> StoppingPolicy | TreePolicy:
        if drafter is None or not isinstance(policy, TreePolicy):
            got = "no drafter" if drafter is None else \
                "no policy" if policy is None else f"a {type(policy).__name__}"
            raise ValueError("method 'tree' needs a drafter and a tree policy (e.g. "
                             f"ConfidenceTree), got {got}")
        return policy

    def round_gate(self, policy: StoppingPolicy | TreePolicy) -> RoundGate | None:
        return getattr(policy, "round_gate", None)

    def depth_cap(self, config: DecodeConfig, tree: Tree,
                  policy: StoppingPolicy | TreePolicy) -> int:
        """max_depth (the tree rule's own depth cuts the drafted tree further, not a lookup
        branch)."""
        return config.max_depth

    def propose(self, round: Round, drafter: Drafter | None, policy: StoppingPolicy | TreePolicy,
                tree: Tree, lookup: Lookup | None, config: DecodeConfig,
                generator: torch.Generator | None) -> Proposed:
        branch = self._branch(round, policy, lookup, config)
        return Proposed(*propose_tree(drafter, policy, round.roots, round.r, round.root_position,
                                      round.levels, round.context, config.sampling,
                                      config.without_replacement, generator, branch))

    def propose_gated(self, round: Round, policy: StoppingPolicy | TreePolicy, tree: Tree,
                      lookup: Lookup | None, config: DecodeConfig) -> Proposed:
        """The root alone, or with a lookup branch the root and the prefix of the chain that pays
        (`dynamic.propose_chain`)."""
        branch = self._branch(round, policy, lookup, config)
        if branch is None:
            return super().propose_gated(round, policy, tree, lookup, config)
        return Proposed(*propose_chain(policy, round.roots, round.r, round.root_position, branch,
                                       config.sampling.greedy))

    @staticmethod
    def _branch(round: Round, policy: TreePolicy, lookup: Lookup | None, config: DecodeConfig
                ) -> LookupBranch | None:
        """The round's lookup chain with `lookup_branch`, else None."""
        return lookup_branch(lookup, chain_tokens(round, config), policy.lookup_model) \
            if config.lookup_branch else None


def chain_tokens(round: Round, config: DecodeConfig) -> int:
    """The longest lookup branch a round proposes: `lookup_tokens`, else its levels."""
    return config.lookup_tokens or round.levels


ROUND_METHODS: dict[str, RoundMethod] = {
    "ar": Autoregressive(), "sd": RoundMethod(), "mcsd": MultiCandidate(),
    "ti-mcsd": TargetInitialized(), "tree": DynamicTree(), "lookup": PromptLookup()}
assert tuple(ROUND_METHODS) == tuple(METHODS), "a method without its RoundMethod"


def with_static_fallback(config: DecodeConfig, policy: StoppingPolicy | TreePolicy | None
                         ) -> tuple[DecodeConfig, StoppingPolicy | TreePolicy | None]:
    """A `tree` decode whose policy names a static shape for this sampling, without a lookup
    branch (its replay had none), as that shape's `mcsd` decode, `FixedDepth` at its depth (at
    most `max_depth`); any other decode as it is."""
    shape = static_shape(policy, config.sampling.greedy)
    if config.method != "tree" or config.lookup_branch or shape is None:
        return config, policy
    depth = min(shape.depth, config.max_depth)
    return (replace(config, method="mcsd", mcsd_branching=shape.widths, max_depth=depth),
            FixedDepth(depth))


def with_confidence_tree(config: DecodeConfig, policy: StoppingPolicy | TreePolicy | None
                         ) -> StoppingPolicy | TreePolicy | None:
    """The policy of a greedy `tree` decode with the lookup branch: the draft's confidence tree
    with the policy's rule for it and its lookup model where it names one
    (`LearnedPolicy.confidence_tree`), else `policy` itself."""
    rule = getattr(policy, "confidence_tree", None)
    if config.method != "tree" or not config.lookup_branch or not config.sampling.greedy \
            or rule is None:
        return policy
    return ConfidenceTree(rule, lookup_model=policy.lookup_model)


def round_method(name: str) -> RoundMethod:
    """The RoundMethod of a method name (one of common.params.METHODS)."""
    return ROUND_METHODS[name]


def propose(
    drafter: Drafter,
    tree: Tree,  # on r's device
    round: Round,
    policy: StoppingPolicy,
    config: DecodeConfig,
    generator: torch.Generator | None,
) -> tuple[Proposal, float]:
    """Draft `tree` below the round's roots level by level, at most `round.levels` deep, while
    `policy` says go on; returns the proposal and the wall time of the policy's decisions.
    Features are computed only with a context; a policy that reads none is not called: it
    drafts `round.levels` (its `max_levels` are in the depth cap)."""
    roots, r = round.roots, round.r
    tokens, q_rows, feature_rows, decision_seconds = roots, [], [], 0.0
    confidence = on_chain = torch.ones(tree.roots, device=r.device)
    for depth in range(round.levels):
        logits = drafter.step(tree, depth, tokens[tree.level(depth)], round.root_position)
        drafted = draft_level(logits, drafter.vocab_ids, tree.branching[depth],
                              config.sampling, config.without_replacement, generator)
        kids = drafted.tokens
        tokens = torch.cat([tokens, kids.flatten()])
        q_rows.append(drafted.q)  # [n_depth, V]
        if round.context is None:
            continue
        level = tree.level(depth + 1)
        roots_of_kids = tree.root[level]  # also their rank among the roots
        features = draft_features(drafted.support_q, kids, depth + 1, roots_of_kids,
                                  r[roots][roots_of_kids], confidence, on_chain, round.context,
                                  drafted.columns)
        confidence, on_chain = features[:, PATH_CONFIDENCE], features[:, LOOKUP_AGREES]
        feature_rows.append(features)
        if policy.reads_features:
            start = time.perf_counter()
            go_on = bool(policy(features, tree.parent_row[level]).any())
            decision_seconds += time.perf_counter() - start
            if not go_on:
                break
    depth = len(q_rows)
    q_all = torch.cat(q_rows) if q_rows else r.new_zeros(0, r.shape[0])
    fed = torch.arange(tokens.shape[0])
    fed[tree.size(depth - 1):] = -1  # the levels above the last were fed (size(-1) = 0)
    return Proposal(tokens=tokens, depth=depth, root_position=round.root_position, q=q_all,
                    features=tuple(feature_rows), fed=fed, steps=depth,
                    drafted=tokens.shape[0] - tree.roots), decision_seconds

