"""transformers' own speculative decoding as bench methods, the peers a user would otherwise pick:
assisted generation (`generate(assistant_model=...)`) with the same draft, and therefore the
same draft distribution, that specstop's `sd` runs beside it (`drafts.loading.plain_assistant`),
in transformers' default dynamic setting and a static one; and prompt-lookup decoding (n-grams
of the prompt as the draft, no draft model).

Target calls, the tokens each one verifies and draft steps are counted with forward hooks;
transformers does not report acceptance, so accepted tokens are new tokens minus target calls
(each call commits the target's own token after the accepted ones) and drafted tokens are the
tokens the target verified beyond the one it extends.
"""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig

from specstop.decoder.loop import DecodeConfig, DecodeStats, Generation
from specstop.decoder.runtime import Runtime
from specstop.evaluation.side_by_side import Method

SPECULATION_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule",
                    "assistant_confidence_threshold")
PROMPT_LOOKUP_NGRAM = 2  # transformers' default max_matching_ngram_size


def static_settings(gamma: int) -> dict:
    """γ draft tokens every round, no confidence stop: the schedule specstop's `sd` runs."""
    return {"num_assistant_tokens": gamma, "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0}


def dynamic_settings(assistant: torch.nn.Module) -> dict:
    """transformers' defaults where the assistant's config is silent: up to 20 tokens, stop
    below a confidence threshold it re-fits after every round."""
    defaults = GenerationConfig._get_default_generation_params()
    config = assistant.generation_config
    return {k: getattr(config, k) if getattr(config, k, None) is not None else defaults[k]
            for k in SPECULATION_KEYS}


def assisted_method(runtime: Runtime, assistant: torch.nn.Module, config: DecodeConfig,
                    settings: dict, name: str) -> Method:
    """Assisted generation with the speculation `settings` (every SPECULATION_KEYS entry),
    applied afresh on every call, and the sampling and token budget of `config`."""
    base = assistant.generation_config.to_dict()

    def decode(prompt: torch.Tensor, seed: int) -> Generation:
        assistant.generation_config = GenerationConfig.from_dict({**base, **settings})
        return _generate(runtime, prompt, seed, config, {"assistant_model": assistant}, assistant)

    return Method(name, decode)


def prompt_lookup_method(runtime: Runtime, config: DecodeConfig, tokens: int,
                         name: str = "hf-prompt-lookup") -> Method:
    """Prompt-lookup decoding: up to `tokens` draft tokens copied from an n-gram match."""
    options = {"prompt_lookup_num_tokens": tokens, "max_matching_ngram_size": PROMPT_LOOKUP_NGRAM}
    return Method(name, lambda prompt, seed: _generate(runtime, prompt, seed, config, options))


def _generate(runtime: Runtime, prompt: torch.Tensor, seed: int, config: DecodeConfig,
              options: dict, assistant: torch.nn.Module | None = None) -> Generation:
    target = runtime.target.model
    eos = runtime.eos_id
    sampling = config.sampling
    mode = {"do_sample": False} if sampling.greedy else {
        "do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "top_k": 0}
    ids = prompt[None].to(runtime.target.device)
    torch.manual_seed(seed)
    with _Counter(target) as calls, _Counter(assistant) as draft_steps, torch.inference_mode():
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=config.max_new_tokens, eos_token_id=eos,
                              pad_token_id=eos, **mode, **options)
        seconds = time.perf_counter() - start
    tokens = out[0, ids.shape[1]:].tolist()
    drafted = max(calls.tokens - (ids.shape[1] - 1) - calls.n, 0)
    return Generation(tokens, DecodeStats(
        new_tokens=len(tokens), target_calls=calls.n, draft_steps=draft_steps.n,
        drafted_levels=drafted, drafted_tokens=drafted,
        accepted=min(max(len(tokens) - calls.n, 0), drafted), seconds=seconds))


class _Counter:
    """Counts a module's forward calls and the tokens they were given while the `with` block
    runs (nothing for None)."""

    def __init__(self, module: torch.nn.Module | None) -> None:
        self.module = module
        self.n = self.tokens = 0

    def __enter__(self) -> "_Counter":
        if self.module is not None:
            self.handle = self.module.register_forward_hook(self._count, with_kwargs=True)
        return self

    def _count(self, _module: object, args: tuple, kwargs: dict, _output: object) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.n += 1
        self.tokens += 0 if ids is None else ids.shape[-1]

    def __exit__(self, *exc: object) -> None:
        if self.module is not None:
            self.handle.remove()
