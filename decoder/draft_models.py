"""The two draft families the project builds for a target, their files, and loading them.

1. Compact draft: the target's first N layers, its embeddings and a (pruned) output head.
   Saved as a normal transformers folder (full-vocabulary head, the pruned rows trained), plus
   `specstop_draft.json` naming the pruned vocabulary, so it loads like any user's draft.
2. Feature-conditioned head (EAGLE, arXiv 2401.15077): one decoder layer that reads the
   target's last hidden state together with the next token's embedding and predicts the next
   hidden state, decoded by a (pruned) head.  It borrows the target's embeddings at load time.

A pruned vocabulary holds the N tokens the target emits most often; the draft gives every other
token probability 0, which keeps verification exact (the target scores the full vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, LlamaConfig, LlamaModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from specstop.common.errors import SpecstopError, first_line
from specstop.common.files import write_atomic, write_json
from .model_files import LOAD_ERRORS, corrupt_weights, read_json_object
from .models import truncated_draft

META_FILE = "specstop_draft.json"
HEAD_WEIGHTS = "head.safetensors"
FAMILIES = ("compact", "feature")


def _positive_int(value: object) -> bool:
    return type(value) is int and value > 0


def _token_ids(value: object) -> bool:
    return value is None or (isinstance(value, list) and len(value) > 0
                             and all(type(i) is int and i >= 0 for i in value))


# the metadata keys `save_draft` writes that loaders read: what each must be, and its test
META_KEYS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "target_vocab_size": ("a positive integer", _positive_int),
    "target_hidden_size": ("a positive integer", _positive_int),
    "vocab_ids": ("null or a non-empty list of token ids", _token_ids),
}
REQUIRED_META = {"compact": ("vocab_ids",), "feature": ("target_vocab_size", "target_hidden_size")}


class FeatureHead(nn.Module):
    """fc([feature; embedding]) -> decoder layer(s) -> norm -> predicted feature -> pruned head.

    Its forward mimics a causal LM's (input_ids, attention_mask, position_ids, cache,
    logits_to_keep) plus `features` [B, T, H], so `KVModel` drives it like any draft.
    """

    def __init__(self, config: LlamaConfig, embed_tokens: nn.Embedding, vocab_ids: torch.Tensor):
        super().__init__()
        self.config = config
        self.feature_size = config.hidden_size
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
        x = self.fc(torch.cat([features.to(self.fc.weight.dtype),
                               self.embed_tokens(input_ids).to(self.fc.weight.dtype)], dim=-1))
        out = self.body(inputs_embeds=x, attention_mask=attention_mask,
                        position_ids=position_ids, cache=cache, use_cache=use_cache)
        hidden = out.last_hidden_state
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        return CausalLMOutputWithPast(logits=logits, hidden_states=(hidden,))

    def saved_state(self) -> dict[str, torch.Tensor]:
        return {k: v.contiguous() for k, v in self.state_dict().items()
                if not k.startswith("embed_tokens.")}


@dataclass
class LoadedDraft:
    model: nn.Module
    family: str
    vocab_ids: torch.Tensor | None  # None = the full vocabulary


def most_frequent_tokens(counts: torch.Tensor, size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent token ids (ascending), always including `always` (e.g. EOS)."""
    if size <= 0 or size >= counts.shape[0]:
        return torch.arange(counts.shape[0])
    counts = counts.double().clone()
    counts[torch.tensor(always, dtype=torch.long)] = float("inf")
    return counts.topk(size).indices.sort().values


def build_compact(target: nn.Module, layers: int, vocab_ids: torch.Tensor | None) -> nn.Module:
    """The target's first `layers` layers with its embeddings and a head over `vocab_ids`."""
    draft = truncated_draft(target, layers)
    draft.config.tie_word_embeddings = False
    weight = target.get_output_embeddings().weight.detach()
    rows = weight if vocab_ids is None else weight[vocab_ids.to(weight.device)]
    head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device,
                     dtype=rows.dtype)
    head.weight.data.copy_(rows)
    draft.lm_head = head
    draft.get_input_embeddings().weight.requires_grad_(False)  # a copy of the target's
    return draft


def build_feature_head(target: nn.Module, layers: int, vocab_ids: torch.Tensor | None) -> FeatureHead:
    """A feature-conditioned head for `target`: `layers` fresh decoder layers, head rows from
    the target's output layer."""
    tc = target.config
    config = LlamaConfig(**{k: v for k, v in tc.to_dict().items()
                            if k in LlamaConfig().to_dict() and k != "architectures"})
    config.num_hidden_layers = layers
    config._attn_implementation = "sdpa"
    weight = target.get_output_embeddings().weight.detach()
    ids = torch.arange(weight.shape[0]) if vocab_ids is None else vocab_ids
    head = FeatureHead(config, target.get_input_embeddings(), ids).to(weight.device)
    head.lm_head.weight.data.copy_(weight[ids.to(weight.device)])
    return head.to(weight.dtype)


