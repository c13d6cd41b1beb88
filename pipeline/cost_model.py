"""The cost model the offline simulator replays: draft step, verification and decision latency,
measured on the collection machine with the collection models."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

import torch

from specstop.decoder.costs import measure_verify_costs
from specstop.decoder.loop import DecodeConfig, tree_for
from specstop.decoder.policy import ConfidenceThreshold
from specstop.decoder.runtime import Runtime
from specstop.features import RoundContext, draft_features


def measure(runtime: Runtime, config: DecodeConfig, repeats: int = 10) -> dict:
    """Seconds per target pass by tree size, per draft step by level width, per decision."""
    tree = tree_for(config)
    tree_sizes = [tree.size(d) for d in range(tree.max_depth + 1)]
    level_widths = sorted({tree.level_start[d + 1] - tree.level_start[d]
                           for d in range(tree.max_depth)})
    target = measure_verify_costs(runtime.target, "target", tree_sizes, repeats=repeats)
    result = {"tree_sizes": tree_sizes, "threads": torch.get_num_threads(),
              "target": asdict(target)}
    if runtime.drafter is not None:
        draft = measure_verify_costs(runtime.drafter.lm, "draft", level_widths, repeats=repeats)
        result["draft"] = asdict(draft)
        result["c"] = draft.seconds[1] / target.seconds[1]
    result["decision_seconds"] = _decision_seconds(runtime.target.vocab_size, max(level_widths),
                                                   repeats)
    return result


def _decision_seconds(vocab: int, width: int, repeats: int) -> float:
    """Features of one draft level plus a threshold decision (median seconds)."""
    q = torch.softmax(torch.randn(width, vocab), dim=-1)
    tokens = q.argmax(dim=1, keepdim=True)
    ones = torch.ones(width)
    policy = ConfidenceThreshold(0.4)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        features = draft_features(q, tokens, 1, torch.zeros(width), ones, ones,
                                  RoundContext(0, 0, 0.0))
        bool(policy(features).any())
        times.append(time.perf_counter() - start)
    return statistics.median(times)
