"""The draft families the project builds for a target, and the modules they are made of.

1. Truncated target (`layers:N`): the target's first N layers, its embeddings and its head.
2. Compact draft: a truncated target with a (pruned) output head, distilled.
3. Feature-conditioned head (EAGLE, arXiv 2401.15077): one decoder layer that reads the
   target's last hidden state together with the next token's embedding and predicts the next
   hidden state, decoded by a (pruned) head.  It borrows the target's embeddings.  A fused head
   (EAGLE-3, arXiv 2503.01840) reads the target's low, middle and high layers instead, each
   normed, concatenated and projected to one feature; deeper levels read its own predictions
   either way.

A pruned vocabulary holds the N tokens the target gives the most probability over its
responses (`drafts.corpus.token_counts`); the draft gives every other token probability 0,
which keeps verification exact (the target scores the full vocabulary).
Saving and loading the folders: `specstop.drafts.store`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.modeling_outputs import CausalLMOutputWithPast

from specstop.common.errors import SpecstopError

FAMILIES = ("compact", "feature")


LAST_LAYER = (-1,)  # an unfused head reads the target's last (normed) hidden state


def fusion_layers(num_layers: int) -> tuple[int, ...]:
    """The target's low, middle and high `hidden_states` a fused head reads (EAGLE-3's layers
    2, L/2 and L-3; fewer for a target of under 6 layers)."""
    return tuple(sorted({min(2, num_layers), num_layers // 2, max(num_layers - 3, 1)}))


class FeatureHead(nn.Module):
    """fc([feature; embedding]) -> decoder layer(s) -> norm -> predicted feature -> pruned head.

    Its forward mimics a causal LM's (input_ids, attention_mask, position_ids, cache,
    logits_to_keep) plus `features` [B, T, H], so `KVModel` drives it like any draft.  The
    target's hidden states of `target_layers` become features through `project`.
    """

    def __init__(self, config: LlamaConfig, embed_tokens: nn.Embedding, vocab_ids: torch.Tensor,
                 target_layers: tuple[int, ...] = LAST_LAYER):
        super().__init__()
        self.config = config
        self.feature_size = config.hidden_size
        self.target_layers = tuple(target_layers)
        fused = self.target_layers != LAST_LAYER
        self.fuse_norms = nn.ModuleList(
            [LlamaRMSNorm(config.hidden_size, config.rms_norm_eps) for _ in target_layers]
            if fused else [])
        self.fuse = nn.Linear(len(target_layers) * config.hidden_size, config.hidden_size,
                              bias=False) if fused else None
        self.embed_tokens = embed_tokens  # the target's, frozen, not saved
        self.embed_tokens.requires_grad_(False)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.body = LlamaModel(config)
        self.body.embed_tokens = None  # fed with inputs_embeds only
        self.lm_head = nn.Linear(config.hidden_size, vocab_ids.shape[0], bias=False)
        self.register_buffer("vocab_ids", vocab_ids.clone(), persistent=True)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None, use_cache: bool = False,
                logits_to_keep: int = 0, output_hidden_states: bool = True,
                **_: object) -> CausalLMOutputWithPast:
        x = self.fc(torch.cat([features.to(self.dtype),
                               self.embed_tokens(input_ids).to(self.dtype)], dim=-1))
        out = self.body(inputs_embeds=x, attention_mask=attention_mask,
                        position_ids=position_ids, cache=cache, use_cache=use_cache)
        hidden = out.last_hidden_state
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        return CausalLMOutputWithPast(logits=logits, hidden_states=(hidden,))

    @property
    def dtype(self) -> torch.dtype:
        """The head's dtype (read off a norm: its linear layers may be packed for the CPU)."""
        return self.body.norm.weight.dtype

    def project(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] features from the target's hidden states of `target_layers`, concatenated
        [..., len(target_layers) * H]: the last layer's as they are, fused ones normed per
        layer and projected."""
        if self.fuse is None:
            return target_hidden
        parts = target_hidden.to(self.dtype).chunk(len(self.fuse_norms), dim=-1)
        return self.fuse(torch.cat([norm(x) for norm, x in zip(self.fuse_norms, parts)], dim=-1))

    def saved_state(self) -> dict[str, torch.Tensor]:
        return {k: v.contiguous() for k, v in self.state_dict().items()
                if not k.startswith("embed_tokens.")}


def truncated_draft(target: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A draft made of the target's first `layers` decoder layers, embeddings and head."""
    n = target.config.num_hidden_layers
    if not 1 <= layers < n:
        raise SpecstopError(f"a truncated draft needs 1..{n - 1} layers, got {layers}")
    config = AutoConfig.for_model(**{**target.config.to_dict(), "num_hidden_layers": layers})
    config._attn_implementation = "sdpa"
    draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    draft.load_state_dict(target.state_dict(), strict=False)
    return draft.to(next(target.parameters()).device).eval()