def save_draft(folder: Path, draft: nn.Module, family: str, target: nn.Module,
               vocab_ids: torch.Tensor | None, info: dict, tokenizer=None) -> None:
    """Write a draft folder (atomic per file); `info` is stored in the metadata file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = target.config.vocab_size
    if family == "compact":
        full = _compact_with_full_head(draft, target, vocab_ids)
        full.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
    else:
        draft.config.save_pretrained(folder)
        state = {k: v.detach().cpu() for k, v in draft.saved_state().items()}
        write_atomic(folder / HEAD_WEIGHTS, lambda tmp: save_file(state, str(tmp)))
    meta = {"family": family, "target_vocab_size": vocab,
            "target_hidden_size": target.config.hidden_size,
            "vocab_ids": None if vocab_ids is None else vocab_ids.tolist(), **info}
    write_json(folder / META_FILE, meta)


def _compact_with_full_head(draft: nn.Module, target: nn.Module,
                            vocab_ids: torch.Tensor | None) -> nn.Module:
    """A plain transformers copy of a compact draft: the full-vocabulary head, trained rows in."""
    from transformers import AutoModelForCausalLM

    config = AutoConfig.for_model(**draft.config.to_dict())
    config.tie_word_embeddings = False
    full = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.detach().float().cpu() for k, v in draft.state_dict().items()
             if not k.startswith("lm_head.")}
    head = target.get_output_embeddings().weight.detach().float().cpu().clone()
    trained = draft.lm_head.weight.detach().float().cpu()
    if vocab_ids is None:
        head = trained
    else:
        head[vocab_ids] = trained
    state["lm_head.weight"] = head
    full.load_state_dict(state)
    return full


def read_meta(folder: Path) -> dict | None:
    """The draft metadata of a folder, or None when it is not a specstop-built draft; a
    SpecstopError names the file and the missing or malformed key."""
    path = Path(folder) / META_FILE
    if not path.is_file():
        return None
    meta = read_json_object(path)
    if meta.get("family") not in FAMILIES:
        raise SpecstopError(f"{path}: field 'family' must be one of {', '.join(FAMILIES)}")
    required = REQUIRED_META[meta["family"]]
    missing = [key for key in required if key not in meta]
    if missing:
        raise SpecstopError(f"{path}: missing key(s) {', '.join(missing)} "
                            f"(needed by a {meta['family']} draft)")
    for key in required:
        what, valid = META_KEYS[key]
        if not valid(meta[key]):
            raise SpecstopError(f"{path}: key '{key}' must be {what}")
    return meta


def load_feature_head(folder: Path, target: nn.Module, meta: dict) -> LoadedDraft:
    """Rebuild a saved feature-conditioned head on top of `target`'s embeddings."""
    folder = Path(folder)
    if (meta["target_vocab_size"], meta["target_hidden_size"]) != (
            target.config.vocab_size, target.config.hidden_size):
        raise SpecstopError(f"{folder}: draft head built for a target with vocabulary "
                            f"{meta['target_vocab_size']} and hidden size "
                            f"{meta['target_hidden_size']}, not this target")
    config_file = folder / "config.json"
    if not config_file.is_file():  # else transformers takes the folder for a hub id
        raise SpecstopError(f"{folder}: no config.json (the head's config)")
    try:
        config = LlamaConfig.from_pretrained(folder)
    except LOAD_ERRORS as err:
        raise SpecstopError(f"{config_file}: not a usable head config "
                            f"({first_line(err)})") from err
    config._attn_implementation = "sdpa"
    state = _head_state(folder / HEAD_WEIGHTS)
    head = FeatureHead(config, target.get_input_embeddings(), state["vocab_ids"])
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a tensor of another shape
        raise SpecstopError(f"{folder / HEAD_WEIGHTS}: weights do not match the head's config "
                            f"({first_line(err)})") from err
    if unexpected or any(not k.startswith("embed_tokens.") for k in missing):
        raise SpecstopError(f"{folder / HEAD_WEIGHTS}: weights do not match the head's config "
                            f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    param = next(target.parameters())
    head = head.to(param.device, param.dtype).eval()
    ids = state["vocab_ids"]
    return LoadedDraft(head, "feature", None if ids.shape[0] == target.config.vocab_size else ids)


def _head_state(weights: Path) -> dict[str, torch.Tensor]:
    """The tensors of a head's weights file, with a 1-D integer `vocab_ids` among them."""
    if not weights.is_file():
        raise SpecstopError(f"{weights}: draft head weights missing")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as err:
        raise corrupt_weights(weights, err) from err
    ids = state.get("vocab_ids")
    if ids is None or ids.dim() != 1 or ids.is_floating_point():
        raise SpecstopError(f"{weights}: no 1-D integer tensor 'vocab_ids' (the head's tokens)")
    return state


def prune_head(model: nn.Module, vocab_ids: torch.Tensor) -> nn.Module:
    """Replace a loaded compact draft's full output layer by its `vocab_ids` rows."""
    weight = model.get_output_embeddings().weight.detach()
    head = nn.Linear(weight.shape[1], vocab_ids.shape[0], bias=False, device=weight.device,
                     dtype=weight.dtype)
    head.weight.data.copy_(weight[vocab_ids.to(weight.device)])
    model.config.tie_word_embeddings = False
    model.lm_head = head
    return model
