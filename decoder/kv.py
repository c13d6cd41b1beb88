"""A causal LM together with its KV cache: append tokens under a tree mask, keep an accepted path.

This is the only place that talks to a transformers model's forward and cache, so the
transformers 5.x details live here (VERIFICATION.md §4): the 4D mask is additive float (a bool
mask is silently wrong under eager attention; the bool tree masks come from `tree.py`), flash
attention cannot take it, the cache keyword is `cache` (`past_key_values` before 5.24), and
hidden states are asked for by index (`output_hidden_states=[...]`), so a pass keeps only the
layers a drafter reads.  The cache is made of `InPlaceLayer`s, whose keys and values live in
buffers written in place; `KVModel.retain` keeps a round's accepted path by moving its
positions down, O(accepted tokens) per layer.

After `KVModel.capture()`, the forwards over up to `GRAPH_TOKENS` new tokens are captured by
`torch.compile` (on CUDA as CUDA graphs, mode reduce-overhead): each call is padded to a power of
two and attends over the whole preallocated cache under a mask built here (`GraphLayer`), so a
call's shapes never depend on the cached length and a handful of shapes are compiled once.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

from specstop.common.errors import SpecstopError

from .kernels import kernel_of
from .tree import additive


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword `model.forward` takes its cache by (`cache` from transformers 5.24 on)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class InPlaceLayer(CacheLayerMixin):
    """One attention layer's cache: keys and values [B, heads, capacity, head_dim] in buffers
    written in place, `keys`/`values` the views of the first `length` positions.

    `update` appends without copying what is cached (a `DynamicLayer` concatenates, copying all
    of it, at every forward); a write past the capacity doubles it (one copy, amortised), so
    nothing needs to know the capacity up front, and `reserve` allocates once for a caller that
    does.  `reset` keeps the buffers.  `retain` and `select_rows` are the only other changes of
    contents; what transformers asks of a layer (`get_seq_length`, `get_mask_sizes`,
    `get_max_length`) reads `length`."""

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.key_buffer = _buffer_like(key_states, self.capacity)
        self.value_buffer = _buffer_like(value_states, self.capacity)
        self.is_initialized = True
        self._set_length(0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self.reserve(max(end, 2 * self.capacity))
        self.key_buffer[:, :, self.length:end] = key_states
        self.value_buffer[:, :, self.length:end] = value_states
        self._set_length(end)
        return self.keys, self.values

    def reserve(self, tokens: int) -> None:
        """Room for at least `tokens` positions (growing copies the cached ones once)."""
        if tokens <= self.capacity:
            return
        self.capacity = tokens
        if self.is_initialized:
            self.key_buffer = self._grown(self.key_buffer)
            self.value_buffer = self._grown(self.value_buffer)
            self._set_length(self.length)

    def retain(self, committed: int, nodes: torch.Tensor) -> None:
        """Keep the first `committed` positions, then the positions `committed + nodes` [k] long
        (ascending, on the buffers' device), moved down to `committed .. committed + k`."""
        end = committed + nodes.shape[0]
        if nodes.shape[0]:
            source = committed + nodes
            for buffer in (self.key_buffer, self.value_buffer):
                buffer[:, :, committed:end] = buffer.index_select(2, source)
        self._set_length(end)

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only the batch rows `keep` (one copy of the buffers)."""
        self.key_buffer = self.key_buffer.index_select(0, keep)
        self.value_buffer = self.value_buffer.index_select(0, keep)
        self._set_length(self.length)

    def reset(self) -> None:
        self._set_length(0)

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask for `query_length` new positions."""
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1  # grows without bound

    def _grown(self, buffer: torch.Tensor) -> torch.Tensor:
        grown = _buffer_like(buffer, self.capacity)
        grown[:, :, :self.length] = buffer[:, :, :self.length]
        return grown

    def _set_length(self, length: int) -> None:
        self.length = length
        if self.is_initialized:
            self.keys = self.key_buffer[:, :, :length]
            self.values = self.value_buffer[:, :, :length]


class GraphLayer(InPlaceLayer):
    """An `InPlaceLayer` a captured forward writes: while compiling, `update` writes at the
    positions after `cursor` (a device tensor the `KVModel` keeps at the cached length) and
    attention reads the whole buffers (the caller's mask hides what lies past the new tokens),
    so nothing a compiled call sees depends on the length.  The buffers are marked static
    (CUDA graphs read them in place); an eager call (a prefill) is `InPlaceLayer`'s."""

    def __init__(self, cursor: torch.Tensor, capacity: int = 0) -> None:
        super().__init__(capacity)
        self.cursor = cursor

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._mark_static()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not torch.compiler.is_compiling():
            return super().update(key_states, value_states, *args, **kwargs)
        at = self.cursor + torch.arange(key_states.shape[-2], device=key_states.device)
        self.key_buffer.index_copy_(2, at, key_states)
        self.value_buffer.index_copy_(2, at, value_states)
        return self.key_buffer, self.value_buffer

    def reserve(self, tokens: int) -> None:
        grows = tokens > self.capacity and self.is_initialized
        super().reserve(tokens)
        if grows:
            self._mark_static()

    def _mark_static(self) -> None:
        for buffer in (self.key_buffer, self.value_buffer):
            torch._dynamo.mark_static_address(buffer)


def _buffer_like(states: torch.Tensor, capacity: int) -> torch.Tensor:
    """A zeroed [B, heads, capacity, head_dim] buffer for `states` [B, heads, n, head_dim] (their
    dtype and device): a captured forward attends over all of it, and a masked NaN still
    poisons attention."""
    b, h, _, d = states.shape
    return states.new_zeros(b, h, capacity, d)


class KVModel:
    """Wraps a causal LM and one sequence's KV cache (or, for the draft corpus' batched
    decoding, a batch of sequences: `extend_rows`, `keep_rows`).

    `extend` appends n tokens; the cache's first `length - tail` positions are visible to all of
    them, and `tail_allow` [n, tail] says which of the last `tail` positions (the tree part,
    ending with the new tokens themselves) each new token may attend to: a bool mask, or the
    additive mask of the model's dtype (`tree.additive`, which a `Tree` keeps once built).

    A draft with a pruned output vocabulary returns logits over `vocab_ids` only; they are
    scattered back into the full vocabulary (the rest gets probability 0, so verification stays
    exact).  A feature-conditioned draft head (`feature_size` set) also takes one feature vector
    per new token.  After `capture()`, the forwards are captured (module docstring).
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
        self.cache = Cache(layers=[InPlaceLayer() for _ in range(model.config.num_hidden_layers)])
        self.captured: Callable[..., ModelOutput] | None = None

    def capture(self) -> KVModel:
        """Capture the forwards from now on (before the first): a `GraphLayer` cache and the
        model compiled by `capture`."""
        assert self.length == 0, "capture before the first forward"
        self.cursor = torch.zeros((), dtype=torch.long, device=self.device)
        torch._dynamo.mark_static_address(self.cursor)
        self.cache = Cache(layers=[GraphLayer(self.cursor) for _ in self.cache.layers])
        self.captured = capture(self.model)
        return self

    @property
    def kernel(self) -> str:
        """How its forwards run: the CPU linear kernel (`kernels.kernel_of`), `+compiled` once
        captured (a cost table measured one way does not hold for the other)."""
        return kernel_of(self.model) + ("+compiled" if self.captured is not None else "")

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def length(self) -> int:
        """Cached positions (every layer holds as many)."""
        return self.cache.layers[0].length

    def reset(self) -> None:
        """Empty the cache (its buffers stay allocated)."""
        self.cache.reset()
        self._follow_length()

    @torch.inference_mode()
    def reserve(self, tokens: int) -> None:
        """Allocate room for `tokens` cached positions now rather than growing into it (with
        `capture()`, a multiple of `CAPACITY_STEP`: each capacity is a shape to compile)."""
        if self.captured is not None:
            tokens = -(-tokens // CAPACITY_STEP) * CAPACITY_STEP
        for layer in self.cache.layers:
            layer.reserve(tokens)

    @torch.inference_mode()
    def extend(
        self,
        ids: torch.Tensor,  # [n] long
        positions: torch.Tensor,  # [n] long
        tail_allow: torch.Tensor | None,  # [n, tail] bool or additive; None = causal chain
        features: torch.Tensor | None = None,  # [n, feature_size] for a feature-conditioned head
        last_only: bool = False,
    ) -> torch.Tensor:
        """Feed n tokens, cache them, return their logits [n, V] ([1, V] if `last_only`)."""
        out = self._forward(ids, positions, tail_allow, features, last_only, hidden_states=False)
        return self._full_vocab(out.logits[0])

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
        `hidden_states`; -1: the last layer's, normed), concatenated: [n, len(layers) * H]
        ([n, 0] for no layers).  Only those layers are kept by the pass."""
        out = self._forward(ids, positions, tail_allow, features, last_only,
                            hidden_states=list(layers) or False)
        if layers:
            hidden = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)
        else:
            hidden = out.logits.new_empty(ids.shape[0], 0)
        return self._full_vocab(out.logits[0]), hidden

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor,
                 tail_allow: torch.Tensor | None, features: torch.Tensor | None,
                 last_only: bool, hidden_states: list[int] | bool) -> ModelOutput:
        """One cached forward over n new tokens under the tree mask; `hidden_states` as
        transformers' `output_hidden_states` (indices select layers)."""
        n = ids.shape[0]
        device = self.device
        if self.captured is not None and n <= GRAPH_TOKENS and self.cache.layers[0].is_initialized:
            return self._captured_forward(ids, positions, tail_allow, features, hidden_states)
        mask = None
        if tail_allow is not None:
            tail = tail_allow.shape[1]
            total = self.length + n
            assert tail_allow.shape[0] == n and n <= tail <= total, (tail_allow.shape, n, total)
            bias = tail_allow.to(device)
            if bias.dtype == torch.bool:
                bias = additive(bias, self.dtype)
            mask = torch.cat([bias.new_zeros(n, total - tail), bias], dim=1)[None, None]
        extra = {} if features is None else {"features": features.to(device, self.dtype)[None]}
        out = self.model(
            input_ids=ids.to(device)[None],
            attention_mask=mask,
            position_ids=positions.to(device)[None],
            use_cache=True,
            output_hidden_states=hidden_states,
            logits_to_keep=1 if last_only else 0,
            **{self._cache_kw: self.cache},
            **extra,
        )
        self._follow_length()
        return out

    def _captured_forward(self, ids: torch.Tensor, positions: torch.Tensor,
                          tail_allow: torch.Tensor | None, features: torch.Tensor | None,
                          hidden_states: list[int] | bool) -> ModelOutput:
        """`_forward` through the captured model: the n tokens padded to a power of two (each
        padding row sees only itself and is dropped from the cache after), attending over the
        whole cache; the outputs are cloned (a CUDA graph's are overwritten by its next
        replay)."""
        n, device, start = ids.shape[0], self.device, self.length
        width = 1 << (n - 1).bit_length()
        self.reserve(start + width)
        mask = self._whole_cache_mask(n, width, tail_allow)
        pad = width - n
        ids = torch.cat([ids.to(device), ids[:1].to(device).expand(pad)])
        positions = torch.cat([positions.to(device), positions[:1].to(device).expand(pad)])
        extra = {}
        if features is not None:
            features = features.to(device, self.dtype)
            extra["features"] = torch.cat([features, features[:1].expand(pad, -1)])[None]
        torch.compiler.cudagraph_mark_step_begin()
        out = self.captured(input_ids=ids[None], attention_mask=mask[None, None],
                            position_ids=positions[None], use_cache=True,
                            output_hidden_states=hidden_states, logits_to_keep=0,
                            **{self._cache_kw: self.cache}, **extra)
        for layer in self.cache.layers:
            layer._set_length(start + n)
        self._follow_length()
        hidden = None
        if hidden_states:
            hidden = tuple(None if h is None else h[:, :n].clone() for h in out.hidden_states)
        return CausalLMOutputWithPast(logits=out.logits[:, :n].clone(), hidden_states=hidden)

    def _whole_cache_mask(self, n: int, width: int,
                          tail_allow: torch.Tensor | None) -> torch.Tensor:
        """[width, capacity] additive mask of a captured call over n new tokens padded to
        `width`: a new token sees the cached positions before the tail and `tail_allow` (None: a
        causal chain), a padding row only itself, nothing sees past them."""
        device, start = self.device, self.length
        if tail_allow is None:
            tail_allow = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        bias = tail_allow.to(device)
        if bias.dtype == torch.bool:
            bias = additive(bias, self.dtype)
        end, capacity = start + n, self.cache.layers[0].capacity
        mask = torch.full((width, capacity), torch.finfo(self.dtype).min, dtype=self.dtype,
                          device=device)
        mask[:n, : end - bias.shape[1]] = 0.0
        mask[:n, end - bias.shape[1]: end] = bias
        mask[n:, end: start + width].fill_diagonal_(0.0)
        return mask

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

    @torch.inference_mode()
    def retain(self, committed: int, nodes: torch.Tensor) -> None:
        """Keep the first `committed` cached positions, then the tree positions `committed +
        nodes` ([k] long, ascending; sent to the cache's device unless they are there) moved down
        to follow them.  RoPE needs no recompute: positions were fed explicitly."""
        assert committed + nodes.shape[0] <= self.length, (committed, nodes.shape, self.length)
        nodes = nodes.to(self.device)
        for layer in self.cache.layers:
            layer.retain(committed, nodes)
        self._follow_length()

    @torch.inference_mode()
    def extend_rows(
        self,
        ids: torch.Tensor,  # [B, n] long
        positions: torch.Tensor,  # [B, n] long
        attention_mask: torch.Tensor,  # [B, length + n] long: 0 at a row's left padding
        last_only: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Feed n tokens to each of B sequences cached as the rows of one batch (left-padded to
        a common length; causal within); return their logits [B, n, V] ([B, 1, V] if
        `last_only`) and every layer's hidden states [B, n, H] (transformers' tuple).  For a
        full-vocabulary model, never captured; a single sequence's calls are `extend`'s."""
        assert self.vocab_ids is None and self.captured is None, "a batch is a plain model's"
        device = self.device
        out = self.model(input_ids=ids.to(device), attention_mask=attention_mask.to(device),
                         position_ids=positions.to(device), use_cache=True,
                         output_hidden_states=True, logits_to_keep=1 if last_only else 0,
                         **{self._cache_kw: self.cache})
        return out.logits[..., : self.vocab_size], out.hidden_states

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Keep only the batch rows `keep` [k] long (on the cache's device) of every layer."""
        for layer in self.cache.layers:
            layer.select_rows(keep)

    def _follow_length(self) -> None:
        """Once captured, set the device cursor (where a captured call writes) to the length."""
        if self.captured is not None:
            self.cursor.fill_(self.length)


