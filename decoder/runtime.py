"""Assemble a ready-to-decode runtime from names: models, tokenizer checks, drafter, costs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from specstop.common.errors import SpecstopError

from .costs import VerifyCosts
from .draft_models import META_FILE, load_feature_head, prune_head, read_meta
from .drafter import Drafter, FeatureDrafter, ModelDrafter
from .kv import KVModel
from .loop import DecodeConfig, Generation, generate
from .models import (DEFAULT_CACHE, LoadedModel, chat_text, check_same_tokenizer, load_model,
                     resolve_device, resolve_dtype, truncated_draft)
from .policy import StoppingPolicy
from .sampling import Sampling

TRUNCATED_PREFIX = "layers:"


@dataclass
class Runtime:
    target: KVModel
    drafter: Drafter | None
    tokenizer: PreTrainedTokenizerBase
    costs: VerifyCosts | None
    context_limit: int

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def encode(self, prompt: str, chat: bool = True, special_tokens: bool = True) -> torch.Tensor:
        """Prompt text -> ids [L], through the chat template when the tokenizer has one.

        `special_tokens=False` for text already rendered through the chat template."""
        check_utf8(prompt)
        if not prompt.strip():
            raise SpecstopError("the prompt is empty")
        if chat and self.tokenizer.chat_template:
            ids = self.tokenizer(chat_text(self.tokenizer, prompt),
                                 add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(prompt, add_special_tokens=special_tokens)["input_ids"]
        return torch.tensor(list(ids), dtype=torch.long)

    def check_fits(self, prompt: torch.Tensor, config: DecodeConfig) -> None:
        need = prompt.shape[0] + config.max_new_tokens + config.max_depth + 1
        if need > self.context_limit:
            raise SpecstopError(
                f"prompt of {prompt.shape[0]} tokens + max_new_tokens {config.max_new_tokens} "
                f"+ max_depth {config.max_depth} + 1 = {need} tokens exceeds the model's context "
                f"of {self.context_limit} tokens")

    def generate(self, prompt: torch.Tensor, config: DecodeConfig,
                 policy: StoppingPolicy | None = None, seed: int = 0, **kwargs) -> Generation:
        self.check_fits(prompt, config)
        if config.method != "ar" and self.drafter is None:
            raise SpecstopError(f"method '{config.method}' needs a draft model")
        generator = torch.Generator(device=self.target.device).manual_seed(seed)
        return generate(self.target, self.drafter if config.method != "ar" else None, prompt,
                        config, policy, self.eos_id, generator=generator, costs=self.costs,
                        **kwargs)


def load_runtime(target: str, draft: str | None, dtype: str = "auto", device: str = "auto",
                 cache_dir: Path = DEFAULT_CACHE, costs: Path | None = None) -> Runtime:
    """Load the target, the draft (`layers:N` truncates the target) and an optional cost table."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    loaded = load_model(target, dt, dev, cache_dir)
    vocab = loaded.model.config.vocab_size
    drafter = None
    if draft:
        if draft.startswith(TRUNCATED_PREFIX):
            try:
                layers = int(draft.removeprefix(TRUNCATED_PREFIX))
            except ValueError:
                raise SpecstopError(f"bad draft '{draft}': expected layers:N")
            draft_model = truncated_draft(loaded.model, layers)
            drafter = ModelDrafter(KVModel(draft_model, vocab_size=vocab))
        else:
            drafter = _load_drafter(draft, loaded, dt, dev, cache_dir)
    table = None
    if costs is not None and Path(costs).is_file():
        table = VerifyCosts.load(costs)
        if (table.model, table.dtype, table.device) != (target, str(dt).removeprefix("torch."),
                                                        dev.type):
            table = None  # measured for another model, dtype or device: not applicable
    limit = getattr(loaded.model.config, "max_position_embeddings", None) or 1 << 30
    return Runtime(KVModel(loaded.model), drafter, loaded.tokenizer, table, limit)


def _load_drafter(draft: str, target: LoadedModel, dtype: torch.dtype, device: torch.device,
                  cache_dir: Path) -> Drafter:
    """A draft folder built by `specstop draft` (either family), or any LM with the same tokenizer."""
    vocab = target.model.config.vocab_size
    meta = read_meta(Path(draft)) if Path(draft).is_dir() else None
    if meta is not None and meta["family"] == "feature":
        head = load_feature_head(Path(draft), target.model, meta)
        return FeatureDrafter(KVModel(head.model, vocab_size=vocab, vocab_ids=head.vocab_ids))
    other = load_model(draft, dtype, device, cache_dir)
    check_same_tokenizer(target.tokenizer, other.tokenizer, target.source, draft)
    ids = None if meta is None or meta["vocab_ids"] is None else torch.tensor(meta["vocab_ids"])
    rows = other.model.config.vocab_size
    if ids is not None and int(ids.max()) >= rows:
        raise SpecstopError(f"{Path(draft) / META_FILE}: vocab_ids name token {int(ids.max())}, "
                            f"beyond the draft's vocabulary of {rows}")
    model = other.model if ids is None else prune_head(other.model, ids)
    return ModelDrafter(KVModel(model, vocab_size=vocab, vocab_ids=ids))


def check_utf8(text: str) -> None:
    """Refuse text that is not valid UTF-8: argv bytes that are not arrive as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        where = len(text[:err.start].encode("utf-8", "surrogateescape"))
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise SpecstopError(f"the prompt is not valid UTF-8 ({what} at position {where})") \
            from None


def sampling_from(temperature: float, top_p: float) -> Sampling:
    try:
        return Sampling(temperature, top_p)
    except ValueError as err:
        raise SpecstopError(str(err)) from err
