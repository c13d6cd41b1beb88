"""Drafters: one interface, many drafting strategies (cf. transformers' CandidateGenerator).

A drafter turns the tokens of one tree level into the draft's next-token logits for each of
them; the decode loop samples the children (`draft_children`), so every drafter works with
every tree shape, stopping policy and verification rule.  The drafter keeps its own cache (its
masks come from `Tree`, `KVModel.retain` keeps its accepted nodes) and is told after each
round which path the target accepted, and which of its nodes it was fed (a round may feed only
some nodes: those of a static tree above its last drafted level, the `tree` method's expanded
ones).  A drafter with `target_layers` also receives the target's hidden states of those layers
(concatenated): of the prompt at `reset`, of the accepted path at `commit`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .kv import KVModel
from .sampling import Sampling, sample, sample_without_replacement, warp
from .tree import Tree


class Drafter(Protocol):
    target_layers: tuple[int, ...]  # the target's hidden-state layers it reads; () = none
    lm: KVModel  # the draft model and its cache (`Runtime.draft`)

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """[S] the tokens it can give probability (a pruned head's); None: every token."""

    def reset(self, prompt: torch.Tensor, target_hidden: torch.Tensor | None = None) -> None:
        """Start a new sequence whose committed tokens so far are `prompt` [L] (the target's
        hidden states of `target_layers` [L, len(target_layers) * H])."""

    def step(self, tree: Tree, level: int, ids: torch.Tensor, root_position: int) -> torch.Tensor:
        """Feed the nodes of `level` of the fed tree `tree` (ids [n_level]); return draft
        logits [n_level, V]."""

    def commit(self, path_tokens: torch.Tensor, fed_path: torch.Tensor,
               path_hidden: torch.Tensor | None = None) -> None:
        """The target accepted `path_tokens` [k] (root first; their hidden states [k, L * H]); the
        first j of them were fed this round, as the fed tree's nodes `fed_path` [j] long (a fed
        node's parent is fed, so they lead the path; j = 0: nothing was fed)."""


class ModelDrafter:
    """An independent draft LM (a small model, or the target truncated) with its own KV cache.

    Committed tokens the draft has not seen yet (the prompt, an accepted node that was not fed)
    wait in `pending` (on the draft's device) and are fed as a causal chain in front of the next
    round's roots.
    """

    target_layers: tuple[int, ...] = ()

    def __init__(self, lm: KVModel) -> None:
        self.lm = lm
        self.pending = torch.empty(0, dtype=torch.long)
        self.committed = 0  # cached positions that hold committed tokens

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        return self.lm.vocab_ids

    def reset(self, prompt: torch.Tensor, target_hidden: torch.Tensor | None = None) -> None:
        self.lm.reset()
        self.pending = prompt.to(self.lm.device)
        self.committed = 0

    def step(self, tree: Tree, level: int, ids: torch.Tensor, root_position: int) -> torch.Tensor:
        ids = ids.to(self.lm.device)
        if level > 0:
            return self.lm.extend(ids, step_positions(root_position, level, 0, ids),
                                  tree.level_bias(level, self.lm.dtype))
        m = self.pending.shape[0]
        assert self.lm.length + m == root_position, (self.lm.length, m, root_position)
        logits = self.lm.extend(torch.cat([self.pending, ids]),
                                step_positions(root_position, 0, m, ids),
                                tree.chain_then_roots(m))
        self.committed = root_position
        self.pending = self.pending[:0]
        return logits[m:]

    def commit(self, path_tokens: torch.Tensor, fed_path: torch.Tensor,
               path_hidden: torch.Tensor | None = None) -> None:
        self.lm.retain(self.committed, fed_path)
        self.committed = self.lm.length
        self.pending = torch.cat([self.pending,
                                  path_tokens[fed_path.shape[0]:].to(self.lm.device)])


class FeatureDrafter:
    """A feature-conditioned draft head (EAGLE, arXiv 2401.15077) with its own KV cache.

    Head position j reads (feature of position j-1, token j) and predicts the feature of
    position j, hence token j+1.  Committed positions read the target's own features (the head
    projects the target's layers it reads to one feature); deeper tree levels read the head's
    predicted feature of their parent.  After a round only the root's cache entry is kept (it
    read a target feature); the accepted tokens below it wait in `pending` with the target's
    features of their parents and are fed before the next roots.
    """

    def __init__(self, lm: KVModel) -> None:
        if lm.feature_size is None:
            raise ValueError("FeatureDrafter needs a feature-conditioned head")
        self.lm = lm
        self.target_layers: tuple[int, ...] = tuple(lm.model.target_layers)
        self.committed = 0

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        return self.lm.vocab_ids

    def reset(self, prompt: torch.Tensor, target_hidden: torch.Tensor | None = None) -> None:
        if target_hidden is None:
            raise ValueError("a feature-conditioned draft needs the target's hidden states")
        self.lm.reset()
        self.committed = 0
        target_hidden = self.lm.project(target_hidden)
        self.pending = prompt[1:].to(self.lm.device)  # position 0 has no preceding feature
        self.pending_features = target_hidden[:-1]
        self.last_feature = target_hidden[-1]  # the feature the next root was drawn from
        self.node_features = target_hidden[:0]  # the head's predicted feature per tree node

    def step(self, tree: Tree, level: int, ids: torch.Tensor, root_position: int) -> torch.Tensor:
        ids = ids.to(self.lm.device)
        if level > 0:
            parents = tree.parent[tree.level(level)].to(self.node_features.device)
            logits, hidden = self.lm.extend_with_hidden(
                ids, step_positions(root_position, level, 0, ids),
                tree.level_bias(level, self.lm.dtype), self.node_features[parents])
            self.node_features = torch.cat([self.node_features, hidden])
            return logits
        m, r = self.pending.shape[0], ids.shape[0]
        assert self.lm.length + m == root_position - 1, (self.lm.length, m, root_position)
        features = torch.cat([self.pending_features, self.last_feature.expand(r, -1)])
        logits, hidden = self.lm.extend_with_hidden(torch.cat([self.pending, ids]),
                                                    step_positions(root_position, 0, m, ids),
                                                    tree.chain_then_roots(m), features)
        self.committed = self.lm.length - r
        self.node_features = hidden[m:]
        return logits[m:]

    def commit(self, path_tokens: torch.Tensor, fed_path: torch.Tensor,
               path_hidden: torch.Tensor | None = None) -> None:
        if path_hidden is None:
            raise ValueError("a feature-conditioned draft needs the target's hidden states")
        path_hidden = self.lm.project(path_hidden)
        accepted, below_root = path_tokens.to(self.lm.device), path_hidden[:-1]
        if fed_path.shape[0] > 0:
            self.lm.retain(self.committed, fed_path[:1])
            self.committed = self.lm.length
            self.pending = accepted[1:]
            self.pending_features = below_root
        else:  # nothing was drafted: the root has not been fed either
            self.pending = torch.cat([self.pending, accepted])
            self.pending_features = torch.cat([self.pending_features, self.last_feature[None],
                                               below_root])
        self.last_feature = path_hidden[-1]


def step_positions(root_position: int, level: int, pending: int,
                   ids: torch.Tensor) -> torch.Tensor:
    """[pending + n] positions of a draft step feeding `ids` [n], on their device: `pending`
    committed tokens count up to the roots' `root_position` (level 0), the nodes of `level`
    all sit at `root_position + level`."""
    chain = torch.arange(root_position - pending, root_position + ids.shape[0], device=ids.device)
    return chain.clamp_max(root_position) + level


@dataclass(frozen=True)
class DraftedLevel:
    """One draft step's children: `q` [m, V] the warped draft distribution of each node fed
    (what verification reads) and `tokens` [m, k] its children in sampling order; the same over
    the draft's support (`support_q` [m, S], the children's `columns` [m, k] in it), where they
    were drawn and where the features are computed."""

    q: torch.Tensor
    tokens: torch.Tensor
    support_q: torch.Tensor
    columns: torch.Tensor


def draft_level(
    logits: torch.Tensor,  # [m, V] the draft's logits of the nodes fed
    support: torch.Tensor | None,  # [S] the tokens the draft can give probability (a pruned
    # head's `KVModel.vocab_ids`); None: the vocabulary
    k: int,
    sampling: Sampling,
    without_replacement: bool,
    generator: torch.Generator | None,
) -> DraftedLevel:
    """q and k children per node fed (`draft_children`), warped and drawn over the `support`
    only: every other token has q 0 (a pruned head scatters -inf there), so these are draws
    from q itself, over S columns instead of V (4,096 of 49,152 for the default draft)."""
    if support is None:
        q = warp(logits, sampling)
        tokens = draft_children(q, k, sampling, without_replacement, generator)
        return DraftedLevel(q, tokens, q, tokens)
    support_q = warp(logits.index_select(1, support), sampling)
    columns = draft_children(support_q, k, sampling, without_replacement, generator)
    q = support_q.new_zeros(support_q.shape[0], logits.shape[1]).index_copy_(1, support,
                                                                              support_q)
    return DraftedLevel(q, support[columns], support_q, columns)


def draft_children(
    q: torch.Tensor,  # [m, V] draft distributions
    k: int,
    sampling: Sampling,
    without_replacement: bool,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """k candidate tokens per node, [m, k], in sampling order.

    Greedy: the draft's top-k.  Sampling with replacement: i.i.d. draws.  Without replacement:
    sequential draws from the renormalised rest; when q's support is smaller than k the surplus
    candidates have q = 0 and verification skips them.
    """
    if sampling.greedy:
        return q.topk(k, dim=1).indices
    if k == 1 or not without_replacement:
        return sample(q, generator, k)
    return sample_without_replacement(q, k, generator)

