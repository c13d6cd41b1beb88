"""A ready-to-decode runtime: the target, an optional drafter, the tokenizer and the cost table.

Building one from names (a hub id, a draft folder, `layers:N`) is `specstop.drafts.loading`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from specstop.common.errors import SpecstopError
from specstop.common.params import TreeConfig

from .costs import CostCurve
from .drafter import Drafter
from .kv import KVModel
from .load import chat_text, with_bos
from .loop import DecodeConfig, Generation, generate
from .methods import round_method
from .policy import StoppingPolicy, TreePolicy
from .sampling import Sampling


@dataclass
class Runtime:
    target: KVModel
    drafter: Drafter | None
    tokenizer: PreTrainedTokenizerBase
    costs: CostCurve | None  # the target's verify-cost curve, what `score` pads with
    context_limit: int  # the longest sequence both models take
    limited_by: str  # the model that sets it: 'target' or 'draft'

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def draft(self) -> KVModel | None:
        """The draft model and its cache that the drafter runs (None: no drafter)."""
        return None if self.drafter is None else self.drafter.lm

    def encode(self, prompt: str, chat: bool = True, special_tokens: bool = True) -> torch.Tensor:
        """Prompt text -> ids [L], through the chat template when `chat` and the tokenizer has
        one, else after the tokenizer's BOS (`with_bos`).

        `chat=False, special_tokens=False` for text already rendered (stage `prompts`' text):
        tokenized as it is."""
        check_utf8(prompt)
        if not prompt.strip():
            raise SpecstopError("the prompt is empty")
        if chat:
            text = chat_text(self.tokenizer, prompt)
        else:
            text = with_bos(self.tokenizer, prompt) if special_tokens else prompt
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(list(ids), dtype=torch.long)

    def check_fits(self, prompt: torch.Tensor, config: DecodeConfig) -> None:
        need = prompt.shape[0] + config.max_new_tokens + config.max_depth + 1
        if need > self.context_limit:
            raise SpecstopError(
                f"prompt of {prompt.shape[0]} tokens + max_new_tokens {config.max_new_tokens} "
                f"+ max_depth {config.max_depth} + 1 = {need} tokens exceeds the model's context "
                f"of {self.context_limit} tokens (the {self.limited_by}'s "
                f"max_position_embeddings)")

    def generate(self, prompt: torch.Tensor, config: DecodeConfig,
                 policy: StoppingPolicy | TreePolicy | None = None, seed: int = 0,
                 **kwargs) -> Generation:
        self.check_fits(prompt, config)
        drafts = round_method(config.method).drafts
        if drafts and self.drafter is None:
            raise SpecstopError(f"method '{config.method}' needs a draft model")
        generator = torch.Generator(device=self.target.device).manual_seed(seed)
        return generate(self.target, self.drafter if drafts else None, prompt,
                        config, policy, self.eos_id, generator=generator, costs=self.costs,
                        **kwargs)


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


def decode_config(tree: TreeConfig, method: str, lookup_branch: bool = False) -> DecodeConfig:
    """The runtime's decode config for `method` with the tree and sampling options of `tree`
    (and `tree` rounds' lookup branch)."""
    try:
        return DecodeConfig(
            method=method, max_new_tokens=tree.max_new_tokens,
            sampling=sampling_from(tree.temperature, tree.top_p), max_depth=tree.max_depth,
            mcsd_branching=tuple(tree.mcsd_branching), ti_width=tree.ti_width,
            lossy=tree.lossy, without_replacement=tree.without_replacement,
            lookup_branch=lookup_branch)
    except ValueError as err:
        raise SpecstopError(str(err)) from err
