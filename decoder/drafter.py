"""Drafters: one interface, many drafting strategies (cf. transformers' CandidateGenerator).

A drafter turns the tokens of one tree level into the draft's next-token logits for each of
them; the decode loop samples the children, so every drafter works with every tree shape,
stopping policy and verification rule.  The drafter keeps its own cache and is told after each
round which path the target accepted.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .kv import KVModel
from .sampling import Sampling
from .tree import Tree


class Drafter(Protocol):
    def reset(self, prompt: torch.Tensor) -> None:  # prompt [L]
        """Start a new sequence whose committed tokens so far are `prompt`."""

    def step(self, tree: Tree, level: int, ids: torch.Tensor, root_position: int) -> torch.Tensor:
        """Feed the nodes of `level` (ids [n_level]); return draft logits [n_level, V]."""

    def commit(self, tree: Tree, fed_levels: int, path: list[int], tokens: torch.Tensor) -> None:
        """The target accepted `path` (node indices) of `tokens` [n]; levels < fed_levels were fed."""


class ModelDrafter:
    """An independent draft LM (a small model, or the target truncated) with its own KV cache.

    Committed tokens the draft has not seen yet (the prompt, the deepest accepted node) wait in
    `pending` and are fed as a causal chain in front of the next round's roots.
    """

    def __init__(self, lm: KVModel) -> None:
        self.lm = lm
        self.pending = torch.empty(0, dtype=torch.long)
        self.committed = 0  # cached positions that hold committed tokens

    def reset(self, prompt: torch.Tensor) -> None:
        self.lm.reset()
        self.pending = prompt.cpu()
        self.committed = 0

    def step(self, tree: Tree, level: int, ids: torch.Tensor, root_position: int) -> torch.Tensor:
        if level > 0:
            positions = torch.full((ids.shape[0],), root_position + level, dtype=torch.long)
            return self.lm.extend(ids, positions, tree.level_rows(level))
        m, r = self.pending.shape[0], ids.shape[0]
        assert self.lm.length + m == root_position, (self.lm.length, m, root_position)
        allow = torch.ones(m + r, m + r, dtype=torch.bool).tril()
        allow[m:, m:] = tree.level_rows(0)  # roots see the committed chain and themselves
        positions = torch.arange(root_position - m, root_position + r)
        positions[m:] = root_position
        logits = self.lm.extend(torch.cat([self.pending, ids.cpu()]), positions, allow)
        self.committed = root_position
        self.pending = self.pending[:0]
        return logits[m:]

    def commit(self, tree: Tree, fed_levels: int, path: list[int], tokens: torch.Tensor) -> None:
        path_t = torch.tensor(path, dtype=torch.long)
        if fed_levels == 0:
            self.pending = torch.cat([self.pending, tokens.cpu()[path_t]])
            return
        fed = tree.size(fed_levels - 1)
        is_fed = path_t < fed
        keep = torch.cat([torch.arange(self.committed), self.committed + path_t[is_fed]])
        self.lm.retain(keep)
        self.committed = keep.shape[0]
        self.pending = tokens.cpu()[path_t[~is_fed]]


def draft_children(
    q: torch.Tensor,  # [m, V] draft distributions
    k: int,
    sampling: Sampling,
    without_replacement: bool,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """k candidate tokens per node, [m, k], in sampling order.

    Greedy: the draft's top-k.  Sampling with replacement: i.i.d. draws.  Without replacement:
    Gumbel-top-k, which is distributed as sequential draws from the renormalised rest; when q's
    support is smaller than k the surplus candidates have q = 0 and verification skips them.
    """
    if sampling.greedy:
        return q.topk(k, dim=1).indices
    if k == 1 or not without_replacement:
        return torch.multinomial(q, k, replacement=True, generator=generator)
    u = torch.rand(q.shape, dtype=torch.float64, generator=generator, device=q.device)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
    keys = torch.where(q > 0, q.double().log() + gumbel, float("-inf"))
    return keys.topk(k, dim=1).indices

