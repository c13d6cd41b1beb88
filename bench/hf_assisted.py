"""transformers' assisted generation (`generate(assistant_model=...)`) as a bench method: the
peer a user would otherwise pick, with its default dynamic speculation (up to
`num_assistant_tokens` per round, stop when the draft's probability falls below a threshold
re-fitted after every round).

It runs on the runtime's own target module and a standalone draft LM with the same tokenizer.
Target calls and draft steps are counted with forward hooks; transformers does not report
acceptance, so accepted tokens are taken as new tokens minus target calls (each call commits
the target's own token after the accepted ones), and drafted tokens as draft forwards.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import GenerationConfig

from specstop.common.paths import TRUNCATED_PREFIX
from specstop.decoder.load import check_same_tokenizer, load_model
from specstop.decoder.loop import DecodeConfig, DecodeStats, Generation
from specstop.decoder.runtime import Runtime
from specstop.drafts.families import truncated_draft
from specstop.drafts.store import read_meta
from specstop.evaluation.side_by_side import Method

SPECULATION_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule",
                    "assistant_confidence_threshold")


def load_assistant(runtime: Runtime, preferred: str | None, fallback: str,
                   cache_dir: Path) -> tuple[torch.nn.Module | None, str]:
    """(draft LM for transformers, what it is): `preferred` where it is a finished model folder,
    else the default draft (`fallback`) where it is a plain LM; None and the reason else."""
    finished = preferred is not None and (Path(preferred) / "config.json").is_file()
    source = preferred if finished else fallback
    if source.startswith(TRUNCATED_PREFIX):
        layers = int(source.removeprefix(TRUNCATED_PREFIX))
        return truncated_draft(runtime.target.model, layers), source
    meta = read_meta(Path(source)) if Path(source).is_dir() else None
    if meta is not None and meta["family"] == "feature":
        why = ("bench.assistant_draft is not set" if preferred is None
               else f"'{preferred}' is not a finished model folder")
        return None, (f"'{source}' is a feature-conditioned head, which transformers cannot use "
                      f"as an assistant, and {why}")
    loaded = load_model(source, runtime.target.dtype, runtime.target.device, cache_dir)
    check_same_tokenizer(runtime.tokenizer, loaded.tokenizer, "target", source)
    return loaded.model, source


def speculation_settings(assistant: torch.nn.Module) -> dict:
    """The assistant's dynamic-speculation settings in effect (its config, else the defaults)."""
    defaults = GenerationConfig._get_default_generation_params()
    config = assistant.generation_config
    return {k: getattr(config, k, None) if getattr(config, k, None) is not None else defaults[k]
            for k in SPECULATION_KEYS}


def hf_method(runtime: Runtime, assistant: torch.nn.Module, config: DecodeConfig,
              name: str = "hf-assisted") -> Method:
    """Assisted generation with the sampling and token budget of `config`."""
    target = runtime.target.model
    eos = runtime.eos_id
    sampling = config.sampling
    options = {"do_sample": False} if sampling.greedy else {
        "do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "top_k": 0}

    def decode(prompt: torch.Tensor, seed: int) -> Generation:
        ids = prompt[None].to(runtime.target.device)
        torch.manual_seed(seed)
        with _Counter(target) as target_calls, _Counter(assistant) as draft_steps, \
                torch.inference_mode():
            start = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids),
                                  assistant_model=assistant, max_new_tokens=config.max_new_tokens,
                                  eos_token_id=eos, pad_token_id=eos, **options)
            seconds = time.perf_counter() - start
        tokens = out[0, ids.shape[1]:].tolist()
        return Generation(tokens, _stats(len(tokens), target_calls.n, draft_steps.n, seconds))

    return Method(name, decode, warm_up=True)


def _stats(new_tokens: int, target_calls: int, draft_steps: int, seconds: float) -> DecodeStats:
    return DecodeStats(new_tokens=new_tokens, target_calls=target_calls, draft_steps=draft_steps,
                       drafted_levels=draft_steps, drafted_tokens=draft_steps,
                       accepted=min(max(new_tokens - target_calls, 0), draft_steps),
                       seconds=seconds)


class _Counter:
    """Counts a module's forward calls while the `with` block runs."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.n = 0

    def __enter__(self) -> "_Counter":
        self.handle = self.module.register_forward_hook(self._count)
        return self

    def _count(self, *_: object) -> None:
        self.n += 1

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()