GRAPH_TOKENS = 64  # calls over more new tokens (a prefill) run eagerly: they are compute-bound
CAPACITY_STEP = 256  # a captured cache's capacity is a multiple of this
GRAPH_SHAPES = 64  # compiled variants kept per model: widths x hidden-state layers x capacities


def captures(setting: str, device: torch.device, cpu_kernel: str) -> bool:
    """Whether params' `models.compile` (auto | on | off) captures the forwards on `device`:
    auto does on CUDA only.  On a CPU it needs aten's linear (Inductor cannot lower oneDNN's
    prepacked one): a SpecstopError otherwise."""
    on = setting == "on" or (setting == "auto" and device.type == "cuda")
    if on and device.type == "cpu" and cpu_kernel != "aten":
        raise SpecstopError(f"models.compile: on needs models.cpu_kernel: aten on a CPU "
                            f"(Inductor cannot lower the prepacked {cpu_kernel} linear)")
    return on


def capture(model: torch.nn.Module) -> Callable[..., ModelOutput]:
    """`model` compiled for `KVModel.capture`: on CUDA as CUDA graphs (mode
    reduce-overhead), elsewhere with Inductor's defaults; one compiled variant per shape."""
    cuda = next(model.parameters()).device.type == "cuda"
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, GRAPH_SHAPES)
    return torch.compile(model, mode="reduce-overhead" if cuda else None, dynamic=False)
