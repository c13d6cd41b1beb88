"""The decode loop for `ar`, `sd`, `mcsd`, `ti-mcsd`, `tree` and `lookup`: `generate` and one
function per step.

State between rounds is the target's KV cache (every committed token) and `r`, the distribution
the next token is drawn from.  A round (1) draws the root(s) from r, (2) `propose`s: drafts the
method's static tree below them level by level until the stopping policy or the tree's depth
says stop (`tree`: drafts a dynamic tree and keeps the nodes worth verifying,
`dynamic.propose_tree`; a `tree` round its policy's `round_gate` keeps from drafting proposes
the root alone, `ar`'s step; `lookup`: the chain an n-gram of the text looks up, `lookup.py`),
(3) `score`s the tree in one target pass under its tree mask, (4) `verify`s, (5) `commit`s the
accepted path to both caches.  The steps talk through the contracts of `contracts.py` (Proposal
-> Scores -> Verdict).  `ar` is the same loop with nothing drafted.

A round keeps its tensors on the device: the tree and its masks are copied there once
(`Tree.on`), the root is drawn there and emitted with the accepted path, so a greedy round with a
policy that reads no features (`FixedDepth`) brings one tensor to the host, the path and its
tokens (`verify.py`), and the EOS and budget checks read that copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch

from specstop.common.params import METHODS
from specstop.features import RoundContext, draft_features, feature_index, root_statistics

from .contracts import Proposal, Scores, Verdict
from .costs import CostCurve
from .drafter import Drafter, draft_children
from .dynamic import propose_tree
from .kv import KVModel
from .lookup import Lookup, lookup_proposal, with_lookup_branch
from .policy import FixedDepth, StoppingPolicy, TreePolicy
from .round_gate import RoundGate
from .sampling import Sampling, sample, warp
from .tree import Tree
from .verify import acceptance, dynasd_select, verify_tree

MAX_DEPTH = 64
MAX_TREE_NODES = 4096
ACCEPTED_EMA_DECAY = 0.5  # weight of the previous average in the accepted-length EMA
PATH_CONFIDENCE = feature_index("path_confidence")
DRAFTLESS = ("ar", "lookup")  # the methods that run no draft model


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
    lookup_branch: bool = False  # greedy `tree`: the lookup chain as one more branch

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method '{self.method}' (choose from {', '.join(METHODS)})")
        if self.lossy and self.method != "ti-mcsd":
            raise ValueError("--lossy applies to ti-mcsd only")
        if self.lookup_branch and (self.method != "tree" or not self.sampling.greedy):
            raise ValueError("a lookup branch applies to greedy tree rounds only")
        if self.max_new_tokens < 1 or self.max_depth < 1 or self.lookup_ngram < 1:
            raise ValueError("max_new_tokens, max_depth and lookup_ngram must be >= 1")
        if self.max_depth > MAX_DEPTH:
            raise ValueError(f"max_depth must be <= {MAX_DEPTH}, got {self.max_depth}")
        if self.ti_width < 1 or any(k < 1 for k in self.mcsd_branching):
            raise ValueError(f"ti_width and mcsd_branching must be >= 1, got {self.ti_width} "
                             f"and {list(self.mcsd_branching)}")
        roots, branching = _tree_shape(self)
        nodes = level = roots
        for k in branching:
            level *= k
            nodes += level
        if nodes > MAX_TREE_NODES:
            raise ValueError(f"the {self.method} tree would have {nodes} nodes "
                             f"(at most {MAX_TREE_NODES}); lower the widths or max_depth")


@lru_cache(maxsize=64)
def tree_for(config: DecodeConfig) -> Tree:
    """The largest tree of a method; each round drafts a leading slice of it."""
    return Tree(*_tree_shape(config))


def _tree_shape(config: DecodeConfig) -> tuple[int, tuple[int, ...]]:
    """(roots, children per node at levels 1..max_depth) of a method's largest tree."""
    d = config.max_depth
    if config.method in ("ar", "tree"):  # `tree` builds its trees per round
        return 1, ()
    if config.method in ("sd", "lookup"):  # a chain
        return 1, (1,) * d
    if config.method == "mcsd":
        widths = tuple(config.mcsd_branching[:d])
        return 1, widths + (1,) * (d - len(widths))
    if config.lossy:  # the target's top-W tokens start W chains
        return config.ti_width, (1,) * d
    return 1, (config.ti_width,) + (1,) * (d - 1)  # exact: prune to the target's own root


