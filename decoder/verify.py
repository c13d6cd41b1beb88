"""Verification rules: which drafted tokens the target accepts (VERIFICATION.md §1-3).

Notation as in the papers: `p` is the target's post-warping distribution at a node, `q` the
draft's distribution the node's children were drawn from, `res(p, q) = norm(max(p - q, 0))`.
The exact rules leave the output distributed exactly as target-only decoding; the DynaSD
selection (`dynasd_select`) reproduces the published target-initialized rule and is lossy.
Each rule takes a proposal's tokens and q and the target's p and returns a `Verdict`
(`contracts.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .contracts import Verdict
from .sampling import Sampling, uniforms
from .tree import Tree

RESIDUAL_FLOOR = 1e-12


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """res(p, q) = norm(max(p - q, 0)); falls back to p when the mass is below 1e-12.  [V] -> [V],
    without a sync."""
    r = (p - q).clamp_min(0.0)
    mass = r.sum()
    return torch.where(mass < RESIDUAL_FLOOR, p, r / mass)


def mcss(
    p: torch.Tensor,  # [V] float64 target distribution
    q: torch.Tensor,  # [V] float64 draft distribution the candidates came from
    candidates: torch.Tensor | Sequence[int],  # [k] in sampling order
    without_replacement: bool,
    u: torch.Tensor,  # [k] float64 uniforms, one per candidate
    valid: torch.Tensor | None = None,  # [k] bool, False for a padding slot (never tested)
    point: torch.Tensor | None = None,  # [k] bool, True for a candidate from a point mass
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-candidate speculative sampling (Yang et al. 2024, arXiv 2401.06706, Alg. 1), on p's
    device without a sync.

    Candidate i is tested with u[i] < p(x)/q̄(x), in order, until one accepts.  With
    `without_replacement`, a candidate whose q̄ is already 0 (a repeat, or padding when q's
    support is smaller than k) is skipped: it could not have been drawn.  A `point` candidate
    (a lookup chain's: a function of what came before it, after the drawn ones) is proposed by
    a point mass: tested with u < p(x), the residual p with x removed (SpecInfer's step with its
    own q, VERIFICATION.md §2).  Returns (the index of
    the accepted candidate, -1 for none: a 0-d long tensor; p, or the residual to sample the
    correction from when none was accepted; [k] the thresholds of the tests made, nan elsewhere).
    """
    candidates = torch.as_tensor(candidates, device=p.device)
    valid = torch.ones_like(candidates, dtype=torch.bool) if valid is None else valid
    thresholds, rest = _mcss_tests(p, q, candidates, valid, without_replacement, point)
    made = ~thresholds.isnan()
    accepted = made & (u < thresholds)
    first = accepted.long().argmax()  # 0 when none accepted
    index = torch.where(accepted.any(), first, -1)
    made &= accepted.long().cumsum(0) - accepted.long() == 0  # none accepted before
    return index, torch.where(index < 0, rest, p), torch.where(made, thresholds, math.nan)


