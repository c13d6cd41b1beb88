"""Logit warping and random draws shared by the drafter, the verifier and `ar` decoding.

Greedy decoding (temperature 0) never divides by the temperature: it matches arg-maxes.
Probabilities are computed in float32 whatever the model dtype (VERIFICATION.md §6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from a distribution; the same warping for draft and target."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Post-warping probabilities.  logits: [n, V] -> probs [n, V] float32.

    Greedy mode returns the plain softmax (temperature 1): verification uses arg-max matching,
    the probabilities only feed the features and soft labels.
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.softmax(logits, dim=-1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        probs = top_p_filter(probs, sampling.top_p)
    return probs


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose mass reaches top_p (always at least one),
    renormalised."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def uniforms(n: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """[n] float64 uniforms in [0, 1) on `device`, drawn in one call on the generator's device
    (float32 `rand` can return exactly 0; pytorch#16706)."""
    source = generator.device if generator is not None else device
    return torch.rand(n, dtype=torch.float64, generator=generator, device=source).to(device)


def sample(probs: torch.Tensor, generator: torch.Generator | None, k: int = 1) -> torch.Tensor:
    """k i.i.d. token ids per row of probs [..., V] -> [..., k], on their device (no sync): the
    inverse CDF at one uniform per draw (over 49k tokens on a 2-core CPU 0.06 ms a draw, where
    `torch.multinomial` took 1.0 and a Gumbel race, a random number per token, more)."""
    rows = probs.reshape(-1, probs.shape[-1]).double()
    u = uniforms(rows.shape[0] * k, probs.device, generator).view(-1, k)
    return inverse_cdf(rows, u).view(*probs.shape[:-1], k)


def sample_without_replacement(q: torch.Tensor, k: int,
                               generator: torch.Generator | None) -> torch.Tensor:
    """[m, k] token ids per row of q [m, V], drawn in turn from what is left of the row,
    renormalised (the definition; one uniform per draw).  Once a row's support is used up the
    remaining slots hold a token of q 0, which verification skips."""
    weights = q.double()
    u = uniforms(q.shape[0] * k, q.device, generator).view(-1, k)
    padding = (q == 0).long().argmax(dim=1, keepdim=True)  # the first token of q 0
    picks = []
    for j in range(k):
        mass = weights.sum(dim=1, keepdim=True)
        pick = torch.where(mass > 0, inverse_cdf(weights, u[:, j : j + 1]), padding)
        weights = weights.scatter(1, pick, 0.0)
        picks.append(pick)
    return torch.cat(picks, dim=1)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[m, k] the token of each row of weights [m, V] (float64, >= 0) at its uniforms u [m, k]:
    the first whose cumulative weight exceeds u times the row's mass, so never one of weight 0
    (a row of mass 0 gives V)."""
    cdf = weights.cumsum(dim=1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
