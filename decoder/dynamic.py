"""The `tree` method's round: a dynamic tree, expanded and cut by a `TreePolicy` (EAGLE-2 style).

Three trees share the drafted tree's level-major node order:
- S, the drafted tree: the root, then each draft step's candidates (the first `children`
  of every node fed at that step in the draft's sampling order: all `branching[d]`, or the
  sampling rule's count), each with its survival s, the product of the policy's p-hat along its
  path (`tree_rule.py`);
- F, the fed tree: the root and the candidates given children; the draft's cache holds it,
  one draft step per level;
- V, the verify tree: the root and the candidates `verify_set` keeps (all of them when
  sampling); the loop scores, verifies and commits it as it does a static tree.

A round's lookup chain (`lookup.LookupBranch`) is one more source of candidates, with
survivals of its own.  Its first tokens may retrace a path the draft drafted: those nodes are
kept once, with the larger of the two survivals; the rest of the chain leaves the drafted tree
below the last of them (or the root) as a branch of its own, placed after its drafted siblings
(`lookup.with_lookup_branch`).  Greedy, `verify_set` ranks them all and keeps a closed set, so
a prefix of the chain's branch or none of it; sampled, every drafted node is verified and the
prefix of the branch that pays beside them.  A round the round gate keeps from drafting
proposes the root and the prefix of the chain that pays alone (`propose_chain`).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from specstop.features import RoundContext, draft_features, feature_index

from .contracts import Proposal
from .drafter import Drafter, draft_level
from .lookup import LookupBranch, retrace, with_lookup_branch
from .policy import TreePolicy, decoding_rule
from .sampling import Sampling
from .tree import Tree
from .tree_rule import TreeRule, children, verify_set

PATH_CONFIDENCE = feature_index("path_confidence")
LOOKUP_AGREES = feature_index("lookup_agrees")


def propose_tree(
    drafter: Drafter,
    policy: TreePolicy,
    root: torch.Tensor,  # [1] long
    r: torch.Tensor,  # [V] the distribution the root was drawn from
    root_position: int,
    levels: int,  # >= 1, the deepest level the budget allows
    context: RoundContext,
    sampling: Sampling,
    without_replacement: bool,
    generator: torch.Generator | None,
    branch: LookupBranch | None = None,  # a lookup chain below the root
) -> tuple[Tree, Proposal, float]:
    """Draft S below `root` level by level while some candidate is given `children`, then cut
    it (and `branch`) to V with `verify_set`; returns V, its Proposal and the wall time of the
    decisions."""
    rule = decoding_rule(policy, sampling.greedy)
    levels = min(levels, rule.max_depth)
    drafted, frontier, decision = DraftedTree(root), np.zeros(1, dtype=np.int64), 0.0
    counts = children(drafted.survival, 0, rule)  # [m] children of each fed node
    for depth in range(levels):
        rows = torch.from_numpy(frontier).to(r.device)  # S indices of the nodes fed now
        logits = drafter.step(drafted.fed_tree().on(r.device), depth, drafted.tokens[rows],
                              root_position)
        width = int(counts.max())
        level = draft_level(logits, drafter.vocab_ids, width, sampling, without_replacement,
                            generator)
        candidates = level.tokens  # [m, w]
        slots = np.flatnonzero(np.arange(width)[None, :] < counts[:, None])  # each one's first
        parent, rank = np.divmod(slots, width)  # [c] row of q and rank of each kept candidate
        kept = _kept(slots, candidates.numel(), r.device)
        kids, n = _rows(candidates.flatten(), kept), candidates.numel()
        start = time.perf_counter()  # a decision: the candidates' features, p-hat, the rule
        features = _rows(draft_features(level.support_q, candidates, depth + 1,
                                        candidates.new_zeros(n), r[root].expand(n),
                                        drafted.confidence[rows], drafted.on_chain[rows],
                                        context, level.columns), kept)
        p_hat = policy.probabilities(features).double().cpu().numpy()
        survival = drafted.survival[frontier][parent] * p_hat
        nodes = len(drafted.parent) + len(slots)  # the tree's nodes once these are added
        next_counts = children(survival, depth + 1, rule, nodes=nodes) if depth + 1 < levels \
            else np.zeros(len(slots), dtype=np.int64)
        decision += time.perf_counter() - start
        frontier = drafted.add(frontier[parent], rank, level.q, kids, features, survival,
                               next_counts > 0)
        counts = next_counts[next_counts > 0]
        if frontier.size == 0:
            break
    start = time.perf_counter()
    survival, parent, previous_sibling = drafted.candidates()
    retraced = [] if branch is None else [i - 1 for i in drafted.retrace(branch.tokens)]
    keep, chain, attach = verify_with_chain(survival, parent, previous_sibling, branch, rule,
                                            retraced)
    decision += time.perf_counter() - start
    tree, proposal = drafted.verify_proposal(keep, root_position)
    if not chain:
        return tree, proposal, decision
    below = 0 if attach < 0 else 1 + int(keep[:attach].sum())  # V's index of the candidate
    return (*with_lookup_branch(tree, proposal, chain, below), decision)


def propose_chain(
    policy: TreePolicy,
    root: torch.Tensor,  # [1] long
    r: torch.Tensor,  # [V] the distribution the root was drawn from
    root_position: int,
    branch: LookupBranch,
    greedy: bool,
) -> tuple[Tree, Proposal, float]:
    """A round the round gate keeps from drafting: the root and the prefix of the lookup chain
    that pays (the root alone when none does), no draft step; returns V, its Proposal and the
    wall time of the decision."""
    start = time.perf_counter()
    none = np.zeros(0, dtype=np.int64)
    _, chain, _ = verify_with_chain(np.zeros(0), none, none, branch,
                                    decoding_rule(policy, greedy), [])
    tree, proposal = Tree.from_parents(np.array([-1])), Proposal.root_alone(root, root_position, r)
    if chain:
        tree, proposal = with_lookup_branch(tree, proposal, chain)
    return tree, proposal, time.perf_counter() - start


def verify_with_chain(
    survival: np.ndarray,  # [n] the drafted candidates' (`DraftedTree.candidates`)
    parent: np.ndarray,
    previous_sibling: np.ndarray,
    branch: LookupBranch | None,  # a chain below the root
    rule: TreeRule,
    retraced: list[int],  # the candidates the chain's first tokens are, from the root down
) -> tuple[np.ndarray, list[int], int]:
    """`verify_set` over the drafted candidates and `branch`: the chain's first tokens are the
    `retraced` candidates, each kept with the larger of its two survivals; the rest of it leaves
    the drafted tree below the last of them (-1: the root) as candidates n, n + 1, ..., each
    below the one before and placed after its drafted siblings, capped at the chain tokens the
    rule prices.  A rule that does not prune (sampling) keeps every drafted candidate and the
    prefix of the rest that pays beside them (sum of survivals - rho * the verify cost it
    adds).  Returns ([n] bool drafted candidates kept, the chain's tokens kept below the
    drafted tree: a prefix of the rest, the candidate they go below)."""
    n, m = len(survival), len(retraced)
    attach = retraced[-1] if m else -1
    if branch is None:
        return verify_set(survival, parent, previous_sibling, rule), [], attach
    survival = survival.copy()
    survival[retraced] = np.maximum(survival[retraced], branch.survival[:m])
    c = min(len(branch.tokens) - m, len(rule.verify_cost) - 2 - n)
    if c <= 0:
        return verify_set(survival, parent, previous_sibling, rule), [], attach
    if not rule.prune:
        value = np.concatenate([[0.0], np.cumsum(branch.survival[m : m + c])]) \
            - rule.rho * np.array([rule.cost(1 + n + k) for k in range(c + 1)])
        return np.ones(n, dtype=bool), branch.tokens[m : m + int(np.argmax(value))], attach
    keep = verify_set(np.concatenate([survival, branch.survival[m : m + c]]),
                      np.concatenate([parent, [attach], n + np.arange(c - 1)]),
                      np.concatenate([previous_sibling, np.full(c, -1)]), rule)
    return keep[:n], branch.tokens[m : m + int(keep[n:].sum())], attach


def _kept(slots: np.ndarray, drafted: int, device: torch.device) -> torch.Tensor | None:
    """The kept candidates' slots on the device; None (no transfer) when every one is kept."""
    return None if len(slots) == drafted else torch.from_numpy(slots).to(device)