@dataclass
class DecodeStats:
    new_tokens: int = 0
    target_calls: int = 0  # the prefill included
    draft_steps: int = 0
    drafted_levels: int = 0  # tree levels drafted (one per step)
    drafted_tokens: int = 0  # tree nodes drafted
    verified_tokens: int = 0  # drafted nodes in the target passes (fewer when `tree` prunes)
    accepted: int = 0  # drafted tokens accepted
    seconds: float = 0.0
    decision_seconds: float = 0.0  # wall time of the policy's decisions
    gated: int = 0  # rounds the round gate kept from drafting (the root alone)
    accepted_per_round: list[int] = field(default_factory=list)
    accepted_ema: float = 0.0  # EMA of accepted drafted tokens per round (0 before the first)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens generated per target call."""
        return self.new_tokens / max(self.target_calls, 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens per drafted level (at most one node of a level is accepted)."""
        return self.accepted / max(self.drafted_levels, 1)

    @property
    def last_accepted(self) -> int:
        """Drafted tokens accepted in the last round (0 before the first)."""
        return self.accepted_per_round[-1] if self.accepted_per_round else 0

    def add_round(self, proposal: Proposal, verified: int, accepted: int,
                  gated: bool = False) -> None:
        """Count one round: its proposal's draft steps (one level each), drafted tokens and
        decisions, `verified` drafted tokens in its target pass, `accepted` of them; a round
        `gated` off is a target call that leaves the acceptance history as it was."""
        self.target_calls += 1
        if gated:
            self.gated += 1
            return
        self.draft_steps += proposal.steps
        self.drafted_levels += proposal.steps
        self.drafted_tokens += proposal.drafted
        self.verified_tokens += verified
        self.decision_seconds += proposal.decision_seconds
        self.accepted += accepted
        self.accepted_per_round.append(accepted)
        self.accepted_ema = ACCEPTED_EMA_DECAY * self.accepted_ema \
            + (1 - ACCEPTED_EMA_DECAY) * accepted

    def add(self, other: "DecodeStats") -> None:
        """Accumulate another generation's counts (per-round history is not kept)."""
        for name in ("new_tokens", "target_calls", "draft_steps", "drafted_levels",
                     "drafted_tokens", "verified_tokens", "accepted", "seconds",
                     "decision_seconds", "gated"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def summary(self) -> str:
        return (f"{self.tokens_per_s:.2f} tokens/s, {self.mean_accepted:.2f} accepted tokens per "
                f"target call, acceptance rate {self.acceptance_rate:.3f}")


@dataclass(frozen=True)
class RoundRecord:
    """What the feature hook receives for every verified drafted token of a round (n tokens)."""

    round: int
    tokens: torch.Tensor  # [n] long
    depth: torch.Tensor  # [n] long, 1 = first drafted level
    parent: torch.Tensor  # [n] long, tree index of the parent (roots are 0..W-1)
    node: torch.Tensor  # [n] long, tree index of the token
    branch: torch.Tensor  # [n] long, its branch (Tree.branch)
    features: torch.Tensor  # [n, F] float32
    labels: torch.Tensor  # [n] int8: 1 accepted, 0 rejected, -1 after an earlier rejection
    p_target: torch.Tensor  # [n] target probability of the token at its parent
    q_draft: torch.Tensor  # [n] draft probability of the token at its parent
    accept_prob: torch.Tensor  # [n] float32 exact P(accepted | parent accepted, earlier
    # siblings rejected) (`verify.acceptance`)


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    stats: DecodeStats


FeatureHook = Callable[[RoundRecord], None]


def generate(
    target: KVModel,
    drafter: Drafter | None,
    prompt: torch.Tensor,  # [L] long
    config: DecodeConfig,
    policy: StoppingPolicy | TreePolicy | None = None,
    eos_id: int | None = None,
    hook: FeatureHook | None = None,
    generator: torch.Generator | None = None,
    costs: CostCurve | None = None,
) -> Generation:
    """Decode up to `config.max_new_tokens` tokens after `prompt`.

    `policy`: a StoppingPolicy for the static methods (default: their tree's full depth), a
    TreePolicy for `tree`.  `costs` (the target's measured cost curve) lets each target pass be
    padded to a cheaper width (`CostCurve.padded`); `hook` receives a RoundRecord per round
    (nothing is recorded without it).
    """
    tree = tree_for(config)  # `tree` rounds build their own
    policy = _checked_policy(config, tree, drafter, policy)
    gate = _round_gate(config, policy)
    if gate is not None and gate.never:  # `fallback: ar`: no round drafts, no draft runs
        drafter = None
    max_levels = config.max_depth if config.method == "tree" else tree.max_depth
    with_features = drafter is not None and (config.method == "tree" or hook is not None
                                             or policy.reads_features)
    stats, out, start = DecodeStats(), [], time.perf_counter()
    lookup = Lookup(prompt.tolist(), config.lookup_ngram) \
        if config.method == "lookup" or config.lookup_branch else None
    if lookup is not None and hook is not None:
        raise ValueError("a lookup proposal has no draft features for the hook")
    root_emitted = 0 if config.lossy else 1  # emitted whatever is accepted (exact), or not
    # 0. Prefill: both caches take the prompt; r is the target's next-token distribution.
    target.reserve(prompt.shape[0] + config.max_new_tokens + tree.size(tree.max_depth))
    r = prefill(target, drafter, prompt, config.sampling)
    stats.target_calls += 1
    while True:
        # 1. Roots, on the device: exact methods emit one draw from r (with the round's path, at
        # step 5); lossy ti-mcsd's top-W roots compete.
        roots = draw_roots(r, tree.roots, config, generator)
        emitted = len(out) + root_emitted  # tokens out once the root is
        if emitted >= config.max_new_tokens:  # the root alone fills the budget
            out.extend(roots[:root_emitted].tolist())
            break
        # 2. Propose: draft below the roots while the budget (one token per level) allows; a
        # round the gate keeps from drafting proposes the root alone.
        levels = min(max_levels, config.max_new_tokens - emitted - 1 + root_emitted)
        context = RoundContext(emitted, stats.last_accepted, stats.acceptance_rate,
                               stats.accepted_ema, root_statistics(r)) if with_features else None
        gated = gate is not None and not gate.drafts(context, r[roots])
        if gated:
            round_tree, proposal = tree, root_alone(roots, target.length, r)
        elif config.method == "tree":
            round_tree, proposal = propose_tree(drafter, policy, roots, r, target.length,
                                                levels, context, config.sampling,
                                                config.without_replacement, generator)
        elif lookup is not None:  # at most the policy's depth (a fixed γ)
            round_tree, proposal = tree, lookup_proposal(lookup, roots, r, target.length,
                                                         min(levels, policy.max_levels or levels))
        else:
            round_tree, proposal = tree, propose(drafter, tree.on(r.device), roots, r,
                                                 target.length, levels, policy, context,
                                                 config, generator)
        if config.lookup_branch:
            round_tree, proposal = with_lookup_branch(round_tree, proposal, lookup, levels)
        on_device = round_tree.on(r.device)
        # 3. Score: one target pass over the proposal.
        scores = score(target, on_device, proposal, config.sampling, costs,
                       () if drafter is None else drafter.target_layers)
        # 4. Verify.
        verdict = verify(on_device, proposal, scores, config, eos_id, generator)
        if root_emitted and verdict.path_tokens[0] == eos_id:  # the root ended the sequence
            out.append(eos_id)
            break
        # 5. Commit the accepted path to both caches and emit it, root first.
        commit(target, drafter, proposal, scores, verdict)
        out.extend(verdict.path_tokens)
        if lookup is not None:  # its root is in already
            lookup.extend(verdict.path_tokens[1:])
        stats.add_round(proposal, round_tree.size(proposal.depth) - round_tree.roots,
                        len(verdict.path) - 1, gated)
        if hook is not None and proposal.depth > 0:
            hook(_round_record(len(stats.accepted_per_round) - 1, round_tree, proposal, scores,
                               verdict, config))
        if verdict.next_dist is None or len(out) >= config.max_new_tokens:
            break
        r = verdict.next_dist
    del out[config.max_new_tokens:]
    stats.new_tokens = len(out)
    stats.seconds = time.perf_counter() - start
    return Generation(out, stats)


def _checked_policy(config: DecodeConfig, tree: Tree, drafter: Drafter | None,
                    policy: StoppingPolicy | TreePolicy | None) -> StoppingPolicy | TreePolicy:
    """The round's policy, or a ValueError when the method lacks what it needs."""
    if config.method == "tree":
        if drafter is None or not isinstance(policy, TreePolicy):
            got = "no drafter" if drafter is None else \
                "no policy" if policy is None else f"a {type(policy).__name__}"
            raise ValueError("method 'tree' needs a drafter and a tree policy (e.g. "
                             f"ConfidenceTree), got {got}")
        return policy
    if config.method not in DRAFTLESS and drafter is None:
        raise ValueError(f"method '{config.method}' needs a drafter")
    return policy or FixedDepth(max(tree.max_depth, 1))


def _round_gate(config: DecodeConfig, policy: StoppingPolicy | TreePolicy) -> RoundGate | None:
    """The `tree` policy's round gate (`round_gate.py`), if it has one."""
    return getattr(policy, "round_gate", None) if config.method == "tree" else None


def prefill(
    target: KVModel,
    drafter: Drafter | None,
    prompt: torch.Tensor,  # [L] long
    sampling: Sampling,
) -> torch.Tensor:
    """Both caches take the prompt; returns r [V], the target's next-token distribution."""
    target.reset()
    layers = () if drafter is None else drafter.target_layers
    logits, hidden = target.extend_with_hidden(prompt, torch.arange(prompt.shape[0]), None,
                                               last_only=True, layers=layers)
    r = warp(logits, sampling)[0]
    if drafter is not None:
        drafter.reset(prompt, hidden if layers else None)
    return r


def draw_roots(
    r: torch.Tensor,  # [V]
    width: int,
    config: DecodeConfig,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """[width] root tokens on r's device: one draw from r (exact), or the top-W / W draws
    without replacement (lossy ti-mcsd)."""
    if config.lossy:
        return draft_children(r[None].float(), width, config.sampling,
                              without_replacement=True, generator=generator)[0]
    if config.sampling.greedy:
        return r.argmax(dim=0, keepdim=True)
    return sample(r.float(), generator)


def propose(
    drafter: Drafter | None,
    tree: Tree,
    roots: torch.Tensor,  # [roots] long
    r: torch.Tensor,  # [V] the distribution the roots were drawn from
    root_position: int,
    levels: int,  # the deepest level the budget allows
    policy: StoppingPolicy,
    context: RoundContext | None,  # None: no features (no drafter, or nobody reads them)
    config: DecodeConfig,
    generator: torch.Generator | None,
) -> Proposal:
    """Draft the tree below `roots` level by level while `policy` says go on (nothing for `ar`);
    `tree` on r's device.  Features are computed only with a `context`; a policy that reads none
    is not called: it drafts `max_levels`."""
    tokens, q_rows, feature_rows, decision = roots, [], [], 0.0
    confidence = torch.ones(tree.roots, device=r.device)
    if policy.max_levels is not None:
        levels = min(levels, policy.max_levels)
    for depth in range(levels if drafter is not None else 0):
        logits = drafter.step(tree, depth, tokens[tree.level(depth)], root_position)
        q = warp(logits, config.sampling)  # [n_depth, V]
        kids = draft_children(q, tree.branching[depth], config.sampling,
                              config.without_replacement, generator)
        tokens = torch.cat([tokens, kids.flatten()])
        q_rows.append(q)
        if context is None:
            continue
        level = tree.level(depth + 1)
        roots_of_kids = tree.root[level]  # also their rank among the roots
        features = draft_features(q, kids, depth + 1, roots_of_kids, r[roots][roots_of_kids],
                                  confidence, context)
        confidence = features[:, PATH_CONFIDENCE]
        feature_rows.append(features)
        if policy.reads_features:
            start = time.perf_counter()
            go_on = bool(policy(features, tree.parent_row[level]).any())
            decision += time.perf_counter() - start
            if not go_on:
                break
    depth = len(q_rows)
    q_all = torch.cat(q_rows) if q_rows else r.new_zeros(0, r.shape[0])
    fed = torch.arange(tokens.shape[0])
    fed[tree.size(depth - 1):] = -1  # the levels above the last were fed (size(-1) = 0)
    return Proposal(tokens, depth, root_position, q_all, tuple(feature_rows), fed, depth,
                    tokens.shape[0] - tree.roots, decision)


def root_alone(
    roots: torch.Tensor,  # [roots] long
    root_position: int,
    r: torch.Tensor,  # [V] the distribution the roots were drawn from
) -> Proposal:
    """The roots with nothing drafted below them (`ar`'s round, a round gated off)."""
    return Proposal(roots, 0, root_position, r.new_zeros(0, r.shape[0]), (),
                    torch.full((roots.shape[0],), -1), 0, 0, 0.0)


def score(target: KVModel, tree: Tree, proposal: Proposal, sampling: Sampling,
          costs: CostCurve | None, layers: tuple[int, ...]) -> Scores:
    """One target pass over the proposal under its sliced tree mask (`tree` on the target's
    device), padded to the width `costs.padded` names (padding repeats the first root; a lone
    token needs no mask); with the hidden states of `layers` when there are any."""
    n = tree.size(proposal.depth)
    width = costs.padded(n)[0] if costs else n
    tokens, positions = proposal.tokens, proposal.root_position + tree.depth[:n]
    ids = torch.cat([tokens, tokens[:1].expand(width - n)])
    positions = torch.cat([positions, positions[:1].expand(width - n)])
    mask = tree.padded_bias(proposal.depth, width, target.dtype) if width > 1 else None
    logits, hidden = target.extend_with_hidden(ids, positions, mask, layers=layers)
    return Scores(warp(logits[:n], sampling), hidden[:n] if layers else None)


def verify(tree: Tree, proposal: Proposal, scores: Scores, config: DecodeConfig,
           eos_id: int | None, generator: torch.Generator | None) -> Verdict:
    """The method's rule: exact tree verification, or the lossy DynaSD selection."""
    args = (tree, proposal.depth, proposal.tokens, scores.p, proposal.q, config.sampling)
    if config.lossy:
        return dynasd_select(*args, eos_id, generator)
    return verify_tree(*args, config.without_replacement, eos_id, generator)


def commit(target: KVModel, drafter: Drafter | None, proposal: Proposal, scores: Scores,
           verdict: Verdict) -> None:
    """Keep the accepted path in both caches, moved by device copies of its nodes."""
    target.retain(proposal.root_position, verdict.path_index)
    if drafter is not None:
        hidden = scores.hidden
        drafter.commit(proposal.tokens[verdict.path_index], _fed_path(proposal, verdict),
                       None if hidden is None else hidden[verdict.path_index])


def _fed_path(proposal: Proposal, verdict: Verdict) -> torch.Tensor:
    """[j] the fed tree's indices of the path's fed nodes (they lead it): the verdict's device
    copy of the path when they are the verified tree's own (a static tree is its own fed tree),
    else the host's."""
    fed = proposal.fed[verdict.path]
    fed = fed[fed >= 0]
    own = fed.tolist() == verdict.path[: fed.shape[0]]
    return verdict.path_index[: fed.shape[0]] if own else fed


def _round_record(index: int, tree: Tree, proposal: Proposal, scores: Scores,
                  verdict: Verdict, config: DecodeConfig) -> RoundRecord:
    """What the feature hook sees of round `index`: every drafted node of the verified tree."""
    drafted = torch.arange(tree.roots, tree.size(proposal.depth))
    accept = acceptance(tree, proposal.depth, proposal.tokens, scores.p, proposal.q,
                        config.sampling, config.without_replacement)
    parent = tree.parent[drafted]
    kids = proposal.tokens[drafted.to(proposal.tokens.device)]
    p, q = scores.p, proposal.q
    return RoundRecord(
        round=index,
        tokens=kids.cpu(),
        depth=tree.depth[drafted],
        parent=parent,
        node=drafted,
        branch=tree.branch[drafted],
        features=torch.cat(proposal.features).cpu(),  # joined for logging only
        labels=verdict.labels.cpu()[drafted],
        p_target=p[parent.to(p.device), kids].float().cpu(),
        q_draft=q[parent.to(q.device), kids].float().cpu(),
        accept_prob=accept.float().cpu()[drafted],
    )