def pruned_head(weight: torch.Tensor, vocab_ids: torch.Tensor | None) -> nn.Linear:
    """An output layer over the `vocab_ids` rows of `weight` [V, H] (all rows when None)."""
    rows = weight.detach() if vocab_ids is None else weight.detach()[vocab_ids.to(weight.device)]
    head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device,
                     dtype=rows.dtype)
    head.weight.data.copy_(rows)
    return head


def prune_head(model: nn.Module, vocab_ids: torch.Tensor) -> nn.Module:
    """Replace a causal LM's full output layer by its `vocab_ids` rows."""
    model.lm_head = pruned_head(model.get_output_embeddings().weight, vocab_ids)
    model.config.tie_word_embeddings = False
    return model


class VocabMaskedHead(nn.Module):
    """A pruned output layer whose logits are scattered into the full vocabulary, -inf
    elsewhere: a plain causal LM with it gives the pruned draft's distribution to callers that
    expect full-vocabulary logits (transformers' assisted generation)."""

    def __init__(self, pruned: nn.Linear, vocab_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.pruned = pruned
        self.vocab_size = vocab_size
        self.register_buffer("vocab_ids", vocab_ids.to(pruned.weight.device), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kept = self.pruned(hidden)
        full = kept.new_full((*kept.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids, kept)


def mask_vocabulary(model: nn.Module, vocab_ids: torch.Tensor) -> nn.Module:
    """Give a causal LM full-vocabulary logits that are -inf outside `vocab_ids` (its output
    layer computes only those rows)."""
    weight = model.get_output_embeddings().weight
    model.lm_head = VocabMaskedHead(pruned_head(weight, vocab_ids), vocab_ids, weight.shape[0])
    model.config.tie_word_embeddings = False
    return model


def most_frequent_tokens(counts: torch.Tensor, size: int, always: list[int]) -> torch.Tensor:
    """The `size` token ids of the highest counts (ascending), always including `always`
    (e.g. EOS)."""
    if size <= 0 or size >= counts.shape[0]:
        return torch.arange(counts.shape[0])
    counts = counts.double().clone()
    counts[torch.tensor(always, dtype=torch.long)] = float("inf")
    return counts.topk(size).indices.sort().values


def build_compact(target: nn.Module, layers: int, vocab_ids: torch.Tensor | None) -> nn.Module:
    """The target's first `layers` layers with its embeddings and a head over `vocab_ids`."""
    draft = truncated_draft(target, layers)
    draft.config.tie_word_embeddings = False
    draft.lm_head = pruned_head(target.get_output_embeddings().weight, vocab_ids)
    draft.get_input_embeddings().weight.requires_grad_(False)  # a copy of the target's
    return draft


def build_feature_head(target: nn.Module, layers: int, vocab_ids: torch.Tensor | None,
                       fuse: bool = False) -> FeatureHead:
    """A feature-conditioned head for `target`: `layers` fresh decoder layers, head rows from
    the target's output layer; `fuse`: it reads the target's `fusion_layers`."""
    tc = target.config
    config = LlamaConfig(**{k: v for k, v in tc.to_dict().items()
                            if k in LlamaConfig().to_dict() and k != "architectures"})
    config.num_hidden_layers = layers
    config._attn_implementation = "sdpa"
    weight = target.get_output_embeddings().weight
    ids = torch.arange(weight.shape[0]) if vocab_ids is None else vocab_ids
    read = fusion_layers(tc.num_hidden_layers) if fuse else LAST_LAYER
    head = FeatureHead(config, target.get_input_embeddings(), ids, read).to(weight.device)
    head.lm_head = pruned_head(weight, ids)
    return head.to(weight.dtype)
