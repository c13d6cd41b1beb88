"""Verification rules: which drafted tokens the target accepts (VERIFICATION.md §1-3).

Notation as in the papers: `p` is the target's post-warping distribution at a node, `q` the
draft's distribution the node's children were drawn from, `res(p, q) = norm(max(p - q, 0))`.
The exact rules leave the output distributed exactly as target-only decoding; the DynaSD
selection (`dynasd_select`) reproduces the published target-initialized rule and is lossy.
Each rule takes a proposal's tokens and q and the target's p and returns a `Verdict`
(`contracts.py`).
"""

from __future__ import annotations

import torch

from .contracts import Verdict
from .sampling import Sampling, uniform
from .tree import Tree

RESIDUAL_FLOOR = 1e-12


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """res(p, q) = norm(max(p - q, 0)); falls back to p when the mass is below 1e-12.  [V] -> [V]."""
    r = (p - q).clamp_min(0.0)
    mass = r.sum()
    return p if mass < RESIDUAL_FLOOR else r / mass


def mcss(
    p: torch.Tensor,  # [V] float64 target distribution
    q: torch.Tensor,  # [V] float64 draft distribution the candidates came from
    candidates: list[int],  # in sampling order
    without_replacement: bool,
    generator: torch.Generator | None,
) -> tuple[int, torch.Tensor]:
    """Multi-candidate speculative sampling (Yang et al. 2024, arXiv 2401.06706, Alg. 1).

    Returns (index of the accepted candidate, p) or (-1, the residual to sample the correction
    from).  With `without_replacement`, a candidate whose q̄ is already 0 (a repeat, or padding
    when q's support is smaller than k) is skipped: it could not have been drawn.
    """
    q_bar = q.clone()
    for i, x in enumerate(candidates):
        if q_bar[x] <= 0:
            continue
        if uniform(generator) < float(p[x] / q_bar[x]):
            return i, p
        p = residual(p, q_bar)  # subtract q̄ before removing x
        if without_replacement:
            q_bar[x] = 0.0
            mass = q_bar.sum()
            if mass <= 0:
                break
            q_bar = q_bar / mass
    return -1, p


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
) -> Verdict:
    """Exact tree verification from the single committed root (node 0).

    Greedy: follow the child equal to argmax p (torch.argmax: first index on ties).
    Sampling: `mcss` at every node along the path.
    """
    assert tree.roots == 1, "exact verification needs a single committed root"
    n = tree.size(depth)
    assert tokens.shape == (n,) and p.shape[0] == n, (tokens.shape, p.shape, n)
    ids = tokens.tolist()
    node, path, next_dist = 0, [0], None
    while True:
        kids = [c for c in tree.children(node) if c < n]
        if not kids:
            next_dist = p[node]
            break
        if sampling.greedy:
            target_id = int(torch.argmax(p[node]))
            chosen = next((i for i, c in enumerate(kids) if ids[c] == target_id), -1)
            dist = p[node]
        else:
            cands = [ids[c] for c in kids]
            chosen, dist = mcss(p[node].double(), q[node].double(), cands, without_replacement,
                                generator)
        if chosen < 0:
            next_dist = dist
            break
        node = kids[chosen]
        path.append(node)
        if ids[node] == eos_id:
            break
    return Verdict(path, next_dist, _labels_from_path(tree, n, path, next_dist is None))


def _labels_from_path(tree: Tree, n: int, path: list[int], ended_on_eos: bool) -> torch.Tensor:
    """A node was tested iff its parent is on the accepted path (and is not an accepted EOS);
    it was accepted iff it is on the path."""
    on_path = torch.zeros(n, dtype=torch.bool)
    on_path[path] = True
    if ended_on_eos:
        on_path_tested = on_path.clone()
        on_path_tested[path[-1]] = False
    else:
        on_path_tested = on_path
    parent = tree.parent[:n]
    reached = (parent >= 0) & on_path_tested[parent.clamp_min(0)]
    labels = torch.full((n,), -1, dtype=torch.int8)
    labels[reached] = on_path[reached].to(torch.int8)
    return labels


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
    ids = tokens.tolist()
    labels = torch.full((n,), -1, dtype=torch.int8)
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
                ok = uniform(generator) < float(p[node, x].double() / q[node, x].double())
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
    return Verdict(path, next_dist, labels)
