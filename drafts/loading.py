"""The runtime's loading layer: `load_runtime` builds a Runtime from names, the target (hub id,
folder, GGUF, `embedded`: `decoder.load.load_model`, the one entry point for a model), the draft
(a folder `specstop draft` built, any LM with the same tokenizer, or `layers:N`) and a cost
table; `runtime_from` is the same from params.yaml's sections.  `with_draft` swaps in another
plain draft (bench's peers); `plain_assistant` is that draft as transformers' assistant."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from specstop.common.errors import SpecstopError
from specstop.common.files import require
from specstop.common.params import CostsConfig, ModelsConfig
from specstop.common.paths import TARGET_CACHE, TRUNCATED_PREFIX
from specstop.decoder.costs import VerifyCosts
from specstop.decoder.drafter import FeatureDrafter, ModelDrafter
from specstop.decoder.kernels import kernel_of, pack_linears
from specstop.decoder.kv import KVModel, captures
from specstop.decoder.load import (LoadedModel, check_same_tokenizer, load_model, resolve_device,
                                   resolve_dtype)
from specstop.decoder.runtime import Runtime

from .families import mask_vocabulary, prune_head, truncated_draft
from .store import DRAFT_META_FILE, load_feature_head, read_meta

LoadedDrafter = ModelDrafter | FeatureDrafter  # what the loaders build


def load_runtime(target: str, draft: str | None, dtype: str = "auto", device: str = "auto",
                 cache_dir: Path = TARGET_CACHE, costs: Path | None = None,
                 cpu_kernel: str = "onednn", compile: str = "auto") -> Runtime:
    """Load the target, the draft (`layers:N` truncates the target) and an optional cost table;
    on a CPU both models' linear layers run on `cpu_kernel` (`decoder.kernels`); both models'
    forwards are captured (`KVModel.capture`) with `compile` on, or on CUDA with `auto`."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    captured = captures(compile, dev, cpu_kernel)
    loaded = load_model(target, dt, dev, cache_dir)
    vocab = loaded.model.config.vocab_size
    drafter = None
    if draft:
        if draft.startswith(TRUNCATED_PREFIX):
            drafter = _model_drafter(truncated_draft(loaded.model, _layers(draft)), None, vocab)
        else:
            drafter = _load_drafter(draft, loaded, dt, dev, cache_dir)
        pack_linears(drafter.lm.model, cpu_kernel)
    pack_linears(loaded.model, cpu_kernel)
    target_lm = KVModel(loaded.model)
    if captured:
        for lm in [target_lm] + ([drafter.lm] if drafter else []):
            lm.capture()
    table = None
    if costs is not None and Path(costs).is_file():
        table = VerifyCosts.load(costs)
        if (table.model, table.dtype, table.device, table.kernel) != \
                (target, str(dt).removeprefix("torch."), dev.type, target_lm.kernel):
            table = None  # measured for another model, dtype, device or kernel: not applicable
    limit, limited_by = _context_limit(loaded.model, drafter)
    curve = None if table is None else table.curve
    return Runtime(target_lm, drafter, loaded.tokenizer, curve, limit, limited_by)


def _context_limit(target: torch.nn.Module, drafter: LoadedDrafter | None) -> tuple[int, str]:
    """The longest sequence both models take, and which sets it ('target' or 'draft'): the
    smaller `max_position_embeddings` of the target's and the draft's config (a `layers:N`
    draft has the target's, a feature head its own; none given: unlimited)."""
    limits = {"target": _positions(target)}
    if drafter is not None:
        limits["draft"] = _positions(drafter.lm.model)
    limited_by = min(limits, key=limits.__getitem__)  # a tie: the target
    return limits[limited_by], limited_by


def _positions(model: torch.nn.Module) -> int:
    """A model's `max_position_embeddings` (unset: unlimited)."""
    return getattr(model.config, "max_position_embeddings", None) or 1 << 30


def _layers(draft: str) -> int:
    """N of a `layers:N` draft."""
    try:
        return int(draft.removeprefix(TRUNCATED_PREFIX))
    except ValueError:
        raise SpecstopError(f"bad draft '{draft}': expected layers:N") from None


def _load_drafter(draft: str, target: LoadedModel, dtype: torch.dtype, device: torch.device,
                  cache_dir: Path) -> LoadedDrafter:
    """A draft folder built by `specstop draft` (either family), or any LM with the same
    tokenizer."""
    vocab = target.model.config.vocab_size
    meta = read_meta(Path(draft)) if Path(draft).is_dir() else None
    if meta is not None and meta["family"] == "feature":
        head = load_feature_head(Path(draft), target.model, meta)
        return FeatureDrafter(KVModel(head.model, vocab_size=vocab, vocab_ids=head.vocab_ids))
    model, ids = _load_plain(draft, target.tokenizer, vocab, target.source, dtype, device,
                             cache_dir)
    return _model_drafter(model, ids, vocab)


