"""What a drafted round spends outside the models' passes, which the cost curves do not hold.

The cost model (`costs.py`) prices a round as its target pass, its draft steps and its
decisions, each timed alone.  A drafted round also draws, picks its trees and masks, verifies
and commits on the host: on a 2-core CPU a few ms a round beyond what an `ar` round spends,
against a 50 ms target step (README, Collect).
`round_overhead` measures it for both kinds of drafted round: the same prompts decoded by `ar`,
by `tree` (EAGLE-2's confidence tree) and by a static tree (`mcsd` drafting a fixed shape), every
pass of either model timed where the curves time one (`KVModel.extend` and
`extend_with_hidden`), the decisions by the loop; a round's remaining seconds, less an `ar`
round's, in `ar` steps.  A static round spends less than a `tree` round (no per-level
selection, no fed and verified trees to gather), so the replay charges each its own.  Each
level drafted costs host work too (a sampled level about 1-1.5 ms: warp, draws, features), so
each kind is timed at one level and deeper, and a round is charged a base plus a term per
level it drafts (`costs.RoundWork`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from .costs import CostCurve, RoundWork
from .kv import KVModel
from .methods import DecodeConfig
from .policy import ConfidenceTree, FixedDepth
from .runtime import Runtime
from .tree_rule import TreeRule

# a confidence tree like those the replay tunes (expand 0.35-0.5, one or two nodes fed a level)
MEASURING_RULE = {"expand": 0.35, "rho": 1.4, "max_width": 2}
# a static round like the best static shapes the replay finds: the first level's candidates,
# then chains, two levels deep (`ti-mcsd`'s shape)
MEASURING_STATIC_DEPTH = 2
MIN_LEVEL_SPREAD = 0.25  # levels a round between a kind's two measurements below which no
# per-level term is fitted


@contextmanager
def timed_passes(*models: KVModel) -> Iterator[list[list[float]]]:
    """Seconds of every pass each model makes inside the block, one list per model."""
    times: list[list[float]] = [[] for _ in models]

    def clocked(lm: KVModel, call: Callable, into: list[float]) -> Callable:
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = call(*args, **kwargs)
            if lm.device.type == "cuda":
                torch.cuda.synchronize(lm.device)
            into.append(time.perf_counter() - start)
            return out
        return run

    for lm, into in zip(models, times):
        lm.extend = clocked(lm, lm.extend, into)
        lm.extend_with_hidden = clocked(lm, lm.extend_with_hidden, into)
    try:
        yield times
    finally:
        for lm in models:
            del lm.extend, lm.extend_with_hidden


def measuring_policy(branching: tuple[int, ...], costs: CostCurve) -> ConfidenceTree:
    """The confidence tree `round_overhead` decodes with, priced by `costs`."""
    nodes = 1 + sum(branching) * MEASURING_RULE["max_width"]
    return ConfidenceTree(TreeRule(branching, verify_cost=tuple(costs.prices(nodes + 1).tolist()),
                                   **MEASURING_RULE))


def round_overhead(runtime: Runtime, prompts: list[torch.Tensor], config: DecodeConfig,
                   policy: ConfidenceTree) -> dict[str, RoundWork]:
    """{"tree": a drafted `tree` round's, "static": a static round's} host work beyond an `ar`
    round's (`RoundWork`, `ar` steps), decoding `prompts` ([L] ids; the first also warms up)
    as `config` says (its sampling, budget and depth), each kind cut at one level and deeper:
    the `tree` rounds with `policy` to `config`'s depth, the static ones with `config`'s first
    level then chains to `MEASURING_STATIC_DEPTH` (`_line`)."""
    ar = outside_per_round(runtime, prompts, dataclasses.replace(config, method="ar"))
    tree = dataclasses.replace(config, method="tree", lookup_branch=False)
    static = dataclasses.replace(config, method="mcsd", mcsd_branching=config.mcsd_branching[:1],
                                 lookup_branch=False)
    deep = FixedDepth(min(MEASURING_STATIC_DEPTH, config.max_depth))
    runs = {"tree": [(dataclasses.replace(tree, max_depth=1), policy), (tree, policy)],
            "static": [(static, FixedDepth(1)), (static, deep)]}
    return {kind: _line([outside_per_round(runtime, prompts, *run) for run in pair], ar)
            for kind, pair in runs.items()}


@dataclasses.dataclass(frozen=True)
class Outside:
    """What the rounds of a decoding spent outside the models' passes and the policy's
    decisions, the prefills aside."""

    seconds: float  # a round's, on average
    levels: float  # draft levels a round, on average
    passes: list[float]  # seconds of each target pass but the prefills


def _line(measured: list[Outside], ar: Outside) -> RoundWork:
    """The line through a shallow and a deep measurement's (levels a round, seconds beyond
    `ar`'s in `ar` steps), through the deep one, its per-level term >= 0; flat at the deep
    figure when the two are less than `MIN_LEVEL_SPREAD` levels apart (a tree that seldom
    drafts a second level)."""
    step = statistics.median(ar.passes)
    shallow, deep = ((m.levels, (m.seconds - ar.seconds) / step) for m in measured)
    spread = deep[0] - shallow[0]
    per_level = max((deep[1] - shallow[1]) / spread, 0.0) if spread >= MIN_LEVEL_SPREAD else 0.0
    return RoundWork(deep[1] - per_level * deep[0], per_level)


def outside_per_round(runtime: Runtime, prompts: list[torch.Tensor], config: DecodeConfig,
                      policy: ConfidenceTree | FixedDepth | None = None) -> Outside:
    """`prompts` decoded as `config` says (the first also warms up), timed outside the passes."""
    models = [runtime.target] + [m for m in [runtime.draft] if m not in (None, runtime.target)]
    runtime.generate(prompts[0], config, policy)  # warm-up
    seconds, rounds, levels, passes = 0.0, 0, 0, []
    for prompt in prompts:
        with timed_passes(*models) as times:
            stats = runtime.generate(prompt, config, policy).stats
        seconds += stats.seconds - sum(map(sum, times)) - stats.decision_seconds
        rounds += stats.target_calls - 1  # the prefill is not a round
        levels += stats.drafted_levels
        passes += times[0][1:]
    return Outside(seconds / max(rounds, 1), levels / max(rounds, 1), passes)
