"""Stage `export`'s settle: the measured choice between the winner's tree and the static shape
where the replay cannot tell them apart.

The replay prices a round by the cost curves and the overhead collect timed, and between a
static round and a tree's it errs by about as much as the two kinds differ on these CPUs: on
the AMD host it ranked the static shape 0.5% above the learned tree where the bench measured
the confidence tree 4.7% ahead of it (README, Results).  So where the two replayed within
`export.settle.margin` of each other (greedy, and sampled where the export has a sampling
rule), the winner is decoded both ways on val prompts, in turn a prompt at a time
(`evaluation.side_by_side.bench_methods`), and the kind with the higher throughput is what the
exported file decodes (its `static_tree` / `sampling_static_tree` set or cleared); the file's
`settled` says what was measured.  Neither way changes the output's distribution: both are
exact decodings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from specstop.decoder.methods import DecodeConfig
from specstop.decoder.runtime import Runtime
from specstop.decoder.sampling import Sampling
from specstop.decoder.stop_model import STATIC_KEYS, LearnedPolicy
from specstop.evaluation.intervals import Ratio, speed_ratio
from specstop.evaluation.side_by_side import bench_methods, decoder_method

MODES = {True: "greedy", False: "sampling"}


@dataclass(frozen=True)
class Decoding:
    """What the settle decodes with: the runtime, the val prompts ([L] ids) and the `tree`
    decode config (greedy; the sampled one takes the sampling rule's temperature)."""

    runtime: Runtime
    prompts: list[torch.Tensor]
    config: DecodeConfig
    seed: int = 0


@dataclass(frozen=True)
class DecodingSource:
    """Where the settle's `Decoding` comes from: `check` its inputs (before any work), `load`
    the models and prompts (only where a mode is contested)."""

    check: Callable[[], None]
    load: Callable[[], Decoding]


def contested(meta: dict, shapes: dict[str, dict | None], margin: float) -> dict[bool, dict]:
    """By greedy: the static shape (`shapes[mode]`: widths, depth, replayed speed) whose replay
    is within `margin` (relative) of the stop model's tree's, in the modes where its tree
    drafts (not behind `fallback: ar`; sampled only with a sampling rule)."""
    out = {}
    for greedy, mode in MODES.items():
        shape, tree = shapes.get(mode), tree_speed(meta, greedy)
        if margin > 0 and shape is not None and tree is not None and \
                abs(shape["speedup"] / tree - 1) <= margin:
            out[greedy] = shape
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
           margin: float, decoding: Callable[[], Decoding]) -> dict:
    """`meta` with each contested mode's static shape set where it decoded faster than the tree
    and cleared where it did not, and `settled` (by mode: both replays, the measured ratio);
    `meta` itself where no mode is contested (`decoding`, which loads the models, not called)."""
    chosen = contested(meta, shapes, margin)
    if not chosen:
        return meta
    run = decoding()
    out, settled = dict(meta), {}
    for greedy, shape in chosen.items():
        key = STATIC_KEYS[greedy]
        ratio = measured(run, module, {**meta, key: None}, {**meta, key: shape}, greedy)
        out[key] = shape if ratio.ratio > 1 else None
        settled[MODES[greedy]] = {"static_tree": shape, "tree_speedup": tree_speed(meta, greedy),
                                  "static_vs_tree": ratio.as_dict(), "prompts": len(run.prompts),
                                  "decodes": "static tree" if ratio.ratio > 1 else "tree",
                                  "replay_decodes": "static tree" if meta.get(key) else "tree"}
    return {**out, "settled": settled}


def measured(run: Decoding, module: torch.jit.ScriptModule, tree: dict, static: dict,
             greedy: bool) -> Ratio:
    """The static shape's throughput over the tree's (two stop models, `tree` and `static`
    metadata), each prompt decoded by both in turn, with its paired 95% interval."""
    config = run.config
    if not greedy:
        config = replace(config, sampling=Sampling(tree["sampling_temperature"],
                                                   config.sampling.top_p))
    methods = [decoder_method(run.runtime, config, LearnedPolicy(module, m), name)
               for name, m in (("tree", tree), ("static", static))]
    results = bench_methods(run.runtime, run.prompts, methods, run.seed,
                            progress=f"settle {MODES[greedy]}")
    a, b = (r.per_prompt for r in results[::-1])
    return speed_ratio([s.new_tokens for s in a], [s.seconds for s in a],
                       [s.new_tokens for s in b], [s.seconds for s in b])
