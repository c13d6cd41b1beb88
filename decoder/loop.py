"""The decode loop for `ar`, `sd`, `mcsd`, `ti-mcsd`, `tree` and `lookup`: `generate` and one
function per step.

State between rounds is the target's KV cache (every committed token) and `r`, the distribution
the next token is drawn from.  A round (1) draws the root(s) from r, (2) proposes below them as
the method does (`methods.py`, picked once from the method's name: the static tree drafted level
by level until the stopping policy or the depth cap says stop, a dynamic tree, the chain an
n-gram of the text looks up; nothing for `ar`; for a `tree` round its policy's `round_gate`
keeps from drafting, nothing or with a lookup branch the chain alone), (3) `score`s the tree
in one target pass under its tree mask, (4) `verify`s, (5) `commit`s the accepted path to both
caches.  The steps talk through the contracts of `contracts.py` (Proposal -> Scores ->
Verdict); the policy's decision time comes beside the Proposal, not in it.

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

import numpy as np
import torch

from specstop.features import RoundContext, root_statistics

from .contracts import Proposal, Scores, Verdict
from .costs import CostCurve
from .drafter import Drafter, draft_children
from .kv import KVModel
from .lookup import Lookup, LookupMatch
from .methods import (DecodeConfig, Round, chain_tokens, round_method, with_confidence_tree,
                      with_static_fallback)
from .policy import StoppingPolicy, TreePolicy
from .sampling import Sampling, sample, warp
from .tree import Tree
from .verify import Support, acceptance, chain_acceptance, dynasd_select, verify_tree

ACCEPTED_EMA_DECAY = 0.5  # weight of the previous average in the accepted-length EMA


@lru_cache(maxsize=64)
def tree_for(config: DecodeConfig) -> Tree:
    """The largest tree of a method; each round drafts a leading slice of it."""
    return Tree(*round_method(config.method).tree_shape(config))


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
    prefill_seconds: float = 0.0  # of `seconds`: the prompt into both caches, before any round
    decision_seconds: float = 0.0  # wall time of the policy's decisions
    gated: int = 0  # rounds the round gate kept from drafting (the root alone, or a chain)
    accepted_per_round: list[int] = field(default_factory=list)
    accepted_ema: float = 0.0  # EMA of accepted drafted tokens per round (0 before the first)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def round_seconds(self) -> float:
        """`seconds` less the prefill: the rounds', which the replay prices."""
        return self.seconds - self.prefill_seconds

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
                  decision_seconds: float = 0.0, gated: bool = False) -> None:
        """Count one round: its proposal's draft steps (one level each) and drafted tokens,
        `verified` proposed tokens in its target pass, `accepted` of them, `decision_seconds` of
        the policy's decisions; a round `gated` off (nothing drafted, perhaps a lookup chain)
        is a target call that leaves the acceptance history as it was."""
        self.target_calls += 1
        self.verified_tokens += verified
        if gated:
            self.gated += 1
            return
        self.draft_steps += proposal.steps
        self.drafted_levels += proposal.steps
        self.drafted_tokens += proposal.drafted
        self.decision_seconds += decision_seconds
        self.accepted += accepted
        self.accepted_per_round.append(accepted)
        self.accepted_ema = ACCEPTED_EMA_DECAY * self.accepted_ema \
            + (1 - ACCEPTED_EMA_DECAY) * accepted

    def add(self, other: "DecodeStats") -> None:
        """Accumulate another generation's counts (per-round history is not kept)."""
        for name in ("new_tokens", "target_calls", "draft_steps", "drafted_levels",
                     "drafted_tokens", "verified_tokens", "accepted", "seconds",
                     "prefill_seconds", "decision_seconds", "gated"):
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
    chain: LookupMatch | None = None  # with a lookup branch, the round's chain
    chain_accept: tuple[np.ndarray, ...] = ()  # sampling: per chain token the tree holds,
    # [K + 1] P(accepted at its parent | the parent was and the first k of its K drafted
    # children were rejected before it) (`verify.chain_acceptance`)


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
    TreePolicy for `tree` (one naming a static shape for this sampling decodes that shape:
    `with_static_fallback`; one naming a confidence tree, greedy with the lookup branch, that
    tree: `with_confidence_tree`).  `costs` (the target's measured cost curve) lets each target
    pass be padded to a cheaper width (`CostCurve.padded`); `hook` receives a RoundRecord per
    round (nothing is recorded without it).
    """
    config, policy = with_static_fallback(config, policy)
    policy = with_confidence_tree(config, policy)
    method = round_method(config.method)
    tree = tree_for(config)  # `tree` rounds build their own
    policy = method.checked_policy(config, tree, drafter, policy)
    gate = method.round_gate(policy)
    if gate is not None and gate.never:  # `fallback: ar`: no round drafts, no draft runs
        drafter = None
    depth_cap = method.depth_cap(config, tree, policy)
    with_features = drafter is not None and (method.reads_features or hook is not None
                                             or policy.reads_features)
    stats, out, start = DecodeStats(), [], time.perf_counter()
    proposes_lookup = method.looks_up or config.lookup_branch
    if method.looks_up and hook is not None:
        raise ValueError("a lookup proposal has no draft features for the hook")
    lookup = Lookup(prompt.tolist(), config.lookup_ngram) \
        if proposes_lookup or with_features else None  # the features read its chain too
    root_emitted = 0 if config.lossy else 1  # emitted whatever is accepted (exact), or not
    support = None if drafter is None or drafter.vocab_ids is None or config.sampling.greedy \
        else Support.of(drafter.vocab_ids, target.vocab_size)  # where q has mass
    # 0. Prefill: both caches take the prompt; r is the target's next-token distribution.
    target.reserve(prompt.shape[0] + config.max_new_tokens + tree.size(tree.max_depth))
    r = prefill(target, drafter, prompt, config.sampling)
    stats.target_calls += 1
    if r.device.type == "cuda":  # its kernels timed as the prefill's, not the first round's
        torch.cuda.synchronize(r.device)
    stats.prefill_seconds = time.perf_counter() - start
    while True:
        # 1. Roots, on the device: exact methods emit one draw from r (with the round's path, at
        # step 5); lossy ti-mcsd's top-W roots compete.
        roots = draw_roots(r, tree.roots, config, generator)
        emitted = len(out) + root_emitted  # tokens out once the root is
        if emitted >= config.max_new_tokens:  # the root alone fills the budget
            out.extend(roots[:root_emitted].tolist())
            break
        root_committed = lookup is not None and roots.shape[0] == 1
        if root_committed:  # the text a lookup reads holds the root
            lookup.extend(roots.tolist())
        # 2. Propose below the roots as deep as the depth cap and the budget (one token per
        # level) allow; a round the gate keeps from drafting drafts nothing (`propose_gated`).
        levels = min(depth_cap, config.max_new_tokens - emitted - 1 + root_emitted)
        context = round_context(stats, emitted, r, lookup if root_committed else None,
                                levels) if with_features else None
        gated = gate is not None and not gate.drafts(context, r[roots])
        round_ = Round(roots, r, target.length, levels, context)
        chain = lookup.match(chain_tokens(round_, config)) \
            if hook is not None and config.lookup_branch and root_committed else None
        round_tree, proposal, decision_seconds = \
            method.propose_gated(round_, policy, tree, lookup, config) if gated else \
            method.propose(round_, drafter, policy, tree, lookup, config, generator)
        on_device = round_tree.on(r.device)
        # 3. Score: one target pass over the proposal.
        scores = score(target, on_device, proposal, config.sampling, costs,
                       () if drafter is None else drafter.target_layers)
        # 4. Verify.
        verdict = verify(on_device, proposal, scores, config, eos_id, generator, support)
        if root_emitted and verdict.path_tokens[0] == eos_id:  # the root ended the sequence
            out.append(eos_id)
            break
        # 5. Commit the accepted path to both caches and emit it, root first.
        commit(target, drafter, proposal, scores, verdict)
        out.extend(verdict.path_tokens)
        if lookup is not None:
            lookup.extend(verdict.path_tokens[1:] if root_committed else verdict.path_tokens)
        stats.add_round(proposal, round_tree.size(proposal.depth) - round_tree.roots,
                        len(verdict.path) - 1, decision_seconds, gated)
        if hook is not None and proposal.depth > 0:
            hook(_round_record(len(stats.accepted_per_round) - 1, round_tree, proposal, scores,
                               verdict, config, chain))
        if verdict.next_dist is None or len(out) >= config.max_new_tokens:
            break
        r = verdict.next_dist
    del out[config.max_new_tokens:]
    stats.new_tokens = len(out)
    stats.seconds = time.perf_counter() - start
    return Generation(out, stats)


def round_context(stats: DecodeStats, emitted: int, r: torch.Tensor, lookup: Lookup | None,
                  levels: int) -> RoundContext:
    """What every drafted token of the round shares: the history, the target's root
    distribution r and the lookup chain below the root (committed to `lookup`; None: no
    chain), at most `levels` long."""
    match = lookup.match(levels) if lookup is not None else None
    chain = {} if match is None else {"chain": tuple(match.tokens), "lookup_ngram": match.ngram,
                                      "lookup_recent": match.recent}
    return RoundContext(emitted, stats.last_accepted, stats.acceptance_rate, stats.accepted_ema,
                        root_statistics(r), **chain)


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
    return sample(r, generator)


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
           eos_id: int | None, generator: torch.Generator | None,
           support: Support | None = None) -> Verdict:
    """The method's rule: exact tree verification (sampled, over the draft's `support`), or
    the lossy DynaSD selection."""
    args = (tree, proposal.depth, proposal.tokens, scores.p, proposal.q, config.sampling)
    if config.lossy:
        return dynasd_select(*args, eos_id, generator)
    return verify_tree(*args, config.without_replacement, eos_id, generator, proposal.point,
                       support)


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
                  verdict: Verdict, config: DecodeConfig, chain: LookupMatch | None = None
                  ) -> RoundRecord:
    """What the feature hook sees of round `index`: every drafted node of the verified tree,
    by its index and its parent's in the tree without the lookup branch (the static tree's),
    and with a branch the round's `chain`, sampled with each token's acceptances."""
    n = tree.size(proposal.depth)
    point = torch.zeros(n, dtype=torch.bool) if proposal.point is None else proposal.point.cpu()
    drafted = torch.arange(tree.roots, n)[~point[tree.roots:]]
    own = torch.cumsum(~point, 0) - 1  # each node's index without the branch
    accept = acceptance(tree, proposal.depth, proposal.tokens, scores.p, proposal.q,
                        config.sampling, config.without_replacement, proposal.point)
    parent = tree.parent[drafted]
    kids = proposal.tokens[drafted.to(proposal.tokens.device)]
    p, q = scores.p, proposal.q
    chain_accept = () if chain is None or config.sampling.greedy else tuple(chain_acceptance(
        tree, proposal.tokens, p, q, proposal.point, chain.tokens, config.without_replacement))
    return RoundRecord(
        round=index,
        tokens=kids.cpu(),
        depth=tree.depth[drafted],
        parent=own[parent],
        node=own[drafted],
        branch=tree.branch[drafted],
        features=torch.cat(proposal.features).cpu(),  # joined for logging only
        labels=verdict.labels.cpu()[drafted],
        p_target=p[parent.to(p.device), kids].float().cpu(),
        q_draft=q[parent.to(q.device), kids].float().cpu(),
        accept_prob=accept.float().cpu()[drafted],
        chain=chain,
        chain_accept=chain_accept,
    )
