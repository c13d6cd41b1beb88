"""Prompt-lookup proposals (transformers' prompt lookup, vLLM's n-gram proposer): no draft model;
below the round's root, the tokens that followed the most recent earlier occurrence of the
text's last n tokens, as a chain.

`Lookup` keeps the committed tokens (the prompt, then every emitted token) and, for each n-gram
(n in [min_ngram, max_ngram]) some token followed, where its most recent such occurrence ends; a
round looks its suffix up in O(max_ngram), whatever the length of the text.  A proposal is a
point mass, so its q rows are one-hot and the loop's exact verification is speculative sampling
with q = onehot(x) (VERIFICATION.md §2, deterministic candidates): greedy accepts while the
token is the target's arg-max; sampling accepts x with probability p(x), else draws the
correction from res(p, onehot(x)), p with x removed.  Greedy `tree` rounds may add the chain
below the root beside the draft's tree (`with_lookup_branch`).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from .contracts import Proposal
from .tree import Tree


class Lookup:
    """The committed tokens and the n-grams they hold, kept as tokens are committed."""

    def __init__(self, tokens: Iterable[int], max_ngram: int = 2, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its most
        # recent occurrence that a token followed
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Commit `tokens`, indexing the n-grams each of them follows."""
        for token in tokens:
            end = len(self.tokens)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.ends[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def chain(self, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the text's last n
        tokens, the longest n that occurred before first; [] when none did."""
        for n in range(min(self.max_ngram, len(self.tokens)), self.min_ngram - 1, -1):
            end = self.ends.get(tuple(self.tokens[-n:]))
            if end is not None:
                return self.tokens[end : end + k]
        return []


def lookup_proposal(
    lookup: Lookup,
    roots: torch.Tensor,  # [1] long, the round's root (emitted whatever is accepted)
    r: torch.Tensor,  # [V] the distribution the root was drawn from
    root_position: int,
    levels: int,  # the longest chain to propose
) -> Proposal:
    """Commit the root to `lookup` (one read of it on the host) and propose the chain it looks
    up below it: q [depth, V] one-hot, node i's child drawn from a point mass.  One step per
    level proposed (a look-up, not a draft forward); nothing is fed to a draft."""
    lookup.extend(roots.tolist())
    chain = torch.tensor(lookup.chain(levels), dtype=torch.long, device=roots.device)
    depth = chain.shape[0]
    q = r.new_zeros(depth, r.shape[0]).scatter_(1, chain[:, None], 1.0)
    tokens = torch.cat([roots, chain])
    return Proposal(tokens=tokens, depth=depth, root_position=root_position, q=q, features=(),
                    fed=torch.full((1 + depth,), -1), steps=depth, drafted=depth)


def with_lookup_branch(
    tree: Tree,
    proposal: Proposal,
    lookup: Lookup,
    levels: int,  # the longest chain to add
) -> tuple[Tree, Proposal]:
    """Greedy `tree` rounds: commit the root to `lookup` and add the chain it looks up below the
    root as one more branch, each of its nodes last in its level (so the tree stays in
    level-major order), unless the draft already proposes its first token (greedy siblings are
    distinct).  Its nodes are not fed to the draft; their q rows are one-hot (greedy ignores q)
    and they carry no features."""
    tokens = proposal.tokens
    lookup.extend(tokens[:1].tolist())
    chain = lookup.chain(levels)
    if not chain or chain[0] in tokens[list(tree.children(0))].tolist():
        return tree, proposal
    n, c, vocab = tokens.shape[0], len(chain), proposal.q.shape[1]
    parent = np.concatenate([tree.parent[:n].numpy(), [0], n + np.arange(c - 1)])
    depth = np.concatenate([tree.depth[:n].numpy(), 1 + np.arange(c)])
    order = np.lexsort((np.arange(n + c) >= n, depth))  # by level, the chain's node last
    new_index = np.empty_like(order)
    new_index[order] = np.arange(n + c)
    merged = Tree.from_parents(np.where(parent[order] >= 0, new_index[parent[order]], -1))
    chain_t = torch.tensor(chain, dtype=torch.long, device=tokens.device)
    q = proposal.q.new_zeros(n + c, vocab)  # by node, the chain's nodes last
    q[: proposal.q.shape[0]] = proposal.q
    q[n : n + c - 1].scatter_(1, chain_t[1:, None], 1.0)
    order_t = torch.from_numpy(order)
    fed = torch.cat([proposal.fed, torch.full((c,), -1)])[order_t]
    order_t = order_t.to(tokens.device)
    q = q[order_t[: merged.size(merged.max_depth - 1)]]
    return merged, Proposal(tokens=torch.cat([tokens, chain_t])[order_t],
                            depth=merged.max_depth, root_position=proposal.root_position, q=q,
                            features=(), fed=fed, steps=proposal.steps, drafted=proposal.drafted)