def _model_drafter(model: torch.nn.Module, ids: torch.Tensor | None,
                   vocab: int) -> ModelDrafter:
    """A plain causal LM as specstop's drafter, its head pruned to `ids` (None: all rows)."""
    return ModelDrafter(KVModel(model if ids is None else prune_head(model, ids),
                                vocab_size=vocab, vocab_ids=ids))


def _load_plain(draft: str, tokenizer, vocab: int, target_name: str, dtype: torch.dtype,
                device: torch.device, cache_dir: Path) -> tuple[torch.nn.Module,
                                                                torch.Tensor | None]:
    """A plain causal-LM draft with the target's tokenizer and at least its `vocab` rows, and
    its pruned vocabulary (None: the full one) from the folder's draft metadata."""
    meta = read_meta(Path(draft)) if Path(draft).is_dir() else None
    other = load_model(draft, dtype, device, cache_dir)
    check_same_tokenizer(tokenizer, other.tokenizer, target_name, draft)
    ids = None if meta is None or meta["vocab_ids"] is None else torch.tensor(meta["vocab_ids"])
    rows = other.model.config.vocab_size
    if rows < vocab:
        raise SpecstopError(f"draft '{draft}': a vocabulary of {rows} tokens, smaller than the "
                            f"target's {vocab} (config.json vocab_size); the draft must read "
                            f"every token the target writes")
    if ids is not None and int(ids.max()) >= rows:
        raise SpecstopError(f"{Path(draft) / DRAFT_META_FILE}: vocab_ids name token "
                            f"{int(ids.max())}, beyond the draft's vocabulary of {rows}")
    return other.model, ids


def with_draft(draft: str, runtime: Runtime, cache_dir: Path) -> Runtime:
    """`runtime` with a plain draft (a model, a folder or `layers:N`) as its drafter instead,
    its pruned head, run as the target is (kernel, capture), the context limit recomputed."""
    target = runtime.target
    vocab = target.model.config.vocab_size
    if draft.startswith(TRUNCATED_PREFIX):
        model, ids = truncated_draft(target.model, _layers(draft)), None
    else:
        model, ids = _load_plain(draft, runtime.tokenizer, vocab, "target", target.dtype,
                                 target.device, cache_dir)
    drafter = _model_drafter(model, ids, vocab)
    pack_linears(drafter.lm.model, kernel_of(target.model))  # the target's kernel
    if target.captured is not None:  # and captured as the target is
        drafter.lm.capture()
    limit, limited_by = _context_limit(target.model, drafter)
    return dataclasses.replace(runtime, drafter=drafter, context_limit=limit,
                               limited_by=limited_by)


def plain_assistant(draft: str, runtime: Runtime, cache_dir: Path) -> torch.nn.Module:
    """The same plain draft as a causal LM for transformers, with the same distribution as
    `with_draft`'s drafter: full-vocabulary logits, -inf outside its pruned vocabulary."""
    target = runtime.target
    if draft.startswith(TRUNCATED_PREFIX):
        model = truncated_draft(target.model, _layers(draft))
    else:
        model, ids = _load_plain(draft, runtime.tokenizer, target.model.config.vocab_size,
                                 "target", target.dtype, target.device, cache_dir)
        model = model if ids is None else mask_vocabulary(model, ids)
    return pack_linears(model, kernel_of(target.model))  # the target's kernel


def is_plain_draft(draft: str) -> bool:
    """A draft transformers can drive: any causal LM or `layers:N`, not a feature head."""
    meta = read_meta(Path(draft)) if Path(draft).is_dir() else None
    return meta is None or meta["family"] != "feature"


def runtime_from(models: ModelsConfig, costs: CostsConfig, need_draft: bool) -> Runtime:
    """The runtime params.yaml's `models` and `costs` name (the draft only where needed)."""
    return load_runtime(target=models.target, draft=models.draft if need_draft else None,
                        dtype=models.dtype, device=models.device, cache_dir=models.target_cache,
                        costs=costs.path, cpu_kernel=models.cpu_kernel, compile=models.compile)


def require_draft(draft: str) -> None:
    """A draft folder named in `models.draft` must exist (stage `draft` writes the default);
    `layers:N` is built from the target."""
    if not draft.startswith(TRUNCATED_PREFIX):
        require(Path(draft), "draft")
