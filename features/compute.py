"""Compute the feature vector of every token drafted in one draft step (vectorised, no syncs)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .schema import FEATURES, TOP_K


@dataclass(frozen=True)
class RoundContext:
    """Per-round values shared by every drafted token of the round."""

    tokens_generated: int
    prev_accepted: int
    running_acceptance: float
    accepted_ema: float
    root: torch.Tensor  # [2] entropy and top-1 - top-2 margin of the target's root distribution
    chain: tuple[int, ...] = ()  # the prompt-lookup chain below the root (`decoder.lookup`)
    lookup_ngram: int = 0  # the n-gram length it was matched on (0: none)
    lookup_recent: float = 0.0  # `Lookup.recent` then

    @cached_property
    def host_values(self) -> torch.Tensor:
        """[6] float32 the history's four values, then the chain's n-gram length and the
        lookup's recent accuracy, on the root statistics' device (one copy a round)."""
        return torch.tensor([self.tokens_generated, self.prev_accepted, self.running_acceptance,
                             self.accepted_ema, self.lookup_ngram, self.lookup_recent],
                            dtype=torch.float32, device=self.root.device)

    @cached_property
    def scalars(self) -> torch.Tensor:
        """[6] float32 the history's four values and the root statistics (on their device)."""
        return torch.cat([self.host_values[:4], self.root.float()])


def root_statistics(r: torch.Tensor) -> torch.Tensor:
    """[2] entropy and top-1 minus top-2 probability of the target distribution r [V] (on r's
    device, no sync)."""
    r = r.float()
    top = r.topk(min(2, r.shape[0])).values
    margin = top[0] - top[1] if top.shape[0] > 1 else top[0]
    return torch.stack([-(r * r.clamp_min(1e-30).log()).sum(), margin])


def draft_features(
    q: torch.Tensor,  # [m, V] draft distributions the new tokens were drawn from (one per parent)
    tokens: torch.Tensor,  # [m, k] tokens drafted at each parent
    depth: int,  # level of the new tokens (>= 1)
    root_rank: torch.Tensor,  # [m * k] rank of each new token's root
    root_target_prob: torch.Tensor,  # [m * k] target probability of each new token's root
    parent_confidence: torch.Tensor,  # [m] path confidence of each parent (1 at the root)
    parent_on_chain: torch.Tensor,  # [m] 1 where each parent's branch is the chain's prefix
    context: RoundContext,          # (1 at the root)
    columns: torch.Tensor | None = None,  # [m, k] the tokens' columns of q when q spans the
    # draft's support only (the rest of the vocabulary has q 0); None: q spans the vocabulary
) -> torch.Tensor:
    """Features [m * k, F] float32 of the new tokens, in tree (level-major) order."""
    m, k = tokens.shape
    q = q.float()
    q_token = q.gather(1, tokens if columns is None else columns)  # [m, k]
    top = q.topk(min(TOP_K, q.shape[1]), dim=1).values  # [m, <=10]
    if top.shape[1] < TOP_K:
        top = torch.nn.functional.pad(top, (0, TOP_K - top.shape[1]))
    entropy = -(q * q.clamp_min(1e-30).log()).sum(dim=1)  # [m]
    per_parent = torch.cat(
        [top[:, :1], top[:, 1:2], top[:, :1] - top[:, 1:2], entropy[:, None], top], dim=1
    )  # [m, 14]
    n = m * k
    scalars = context.scalars.to(q.device).expand(n, 6)
    if depth <= len(context.chain):  # the chain has a token at this level: below which parents
        reaches = parent_on_chain.float().to(q.device)[:, None]
        agrees = reaches * (tokens == context.chain[depth - 1]).float()  # [m, k]
    else:
        reaches, agrees = q.new_zeros(m, 1), q.new_zeros(m, k)
    features = torch.cat(
        [
            q_token.reshape(n, 1),
            per_parent.repeat_interleave(k, dim=0),
            torch.full((n, 1), float(depth), device=q.device),
            torch.arange(k, dtype=torch.float32, device=q.device).repeat(m)[:, None],
            root_rank.to(q.device).float()[:, None],
            root_target_prob.to(q.device).float()[:, None],
            (parent_confidence.float()[:, None] * q_token).reshape(n, 1),
            scalars,
            agrees.reshape(n, 1),
            (reaches - agrees).reshape(n, 1),
            context.host_values[4:].to(q.device).expand(n, 2),
        ],
        dim=1,
    )
    assert features.shape == (n, len(FEATURES)), features.shape
    return features