def _rows(values: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    return values if kept is None else values[kept]


class DraftedTree:
    """The drafted tree S of one round as it grows, one level per draft step (node 0 the root).

    Per node [n]: `tokens`, `confidence` (the draft's path confidence), `on_chain` (1 where
    its branch is the lookup chain's prefix: `lookup_agrees`), `parent` (-1 for the root),
    `rank` among siblings, `survival`, `fed` (index in F, -1 if not fed); F's own `fed_parent`
    [|F|]; per draft step, the fed nodes' draft distributions q [m, V] (F order)
    and the candidates' features [m * k, F].
    """

    def __init__(self, root: torch.Tensor) -> None:
        self.tokens = root
        self.confidence = torch.ones(1, device=root.device)
        self.on_chain = torch.ones(1, device=root.device)
        self.parent = np.array([-1])
        self.rank = np.zeros(1, dtype=np.int64)
        self.survival = np.ones(1)
        self.fed = np.zeros(1, dtype=np.int64)
        self.fed_parent = np.array([-1])
        self.q: list[torch.Tensor] = []
        self.features: list[torch.Tensor] = []

    def fed_tree(self) -> Tree:
        """F: the draft's cache order (its last level is fed next)."""
        return Tree.from_parents(self.fed_parent)

    def add(self, parent: np.ndarray, rank: np.ndarray, q: torch.Tensor, kids: torch.Tensor,
            features: torch.Tensor, survival: np.ndarray, expand: np.ndarray) -> np.ndarray:
        """Append one step's candidates [c]: `kids` with their `parent` (S indices of the nodes
        fed with q [m, V]) and `rank` among siblings, features [c, F] and survival [c];
        `expand` [c] bool marks those fed next, whose indices are returned."""
        first = len(self.parent)
        fed = np.full(len(parent), -1)
        fed[expand] = len(self.fed_parent) + np.arange(int(expand.sum()))
        self.fed_parent = np.concatenate([self.fed_parent, self.fed[parent[expand]]])
        self.fed = np.concatenate([self.fed, fed])
        self.parent = np.concatenate([self.parent, parent])
        self.rank = np.concatenate([self.rank, rank])
        self.survival = np.concatenate([self.survival, survival])
        self.tokens = torch.cat([self.tokens, kids])
        self.confidence = torch.cat([self.confidence, features[:, PATH_CONFIDENCE]])
        self.on_chain = torch.cat([self.on_chain, features[:, LOOKUP_AGREES]])
        self.q.append(q)
        self.features.append(features)
        return first + np.flatnonzero(expand)

    def retrace(self, tokens: list[int]) -> list[int]:
        """The nodes (S indices) a path of `tokens` below the root follows while the draft
        drafted them (`lookup.retrace`); one read of the tokens on the host."""
        return retrace(self.parent, self.tokens.tolist(), tokens)

    def candidates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`verify_set`'s view of the drafted nodes below the root [n - 1]: survival, parent
        and previous sibling (candidate indices, -1 for none)."""
        index = np.arange(len(self.parent) - 1)
        previous_sibling = np.where(self.rank[1:] > 0, index - 1, -1)
        return self.survival[1:], self.parent[1:] - 1, previous_sibling

    def verify_proposal(self, keep: np.ndarray, root_position: int) -> tuple[Tree, Proposal]:
        """V (the root and the candidates `keep` [n - 1] bool) and its Proposal: q rows of V's
        fed nodes (zero rows for the others), the kept candidates' features by level."""
        nodes = np.concatenate([[0], 1 + np.flatnonzero(keep)])  # V's nodes in S
        in_v = np.full(len(self.parent), -1)
        in_v[nodes] = np.arange(len(nodes))
        parent = self.parent[nodes]
        tree = Tree.from_parents(np.where(parent >= 0, in_v[parent], -1))
        fed = self.fed[nodes]
        drafted_rows = sum(q.shape[0] for q in self.q)
        q_rows = fed[: tree.size(tree.max_depth - 1)]
        q_rows = np.where(q_rows >= 0, q_rows, drafted_rows)  # not fed: the zero row after them
        index = torch.from_numpy(np.concatenate([nodes, q_rows])).to(self.tokens.device)
        nodes_t, q_rows_t = index.split([len(nodes), len(q_rows)])  # one copy for both
        q = torch.cat([*self.q, self.q[0].new_zeros(1, self.q[0].shape[1])]) \
            .index_select(0, q_rows_t)  # 7x faster than indexing [V]-wide rows on a CPU
        level_sizes = np.diff(tree.level_start[1:]).tolist()
        features = torch.cat(self.features)[nodes_t[1:] - 1].split(level_sizes)
        return tree, Proposal(tokens=self.tokens[nodes_t], depth=tree.max_depth,
                              root_position=root_position, q=q, features=tuple(features),
                              fed=torch.from_numpy(fed), steps=len(self.q),
                              drafted=len(self.parent) - 1)
