"""What a drafted round spends beyond what the cost curves price.

The cost model (`costs.py`) prices a round as its target pass, its draft steps and its
decisions, each timed alone.  A drafted round also draws, picks its trees and masks, verifies
and commits on the host: on a 2-core CPU a few ms a round beyond what an `ar` round spends,
against a 15-50 ms target step (README, Collect).  And its passes cost more inside a decode than
alone: a tree's target pass about 5% over the curve where `ar`'s is within 2% (stop 53, bf16 on
the AMD host), the draft's steps and the host work between them evicting each other's caches.
`round_overhead` measures both for both kinds of drafted round: the same prompts decoded by
`ar`, by `tree` (EAGLE-2's confidence tree) and by a static tree (`mcsd` drafting a fixed
shape), every pass of either model timed and priced by the curves where the replay prices one
(`KVModel.extend` and `extend_with_hidden`, at the width it fed); a round's seconds (the prefill
aside) less its passes' prices and its decisions' (the table's seconds a draft step, as the
replay charges them: a tree's selection work beyond that is the round's), less an `ar` round's,
in `ar` steps.  A static round spends less than a `tree` round (no per-level
selection, no fed and verified trees to gather), so the replay charges each its own.  Each
level drafted costs host work too (a sampled level about 1-1.5 ms: warp, draws, features), so
each kind is timed at one level and deeper, and a round is charged a base plus a term per
level it drafts (`costs.RoundWork`).  The decodings take turns a prompt at a time, so the
host's speed, which drifts on a shared machine, weighs on each kind alike (`outside_per_round`).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import torch

from .costs import CostCurve, CostModel, RoundWork
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
def timed_passes(*models: KVModel) -> Iterator[list[list[tuple[int, float]]]]:
    """(tokens fed, seconds) of every pass each model makes inside the block, one list per
    model."""
    times: list[list[tuple[int, float]]] = [[] for _ in models]

    def clocked(lm: KVModel, call: Callable, into: list[tuple[int, float]]) -> Callable:
        def run(ids: torch.Tensor, *args, **kwargs):
            start = time.perf_counter()
            out = call(ids, *args, **kwargs)
            if lm.device.type == "cuda":
                torch.cuda.synchronize(lm.device)
            into.append((ids.shape[0], time.perf_counter() - start))
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


Run = tuple[DecodeConfig, "ConfidenceTree | FixedDepth | None"]  # a decoding and its policy


def measuring_runs(config: DecodeConfig, policy: ConfidenceTree) -> dict[str, Run]:
    """What `round_overhead` decodes, as `config` says (its sampling, budget and depth): `ar`;
    `tree` rounds with `policy` cut at one level ("tree") and to `config`'s depth ("tree_deep");
    static rounds, `config`'s first level then chains, at one level ("static") and at
    `MEASURING_STATIC_DEPTH` ("static_deep")."""
    tree = dataclasses.replace(config, method="tree", lookup_branch=False)
    static = dataclasses.replace(config, method="mcsd", mcsd_branching=config.mcsd_branching[:1],
                                 lookup_branch=False)
    return {"ar": (dataclasses.replace(config, method="ar"), None),
            "tree": (dataclasses.replace(tree, max_depth=1), policy), "tree_deep": (tree, policy),
            "static": (static, FixedDepth(1)),
            "static_deep": (static, FixedDepth(min(MEASURING_STATIC_DEPTH, config.max_depth)))}


def round_overhead(runtime: Runtime, prompts: list[torch.Tensor], config: DecodeConfig,
                   policy: ConfidenceTree, costs: CostModel) -> dict[str, RoundWork]:
    """{"tree": a drafted `tree` round's, "static": a static round's} work beyond an `ar`
    round's that `costs` does not price (`RoundWork`, `ar` steps): `measuring_runs` decoding
    `prompts` ([L] ids; the first also warms up), each kind's line through its shallow and
    deep figures (`_line`)."""
    outside = outside_per_round(runtime, prompts, measuring_runs(config, policy), costs)
    return {kind: _line([outside[kind], outside[f"{kind}_deep"]], outside["ar"],
                        costs.target_step) for kind in ("tree", "static")}


@dataclasses.dataclass(frozen=True)
class Outside:
    """What the rounds of a decoding spent beyond the prices of their passes and decisions,
    the prefills aside."""

    seconds: float  # a round's, on average
    levels: float  # draft levels a round, on average


def _line(measured: list[Outside], ar: Outside, step: float) -> RoundWork:
    """The line through a shallow and a deep measurement's (levels a round, seconds beyond
    `ar`'s in `ar` steps of `step` seconds, each at least 0: a round is never credited, as
    where the curves, timed under another load, price the passes above what a decode pays),
    through the deep one, its per-level term >= 0; flat at the deep figure when the two are
    less than `MIN_LEVEL_SPREAD` levels apart (a tree that seldom drafts a second level)."""
    shallow, deep = ((m.levels, max((m.seconds - ar.seconds) / step, 0.0)) for m in measured)
    spread = deep[0] - shallow[0]
    per_level = max((deep[1] - shallow[1]) / spread, 0.0) if spread >= MIN_LEVEL_SPREAD else 0.0
    return RoundWork(deep[1] - per_level * deep[0], per_level)


def outside_per_round(runtime: Runtime, prompts: list[torch.Tensor], runs: dict[str, Run],
                      costs: CostModel) -> dict[str, Outside]:
    """Per run, its rounds' seconds beyond what `costs` prices their passes (every target pass
    but the prefill, the draft's last `draft_steps`: the rounds') and their decisions (one a
    draft step) at.  Each run warms up on the first prompt, then every prompt is decoded by
    each run in turn, the order turned by one a prompt, so a drift of the host's speed falls on
    every run alike: one run after another (952bccf's collect), a greedy `tree` round at two
    levels came out 0.14 `ar` steps above a static round; in turn, on the same models, 0.07-0.09
    in three runs (stop 54)."""
    models = [runtime.target] + [m for m in [runtime.draft] if m not in (None, runtime.target)]
    for config, policy in runs.values():
        runtime.generate(prompts[0], config, policy)
    totals = {name: np.zeros(3) for name in runs}  # seconds, rounds, levels
    names = list(runs)
    for i, prompt in enumerate(prompts):
        for name in (names[k] for k in rotated(len(names), i)):
            with timed_passes(*models) as times:
                stats = runtime.generate(prompt, *runs[name]).stats
            target, draft = times[0][1:], (times[1:] or [[]])[0]
            priced = sum(costs.target.price(w) for w, _ in target) + sum(
                costs.draft_step(w) for w, _ in draft[len(draft) - stats.draft_steps:])
            totals[name] += (stats.round_seconds - priced * costs.target_step,
                             stats.target_calls - 1,  # the prefill is not a round
                             stats.drafted_levels)
    return {name: Outside(seconds / max(rounds, 1), levels / max(rounds, 1))
            for name, (seconds, rounds, levels) in totals.items()}


def rotated(n: int, shift: int) -> list[int]:
    """0..n-1 starting at `shift` mod n: the order of decodings timed in turn, turned by one a
    prompt (here and `evaluation.side_by_side`)."""
    return [(shift + k) % n for k in range(n)]
