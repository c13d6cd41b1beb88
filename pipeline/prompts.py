"""Stage `prompts`: the prompt sets, rendered through the target's chat template
(`specstop.prompts.build`); the target itself is loaded only to write a magpie source's requests
(`specstop.prompts.self_written`), and only where its cache does not hold them."""

from __future__ import annotations

from functools import cache

import torch

from specstop.common.params import ModelsConfig, Params
from specstop.decoder.load import (LoadedModel, chat_text, end_of_turn_ids, load_model,
                                   load_tokenizer, resolve_device, resolve_dtype,
                                   user_turn_prefix)
from specstop.prompts.build import build_prompts
from specstop.prompts.self_written import Sample, Writer
from specstop.prompts.sources import Sampling


READERS = {"draft": "stage draft", "val": "stage draft",  # each split's first reader (then
           "test": "stage bench"}  # collect reads those of `collect.splits`)


def readers(params: Params) -> dict[str, str]:
    """Split -> the first stage that reads it (the splits that must not be empty)."""
    return {**READERS, **{split: "stage collect" for split in params.collect.splits
                          if split not in READERS}}


def run(params: Params) -> dict:
    tokenizer = load_tokenizer(params.models.target, params.models.target_cache)
    return build_prompts(params.prompts, lambda request: chat_text(tokenizer, request),
                         target_writer(params.models), readers(params))


def target_writer(models: ModelsConfig) -> Writer:
    """The target as the writer of self-written requests, loaded on first use."""
    device = resolve_device(models.device)
    dtype = resolve_dtype(models.dtype, device)
    load = cache(lambda: load_model(models.target, dtype, device, models.target_cache))
    identity = {"model": models.target, "dtype": str(dtype).removeprefix("torch."),
                "device": device.type}
    return Writer(identity, lambda sampling: user_turn_sampler(load(), sampling))


def user_turn_sampler(loaded: LoadedModel, sampling: Sampling) -> tuple[Sample, tuple[str, ...]]:
    """(sample, end markers): `sample(n, seed)` continues the chat template's user-turn prefix
    n times in one seeded batch; each decoded sample keeps its special tokens, so one that
    ended shows an end marker (the template's end-of-turn token or the eos)."""
    model, tokenizer = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    prefix = tokenizer(user_turn_prefix(tokenizer), add_special_tokens=False,
                       return_tensors="pt")["input_ids"].to(device)
    stops = end_of_turn_ids(tokenizer)

    def sample(n: int, seed: int) -> list[str]:
        torch.manual_seed(seed)
        ids = prefix.expand(n, -1)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=sampling.temperature, top_p=sampling.top_p, top_k=0,
                                 max_new_tokens=sampling.max_new_tokens, eos_token_id=stops,
                                 pad_token_id=stops[0])
        return tokenizer.batch_decode(out[:, prefix.shape[1]:], skip_special_tokens=False)

    return sample, tuple(tokenizer.decode([i]) for i in stops)
