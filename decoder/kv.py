"""A causal LM together with its KV cache: append tokens under a tree mask, keep an accepted path.

This is the only place that talks to a transformers model's forward and cache, so the
transformers 5.x details live here (VERIFICATION.md §4): the 4D mask is additive float (a bool
mask is silently wrong under eager attention; the bool tree masks come from `tree.py`), flash
attention cannot take it, the cache keyword is `cache` (`past_key_values` before 5.24), and
compaction is an `index_select` over plain `DynamicLayer`s.  `kept_positions` is the one
computation of which cached positions survive a round; `KVModel.retain` keeps them.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def kept_positions(committed: int, nodes: torch.Tensor) -> torch.Tensor:
    """[committed + k] cache positions to keep: the first `committed`, then the tree nodes
    `nodes` [k] long (ascending tree indices) of the tree cached right after them."""
    return torch.cat([torch.arange(committed), committed + nodes])


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword `model.forward` takes its cache by (`cache` from transformers 5.24 on)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class KVModel:
    """Wraps a causal LM and one sequence's KV cache.

    `extend` appends n tokens; the cache's first `length - tail` positions are visible to all of
    them, and `tail_allow` [n, tail] says which of the last `tail` positions (the tree part,
    ending with the new tokens themselves) each new token may attend to.

    A draft with a pruned output vocabulary returns logits over `vocab_ids` only; they are
    scattered back into the full vocabulary (the rest gets probability 0, so verification stays
    exact).  A feature-conditioned draft head (`feature_size` set) also takes one feature vector
    per new token.
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None,
                 vocab_ids: torch.Tensor | None = None) -> None:
        attn = getattr(model.config, "_attn_implementation", None)
        if attn is not None and "flash" in attn:
            raise ValueError(f"attention '{attn}' cannot take a tree mask; load with sdpa or eager")
        self.model = model
        self.vocab_size = vocab_size or model.config.vocab_size
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(self.device)
        self.feature_size: int | None = getattr(model, "feature_size", None)
        self._cache_kw = cache_keyword(model)
        self.cache = DynamicCache()
        self.length = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.length = 0

    def extend(
        self,
        ids: torch.Tensor,  # [n] long
        positions: torch.Tensor,  # [n] long
        tail_allow: torch.Tensor | None,  # [n, tail] bool; None = plain causal chain
        features: torch.Tensor | None = None,  # [n, feature_size] for a feature-conditioned head
        last_only: bool = False,
    ) -> torch.Tensor:
        """Feed n tokens, cache them, return their logits [n, V] ([1, V] if `last_only`)."""
        return self.extend_with_hidden(ids, positions, tail_allow, features, last_only)[0]

    @torch.inference_mode()
    def extend_with_hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        tail_allow: torch.Tensor | None,
        features: torch.Tensor | None = None,
        last_only: bool = False,
        layers: tuple[int, ...] = (-1,),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `extend`, plus the new tokens' hidden states of `layers` (indices into the model's
        `hidden_states`; -1: the last layer's, normed), concatenated: [n, len(layers) * H]."""
        n = ids.shape[0]
        device = self.device
        mask = None
        if tail_allow is not None:
            tail = tail_allow.shape[1]
            total = self.length + n
            assert tail_allow.shape[0] == n and n <= tail <= total, (tail_allow.shape, n, total)
            allow = torch.ones(n, total, dtype=torch.bool, device=device)
            allow[:, total - tail :] = tail_allow.to(device)
            mask = torch.zeros(1, 1, n, total, dtype=self.dtype, device=device)
            mask.masked_fill_(~allow, torch.finfo(self.dtype).min)
        extra = {} if features is None else {"features": features.to(device, self.dtype)[None]}
        out = self.model(
            input_ids=ids.to(device)[None],
            attention_mask=mask,
            position_ids=positions.to(device)[None],
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=1 if last_only else 0,
            **{self._cache_kw: self.cache},
            **extra,
        )
        self.length += n
        hidden = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)
        return self._full_vocab(out.logits[0]), hidden

    @torch.inference_mode()
    def project(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """A feature-conditioned head's input features [n, H] from the target's hidden states
        of the layers it reads [n, len(layers) * H]."""
        return self.model.project(target_hidden.to(self.device, self.dtype))

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab_ids is None:
            return logits[:, : self.vocab_size]
        full = logits.new_full((logits.shape[0], self.vocab_size), torch.finfo(logits.dtype).min)
        full[:, self.vocab_ids] = logits
        return full

    def retain(self, keep: torch.Tensor) -> None:
        """Keep only the cached positions `keep` (ascending) [m] long; RoPE needs no recompute."""
        if keep.shape[0] == self.length:
            return
        keep = keep.to(self.device)
        for layer in self.cache.layers:
            if type(layer) is not DynamicLayer:
                raise TypeError(f"cannot compact a {type(layer).__name__} cache layer")
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)
        self.length = keep.shape[0]