def _mcss_tests(p: torch.Tensor, q: torch.Tensor, candidates: torch.Tensor, valid: torch.Tensor,
                without_replacement: bool, point: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every test `mcss` may make: [k] thresholds p(x)/q̄(x) (nan for a skipped candidate; q̄
    the point mass at x for a `point` candidate), and the residual [V] left after the last."""
    q_bar, thresholds = q, []
    points = [None] * len(candidates) if point is None else point.split(1)
    for x, ok, at_x in zip(candidates.split(1), valid.split(1), points):
        q_c = q_bar if at_x is None else \
            torch.where(at_x, torch.zeros_like(q_bar).index_fill(0, x, 1.0), q_bar)
        q_x = q_c[x]
        drawable = ok & (q_x > 0)
        thresholds.append(torch.where(drawable, p[x] / q_x, math.nan))
        p = torch.where(drawable, residual(p, q_c), p)  # subtract q̄ before removing x
        if without_replacement:
            removed = q_bar.index_fill(0, x, 0.0)
            mass = removed.sum()  # 0: every later candidate is skipped
            drawn = drawable if at_x is None else drawable & ~at_x
            q_bar = torch.where(drawn, torch.where(mass > 0, removed / mass, removed), q_bar)
    return torch.cat(thresholds), p


def acceptance(
    tree: Tree,
    depth: int,
    tokens: torch.Tensor,  # [n] token ids of the tree cut at `depth`
    p: torch.Tensor,  # [n, V] target distributions after each node
    q: torch.Tensor,  # [size(depth-1), V] draft distributions each node's children came from
    sampling: Sampling,
    without_replacement: bool,
    point: torch.Tensor | None = None,  # [n] bool: nodes from a point mass (a lookup chain's)
) -> torch.Tensor:
    """[n] float64 on the tokens' device: each node's exact probability of being accepted at its
    parent given that the parent was and its earlier siblings were not (roots: nan).  Greedy: 1
    iff the token is the arg-max of p at the parent.  Sampling: min(1, t), t the threshold
    `mcss` tests it with (the residual p over q-bar left by the earlier siblings; 0 for a
    candidate that could not have been drawn).  A node's value does not depend on its later
    siblings, so a policy that verifies a prefix of each node's children accepts node i with
    P(parent) * prod over its earlier siblings (1 - a) * a_i."""
    n = tokens.shape[0]
    parent = tree.parent[:n].to(tokens.device)
    out = torch.full((n,), math.nan, dtype=torch.float64, device=tokens.device)
    drafted = parent >= 0
    if sampling.greedy:
        up = parent.clamp_min(0)
        return torch.where(drafted, (tokens == p.argmax(dim=1)[up]).double(), out)
    for node in torch.unique(parent[drafted]).tolist():
        kids = (parent == node).nonzero()[:, 0]
        thresholds, _ = _mcss_tests(p[node].double(), q[node].double(), tokens[kids],
                                    torch.ones_like(kids, dtype=torch.bool), without_replacement,
                                    None if point is None else point[kids])
        out[kids] = thresholds.nan_to_num(0.0).clamp_max(1.0)
    return out


def chain_acceptance(
    tree: Tree,
    tokens: torch.Tensor,  # [n] token ids of the verified tree
    p: torch.Tensor,  # [n, V] target distributions after each node (sampling)
    q: torch.Tensor,  # [size(depth-1), V] draft distributions each node's children came from
    point: torch.Tensor | None,  # [n] bool: the lookup chain's own nodes
    chain: list[int],  # the round's lookup chain below the root
    without_replacement: bool,
) -> list[np.ndarray]:
    """For each token x of a lookup `chain` the tree holds (its first tokens as the drafted
    nodes they retrace, the rest as point-mass nodes below the last of them: `lookup.retrace`,
    `lookup.with_chain`), [K + 1] float64: its chance of acceptance at its parent A given that
    A was accepted and the first k of A's K drafted children were tested and rejected before it,
    k = 0..K (`mcss`: the residual they leave, then x from a point mass).  A tree that verifies
    k of A's children and not x's own drafted node (if it has one) proposes x there, so these
    score a lookup branch beside any sub-tree exactly (`replay.tree_replay`)."""
    n = tokens.shape[0]
    parent, host_tokens = tree.parent[:n].tolist(), tokens.tolist()
    own = [False] * n if point is None else point.tolist()
    out, node = [], 0
    for x in chain:
        kids = [i for i in range(n) if parent[i] == node]  # in rank order, the chain's last
        follow = [i for i in kids if host_tokens[i] == x]
        if not follow:
            break
        drafted = torch.tensor([host_tokens[i] for i in kids if not own[i]] + [x],
                               device=tokens.device)
        k = len(drafted) - 1
        tests = [_mcss_tests(p[node].double(), q[node].double(), drafted[[*range(j), k]],
                             torch.ones(j + 1, dtype=torch.bool, device=tokens.device),
                             without_replacement,
                             torch.arange(j + 1, device=tokens.device) == j)[0][-1]
                 for j in range(k + 1)]
        out.append(torch.stack(tests).nan_to_num(0.0).clamp_max(1.0).cpu().numpy())
        node = follow[-1]  # the drafted node it retraces (the last of equal ones), or its own
    return out


@dataclass(frozen=True)
class Support:
    """The tokens a draft's q can give mass to (a pruned head's vocabulary), over which the
    sampled walk tests: every other token has q 0 at every node, so it enters `mcss` only
    through its share of p, and the walk lumps those shares into one slot (`lumped`)."""

    ids: torch.Tensor  # [s] token ids
    slot: torch.Tensor  # [V] each token's index in `ids`, s for the lumped rest

    @classmethod
    def of(cls, ids: torch.Tensor, vocab: int) -> "Support":
        slot = torch.full((vocab,), ids.shape[0], dtype=torch.long, device=ids.device)
        return cls(ids, slot.index_copy_(0, ids, torch.arange(ids.shape[0], device=ids.device)))

    def lumped(self, dist: torch.Tensor, rest: bool = True) -> torch.Tensor:
        """[V] a distribution -> [s + 1] float64: its mass on `ids`, then the rest's (>= 0;
        0 without `rest`, for q, which has none there)."""
        inside = dist.index_select(0, self.ids).double()
        mass = (dist.sum(dtype=torch.float64) - inside.sum()).clamp_min(0.0) if rest \
            else inside.new_zeros(())
        return torch.cat([inside, mass[None]])

    def spread(self, lumped: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """[s + 1] a residual of the lumped p [V] -> [V] float64: the rest's slot shared out
        in proportion to p (the walk's tests scaled it as a whole)."""
        p = p.double()
        rest = p.sum() - p.index_select(0, self.ids).sum()
        scale = torch.where(rest > 0, lumped[-1] / rest.clamp_min(RESIDUAL_FLOOR), 0.0)
        return (p * scale).index_copy_(0, self.ids, lumped[:-1])


def verify_tree(
    tree: Tree,
    depth: int,  # levels drafted below the root
    tokens: torch.Tensor,  # [n] token ids of the tree cut at `depth`
    p: torch.Tensor,  # [n, V] target distributions after each node
    q: torch.Tensor,  # [size(depth-1), V] draft distributions each node's children came from
    sampling: Sampling,
    without_replacement: bool,
    eos_id: int | None,
    generator: torch.Generator | None,
    point: torch.Tensor | None = None,  # [n] bool: nodes drawn from a point mass (a lookup
    # chain's), each after its drawn siblings
    support: Support | None = None,  # where q has mass (None: anywhere)
) -> Verdict:
    """Exact tree verification from the single committed root (node 0); `tree` on the tokens'
    device.

    Greedy: follow the child equal to argmax p (torch.argmax: first index on ties), on the device
    at once (`_greedy_walk`).  Sampling: `mcss` at every node along the path (`sampled_walk`),
    with one uniform per node drawn in one call.
    """
    assert tree.roots == 1, "exact verification needs a single committed root"
    n = tree.size(depth)
    assert tokens.shape == (n,) and p.shape[0] == n, (tokens.shape, p.shape, n)
    if sampling.greedy:
        return _greedy_walk(tree, depth, tokens, p, eos_id)
    u = uniforms(n, tokens.device, generator)
    return sampled_walk(tree, depth, tokens, p, q, without_replacement, eos_id, u, point,
                        support)[0]


def sampled_walk(tree: Tree, depth: int, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                 without_replacement: bool, eos_id: int | None, u: torch.Tensor,
                 point: torch.Tensor | None = None, support: Support | None = None
                 ) -> tuple[Verdict, torch.Tensor]:
    """The sampled path, one level at a time on the device and one transfer: at the path's node
    `mcss` tests its children (`point` [n]: those from a point mass), node i with the uniform
    u[i] ([n] float64); the walk stops at a
    rejection, an accepted EOS or a leaf (on a GPU it idles through the levels left rather than
    ask the host).  Also returns [n] the thresholds of the tests made, nan for the nodes never
    tested.

    With a `support` and no point-mass node, the tests run over the support and one slot for
    the rest of the vocabulary (`Support.lumped`): outside the support q is 0 at every node, so
    each residual there is p scaled by one factor, and a slot holding the rest's mass gives the
    same tests, residual masses and thresholds as the whole vocabulary (a candidate outside the
    support sits in the slot, where q is 0: skipped, as it is over V).  The residual the walk
    ends with is spread back over V once (`Support.spread`)."""
    n, device = tokens.shape[0], tokens.device
    lumped = support is not None and point is None
    slots = support.slot[tokens] if lumped else tokens  # what mcss tests each node as
    parent, widest = tree.parent[:n], max(tree.branching[:depth], default=0)
    node = torch.zeros(1, dtype=torch.long, device=device)
    walking = torch.ones((), dtype=torch.bool, device=device)
    width = support.ids.shape[0] + 1 if lumped else p.shape[1]
    nodes = [node]
    next_dist = torch.zeros(width, dtype=torch.float64, device=device)
    made = torch.full((n + widest,), math.nan, dtype=torch.float64, device=device)
    for d in range(1, depth + 1):
        rank = torch.arange(tree.branching[d - 1], device=device)
        first = torch.searchsorted(parent, node)
        kids = first + rank
        valid = walking & (rank < torch.searchsorted(parent, node, right=True) - first)
        at = kids.clamp_max(n - 1)
        p_node, q_node = p.index_select(0, node)[0], q.index_select(0, node)[0]
        if lumped:
            p_node, q_node = support.lumped(p_node), support.lumped(q_node, rest=False)
        index, dist, thresholds = mcss(p_node.double(), q_node.double(), slots[at],
                                       without_replacement, u[at], valid,
                                       None if point is None else point[at])
        made[kids] = torch.where(valid, thresholds, made[kids])
        accepted = index >= 0
        next_dist = torch.where(walking & ~accepted, dist, next_dist)
        node = torch.where(accepted, at[index.clamp_min(0)], node)
        nodes.append(torch.where(accepted, node, -1))
        if eos_id is not None:
            accepted &= tokens[node][0] != eos_id
        walking = accepted
        if reads_are_free(device) and not walking:
            break
    at_node = p.index_select(0, node)[0]
    if lumped:
        next_dist = support.spread(next_dist, at_node)
    next_dist = torch.where(walking, at_node.double(), next_dist)
    path_index = torch.cat(nodes)
    host_nodes, host_tokens = torch.stack([path_index, tokens[path_index.clamp_min(0)]]).tolist()
    k = host_nodes.index(-1) if -1 in host_nodes else len(host_nodes)
    path, path_tokens = host_nodes[:k], host_tokens[:k]
    ended = k > 1 and path_tokens[-1] == eos_id
    on_path = torch.zeros(n, dtype=torch.bool, device=device).index_fill_(0, path_index[:k], True)
    tested = on_path.clone()  # nothing below an accepted EOS was tested
    tested[path[-1]] = not ended
    return Verdict(path, path_tokens, path_index[:k], None if ended else next_dist,
                   _labels(parent, on_path, tested)), made[:n]


def reads_are_free(device: torch.device) -> bool:
    """Whether the host reads a value on `device` without waiting for it (the CPU: it is there),
    so a walk may stop as soon as it is over."""
    return device.type == "cpu"


def _greedy_walk(tree: Tree, depth: int, tokens: torch.Tensor, p: torch.Tensor,
                 eos_id: int | None) -> Verdict:
    """The greedy path in one pass over the tree and one transfer: a node is accepted when its
    token is the arg-max of p at its parent; it is on the path when it and every ancestor are,
    and none above it is an accepted EOS.  Greedy siblings are distinct (the draft's top-k), so
    the path is a chain: its node at each level, brought to the host with its tokens."""
    n = tokens.shape[0]
    parent, level = tree.parent[:n], tree.depth[:n]
    is_root, up = parent < 0, parent.clamp_min(0)
    accepted = is_root | (tokens == p.argmax(dim=1)[up])
    ends = ~is_root & (tokens == eos_id) if eos_id is not None else torch.zeros_like(is_root)
    goes_on = accepted & ~ends  # a path may continue below it
    open_below = (goes_on[None, :] | ~tree.mask[:n, :n]).all(dim=1)  # it and every ancestor
    on_path = accepted & (is_root | open_below[up])
    at_level = on_path & (level == torch.arange(depth + 1, device=tokens.device)[:, None])
    nodes = torch.where(at_level.any(dim=1), at_level.long().argmax(dim=1), -1)  # [depth + 1]
    host_nodes, host_tokens = torch.stack([nodes, tokens[nodes.clamp_min(0)]]).tolist()
    k = host_nodes.index(-1) if -1 in host_nodes else depth + 1
    path, path_tokens = host_nodes[:k], host_tokens[:k]
    ended = k > 1 and path_tokens[-1] == eos_id
    return Verdict(path, path_tokens, nodes[:k], None if ended else p[path[-1]],
                   _labels(parent, on_path, on_path & ~ends))


def _labels(parent: torch.Tensor, on_path: torch.Tensor, tested: torch.Tensor) -> torch.Tensor:
    """[n] int8: a node was tested iff its parent was `tested` (on the path, and not an accepted
    EOS); it was accepted iff it is on the path."""
    reached = (parent >= 0) & tested[parent.clamp_min(0)]
    return torch.where(reached, on_path.to(torch.int8), -1)


def dynasd_select(
    tree: Tree,
    depth: int,
    tokens: torch.Tensor,  # [n]
    p: torch.Tensor,  # [n, V]
    q: torch.Tensor,  # [size(depth-1), V]
    sampling: Sampling,
    eos_id: int | None,
    generator: torch.Generator | None,
) -> Verdict:
    """The published target-initialized MCSD rule (DynaSD, arXiv 2409.10644): LOSSY.

    Roots (the target's top-W tokens) are never tested; each chain below a root is tested
    independently (greedy: token == argmax p of its parent; sampling: u < p/q), the branch with
    the longest accepted run wins (first on ties).  The code slips VERIFICATION.md §3 lists are
    fixed: the residual is taken at the rejected node, and nothing after an accepted EOS is kept.
    """
    assert all(k == 1 for k in tree.branching), "the DynaSD rule verifies one chain per root"
    n = tree.size(depth)
    ids, u = tokens.tolist(), uniforms(n, tokens.device, generator).tolist()
    labels = torch.full((n,), -1, dtype=torch.int8, device=tokens.device)
    best_len, best_root, best_rejected_at = -1, 0, None
    for b in range(tree.roots):
        length, rejected_at, node = 0, None, b
        ended = ids[b] == eos_id
        for d in range(1, depth + 1):
            if ended:
                break
            child = tree.level_start[d] + b
            x = ids[child]
            if sampling.greedy:
                ok = x == int(torch.argmax(p[node]))
            else:
                ok = u[child] < float(p[node, x].double() / q[node, x].double())
            labels[child] = int(ok)
            if not ok:
                rejected_at = node
                break
            length, node, ended = d, child, x == eos_id
        if length > best_len:
            best_len, best_root, best_rejected_at = length, b, rejected_at
    path = [best_root] + [tree.level_start[d] + best_root for d in range(1, best_len + 1)]
    last = path[-1]
    if ids[last] == eos_id:
        next_dist = None
    elif best_rejected_at is not None and not sampling.greedy:
        next_dist = residual(p[last].double(), q[last].double())
    else:
        next_dist = p[last]
    return Verdict(path, [ids[i] for i in path], torch.tensor(path, device=tokens.device),
                   next_dist, labels)
