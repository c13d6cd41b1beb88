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
    """Keep the smallest set of tokens whose mass reaches top_p (always at least one), renormalised."""
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


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id [1] from probs [V], on their device (no sync)."""
    return torch.multinomial(probs, 1, generator=generator)
