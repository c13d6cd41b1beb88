"""Stage `export`'s settle: what the exported file decodes in each mode, measured where the
replay cannot tell.

The replay prices a round by the cost curves and the overhead collect timed, and between a
static round and a tree's it errs by about as much as the two kinds differ on these CPUs: on
the AMD host it ranked the static shape 0.5% above the learned tree where the bench measured
the confidence tree 4.7% ahead of it, and a later run measured the greedy tree with the
prompt-lookup branch at 1.23x its replayed speed (README, Results).  So in each mode (greedy, and sampled where the
export has a sampling rule) the winner is decoded on val prompts, in turn a prompt at a time
(`evaluation.side_by_side.bench_methods`), as the replay chose beside each contender: the other
kind where its tree and the best static shape replayed within `export.settle.margin` of each
other, and its tree with the lookup branch where the file has a lookup model, greedy also the
draft's confidence tree (stage train's rule for it) with the same branch.  The fastest is what
the file decodes: its `static_tree` / `sampling_static_tree` set where the static shape beat
the tree, `lookup_branch` / `sampling_lookup_branch` set where the lookup branch beat both, and
`confidence_tree` (the rule) where the confidence tree with the branch beat them all; `settled`
says what was measured.  None of them changes the output's distribution: each is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from specstop.decoder.methods import DecodeConfig
from specstop.decoder.runtime import Runtime
from specstop.decoder.sampling import Sampling
from specstop.decoder.stop_model import (BRANCH_WAYS, CONFIDENCE_WAY, LOOKUP_KEYS, LOOKUP_WAY,
                                         STATIC_KEYS, STATIC_WAY, TREE_WAY, LearnedPolicy)
from specstop.evaluation.intervals import Ratio, speed_ratio
from specstop.evaluation.side_by_side import bench_methods, decoder_method

MODES = {True: "greedy", False: "sampling"}


@dataclass(frozen=True)
class Decoding:
    """What the settle decodes with: the runtime, the val prompts ([L] ids), the `tree` decode
    config (greedy; the sampled one takes the sampling rule's temperature) and the longest
    lookup chain (`collect.lookup_tokens`, what the lookup model was fitted on)."""

    runtime: Runtime
    prompts: list[torch.Tensor]
    config: DecodeConfig
    lookup_tokens: int
    seed: int = 0


@dataclass(frozen=True)
class DecodingSource:
    """Where the settle's `Decoding` comes from: `check` its inputs (before any work), `load`
    the models and prompts (only where a mode is contested)."""

    check: Callable[[], None]
    load: Callable[[], Decoding]


@dataclass(frozen=True)
class Contest:
    """What one mode's tree is decoded beside: the static shape (widths, depth, replayed speed)
    whose replay is close to the tree's, whether its tree with the lookup branch, and the
    confidence tree's rule to decode with the branch (greedy, where the tree drafts)."""

    static: dict | None
    lookup: bool
    confidence: dict | None = None


def contested(meta: dict, shapes: dict[str, dict | None], margin: float,
              lookup: bool = False, confidence: dict | None = None) -> dict[bool, Contest]:
    """By greedy, in the modes the stop model's tree decodes (sampled only with a sampling
    rule): the static shape (`shapes[mode]`) whose replay is within `margin` (relative) of the
    tree's (none behind `fallback: ar`), the lookup branch where `lookup` and the file has
    a lookup model, and with it greedy the `confidence` tree rule where the tree drafts; modes
    with none are left out."""
    out = {}
    for greedy, mode in MODES.items():
        if not greedy and not meta.get("sampling_tree_rule"):
            continue
        shape, tree = shapes.get(mode), tree_speed(meta, greedy)
        close = margin > 0 and shape is not None and tree is not None and \
            abs(shape["speedup"] / tree - 1) <= margin
        chain = lookup and bool(meta.get("lookup_model"))
        if close or chain:
            rival = confidence if chain and greedy and tree is not None else None
            out[greedy] = Contest(shape if close else None, chain, rival)
    return out


def tree_speed(meta: dict, greedy: bool) -> float | None:
    """The stop model's tree's replayed speed in a mode (greedy behind its round gate), None
    where it has no tree there."""
    if not greedy:
        return meta.get("sampling_tree_speedup") if meta.get("sampling_tree_rule") else None
    if meta.get("fallback") == "ar":
        return None
    return meta.get("gated_speedup") or meta["tree_speedup"]


def settle(module: torch.jit.ScriptModule, meta: dict, shapes: dict[str, dict | None],
           margin: float, lookup: bool, decoding: Callable[[], Decoding],
           confidence: dict | None = None) -> dict:
    """`meta` with each contested mode decided by decoding: its static shape set where it
    decoded faster than the tree (kept as the replay chose it where the two were not close),
    its lookup branch set where that decoded fastest, with the `confidence` tree rule where
    the confidence tree with the branch did; and `settled` (by mode: the replays, each way's
    measured speed over the replay's choice's).  `meta` itself where no mode is contested
    (`decoding`, which loads the models, not called)."""
    contests = contested(meta, shapes, margin, lookup, confidence)
    if not contests:
        return meta
    run = decoding()
    out, settled = dict(meta), {}
    for greedy, contest in contests.items():
        static_key, lookup_key = STATIC_KEYS[greedy], LOOKUP_KEYS[greedy]
        static = contest.static or meta.get(static_key)
        reference = STATIC_WAY if meta.get(static_key) else TREE_WAY  # the replay's choice
        kinds = [reference] if contest.static is None else \
            [reference, TREE_WAY if reference == STATIC_WAY else STATIC_WAY]
        ways = {kind: ({**meta, static_key: static if kind == STATIC_WAY else None,
                        lookup_key: False}, False) for kind in kinds}
        if contest.lookup:
            ways[LOOKUP_WAY] = ({**meta, static_key: None, lookup_key: False}, True)
        if contest.confidence is not None:
            ways[CONFIDENCE_WAY] = ({**meta, static_key: None, lookup_key: True,
                                     "confidence_tree": contest.confidence}, True)
        speeds = measured(run, module, ways, greedy)
        decodes = max(speeds, key=lambda way: speeds[way].ratio)
        if contest.static is not None:
            static_wins = speeds[STATIC_WAY].ratio > speeds[TREE_WAY].ratio
            out[static_key] = static if static_wins else None
        out[lookup_key] = decodes in BRANCH_WAYS
        if greedy:
            out["confidence_tree"] = contest.confidence if decodes == CONFIDENCE_WAY else None
        settled[MODES[greedy]] = {
            "static_tree": static, "tree_speedup": tree_speed(meta, greedy),
            "vs_replay": {way: ratio.as_dict() for way, ratio in speeds.items()
                          if way != reference},
            "prompts": len(run.prompts), "decodes": decodes, "replay_decodes": reference}
    return {**out, "settled": settled}


def measured(run: Decoding, module: torch.jit.ScriptModule, ways: dict[str, tuple[dict, bool]],
             greedy: bool) -> dict[str, Ratio]:
    """By way of decoding (stop model metadata, lookup branch): its throughput over the first
    way's, each prompt decoded every way in turn, with its paired 95% interval."""
    config = run.config
    if not greedy:
        temperature = next(iter(ways.values()))[0]["sampling_temperature"]
        config = replace(config, sampling=Sampling(temperature, config.sampling.top_p))
    chain = replace(config, lookup_branch=True, max_depth=max(config.max_depth, run.lookup_tokens))
    methods = [decoder_method(run.runtime, chain if lookup else config, LearnedPolicy(module, m),
                              name) for name, (m, lookup) in ways.items()]
    results = bench_methods(run.runtime, run.prompts, methods, run.seed,
                            progress=f"settle {MODES[greedy]}", scored=False)
    first = results[0].per_prompt

    def over_first(a: list) -> Ratio:
        return Ratio(1.0, None) if a is first else speed_ratio(
            [s.new_tokens for s in a], [s.seconds for s in a],
            [s.new_tokens for s in first], [s.seconds for s in first])
    return {result.method: over_first(result.per_prompt) for result in results}
