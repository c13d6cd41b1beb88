"""Draft folders: what `specstop draft` writes, and reading them back.

A compact draft is saved as a normal transformers folder (full-vocabulary head, the pruned rows
trained) plus `specstop_draft.json` naming the pruned vocabulary, so it loads like any user's
draft; a feature-conditioned head as its config, `head.safetensors` (the target's embeddings
left out) and the same metadata file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from specstop.common.errors import SpecstopError, first_line
from specstop.common.files import write_atomic, write_json
from specstop.decoder.model_files import LOAD_ERRORS, corrupt_weights, read_json_object

from .families import FAMILIES, LAST_LAYER, FeatureHead

DRAFT_META_FILE = "specstop_draft.json"
HEAD_WEIGHTS = "head.safetensors"


def _positive_int(value: object) -> bool:
    return type(value) is int and value > 0


def _layer_indices(value: object) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(type(i) is int for i in value)


def _prompt_ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(i, str) for i in value)


def _token_ids(value: object) -> bool:
    return value is None or (isinstance(value, list) and len(value) > 0
                             and all(type(i) is int and i >= 0 for i in value))


# the metadata keys `save_draft` writes that loaders read: what each must be, and its test
META_KEYS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "target_vocab_size": ("a positive integer", _positive_int),
    "target_hidden_size": ("a positive integer", _positive_int),
    "vocab_ids": ("null or a non-empty list of token ids", _token_ids),
    "target_layers": ("a non-empty list of hidden-state indices", _layer_indices),
    "trained_on_prompts": ("a list of prompt ids", _prompt_ids),
}
REQUIRED_META = {"compact": ("vocab_ids",), "feature": ("target_vocab_size", "target_hidden_size")}
OPTIONAL_META = ("target_layers",  # a feature head's fused layers (absent: the last layer)
                 "trained_on_prompts")  # the ids of the prompts its corpus answered


@dataclass
class LoadedDraft:
    model: nn.Module
    family: str
    vocab_ids: torch.Tensor | None  # None = the full vocabulary


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
    layers = {"target_layers": list(draft.target_layers)} if family == "feature" else {}
    meta = {"family": family, "target_vocab_size": vocab, **layers,
            "target_hidden_size": target.config.hidden_size,
            "vocab_ids": None if vocab_ids is None else vocab_ids.tolist(), **info}
    write_json(folder / DRAFT_META_FILE, meta)


def _compact_with_full_head(draft: nn.Module, target: nn.Module,
                            vocab_ids: torch.Tensor | None) -> nn.Module:
    """A plain transformers copy of a compact draft: the full-vocabulary head, trained rows in."""
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
    path = Path(folder) / DRAFT_META_FILE
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
    for key in [*required, *(k for k in OPTIONAL_META if k in meta)]:
        what, valid = META_KEYS[key]
        if not valid(meta[key]):
            raise SpecstopError(f"{path}: key '{key}' must be {what}")
    return meta


def check_held_out(draft: str, prompt_ids: list[str], what: str) -> None:
    """Refuse prompts a specstop-built draft was distilled on (`trained_on_prompts` in its
    metadata): it has learned their responses, so rounds on them do not show the acceptance
    decoding meets.  `what` names the prompts (stage and split) in the one-line error."""
    meta = read_meta(Path(draft)) if Path(draft).is_dir() else None
    trained = set(meta.get("trained_on_prompts", ())) if meta else set()
    shared = [pid for pid in prompt_ids if pid in trained]
    if shared:
        raise SpecstopError(f"{what}: {len(shared)} of {len(prompt_ids)} prompts (e.g. "
                            f"{shared[0]}) are among those the draft {draft} was distilled on "
                            f"({Path(draft) / DRAFT_META_FILE}); give them another split "
                            f"(prompts.fractions) or re-run stage draft")


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
    layers, n = tuple(meta.get("target_layers", LAST_LAYER)), target.config.num_hidden_layers
    if any(not -n - 1 <= i <= n for i in layers):
        raise SpecstopError(f"{folder / DRAFT_META_FILE}: target_layers {list(layers)} are not "
                            f"hidden states of a {n}-layer target")
    head = FeatureHead(config, target.get_input_embeddings(), state["vocab_ids"], layers)
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
