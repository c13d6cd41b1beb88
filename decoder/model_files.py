"""Where a model's files are and whether they are usable, checked before transformers reads
them so that a bad folder is one line naming the file at fault: a local folder file by file
(config, tokenizer, weights and shards, safetensors headers), a hub id only where the hub or
its local cache can serve it (no network: one line within seconds, not minutes of retries)."""

from __future__ import annotations

import json
import os
import pickle
import socket
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlsplit

from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import HFValidationError, StrictDataclassError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig

from specstop.common.errors import SpecstopError, first_line

CONFIG = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt")
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLED, PICKLED_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json", ".onnx")
# what transformers raises on a bad model folder or weights file
LOAD_ERRORS = (OSError, ValueError, RuntimeError, SafetensorError, StrictDataclassError,
               pickle.UnpicklingError)
HUB_PROBE_SECONDS = 2.0


def corrupt_weights(path: Path, err: BaseException) -> SpecstopError:
    """The error of a weights file that cannot be decoded."""
    return SpecstopError(f"{path}: corrupt or truncated weights ({first_line(err)})")


def looks_like_path(source: str) -> bool:
    """A name no hub id can be: rooted, relative with dots or ~, nested, or a file name."""
    return (source.startswith((".", "~", os.sep)) or source.count("/") > 1
            or (os.sep != "/" and os.sep in source) or source.endswith(FILE_SUFFIXES))


def _offline_reason() -> str | None:
    """Why the hub cannot be asked (HF_HUB_OFFLINE, or no connection), None when it can."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE"):
            return f"{name} is set"
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    address = (endpoint.hostname or "huggingface.co",
               endpoint.port or (80 if endpoint.scheme == "http" else 443))
    return None if _reachable(address) else f"no connection to {address[0]}:{address[1]}"


@lru_cache(maxsize=None)
def _reachable(address: tuple[str, int]) -> bool:
    """Whether a TCP connection to `address` opens within HUB_PROBE_SECONDS (once a process)."""
    try:
        socket.create_connection(address, timeout=HUB_PROBE_SECONDS).close()
    except OSError:
        return False
    return True


def hub_kwargs(repo_id: str) -> dict:
    """from_pretrained kwargs for a hub id: none while the hub is reachable, the local cache only
    where it is not; a SpecstopError where it is neither reachable nor cached."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise SpecstopError(f"model folder not found: {repo_id}") from None
    offline = _offline_reason()
    if offline is None:
        return {}
    if isinstance(try_to_load_from_cache(repo_id, CONFIG), str):
        return {"local_files_only": True}
    raise SpecstopError(f"'{repo_id}' is neither a local folder nor a cached hub model, and the "
                        f"hub is not reachable ({offline})")


def check_tokenizer_files(folder: Path) -> None:
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise SpecstopError(f"{folder}: no tokenizer ({' or '.join(TOKENIZER_FILES[:2])})")


def check_model_folder(folder: Path) -> None:
    """Refuse a local folder transformers cannot load a model from, naming the file at fault:
    no config.json, no tokenizer, no weights, a missing shard or a corrupt safetensors file."""
    config = folder / CONFIG
    if not config.is_file():
        raise SpecstopError(f"{folder}: not a model folder (no {CONFIG})")
    try:
        AutoConfig.from_pretrained(folder)
    except LOAD_ERRORS as err:
        raise SpecstopError(f"{config}: not a usable model config ({first_line(err)})") from err
    check_tokenizer_files(folder)
    for weights in _weight_files(folder):
        if weights.suffix == ".safetensors":
            _check_safetensors(weights)


def _check_safetensors(path: Path) -> None:
    """Refuse a safetensors file whose header does not decode or cover the file exactly."""
    try:
        with safe_open(str(path), "pt"):
            pass
    except (SafetensorError, OSError) as err:
        raise corrupt_weights(path, err) from err


def _weight_files(folder: Path) -> list[Path]:
    """The weight files transformers reads from `folder` (the shards an index names)."""
    for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (PICKLED, PICKLED_INDEX)):
        if (folder / single).is_file():
            return [folder / single]
        if (folder / index).is_file():
            weight_map = read_json_object(folder / index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise SpecstopError(f"{folder / index}: no 'weight_map' of tensors to files")
            shards = [folder / name for name in sorted(set(map(str, weight_map.values())))]
            for shard in shards:
                if not shard.is_file():
                    raise SpecstopError(f"{shard}: weights file missing (named in {index})")
            return shards
    raise SpecstopError(f"{folder}: no weights ({SAFETENSORS} or {PICKLED})")


def read_json_object(path: Path) -> dict:
    """A JSON file holding an object; a SpecstopError names the file otherwise."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise SpecstopError(f"{path}: not valid JSON ({first_line(err)})") from err
    if not isinstance(value, dict):
        raise SpecstopError(f"{path}: not a JSON object")
    return value
