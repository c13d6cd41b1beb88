"""Every measured cost, in one place: what a pass costs by width, as measured and as replayed.

- `VerifyCosts`: median seconds of one pass over n new tokens (stage `prepare`'s
  data/costs/verify.json for the target); the decode loop pads a pass to the cheapest measured
  width at least as large.  On CPUs the cost is uneven in n (fast and slow GEMM shapes,
  ../shared/NOTES.md), so it is measured per model/dtype/device rather than assumed.
- `measure_costs`: the table stage `collect` records beside the logged rounds (costs.json):
  target pass by tree size, draft step by level width, decision latency.
- `CostModel`: that table as the replay reads it, in target one-token steps.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from specstop.common.errors import DataError, SpecstopError, first_line
from specstop.common.files import write_json
from specstop.features import RoundContext, draft_features, root_statistics

from .kv import KVModel
from .policy import ConfidenceThreshold
from .tree import Tree


@dataclass(frozen=True)
class VerifyCosts:
    """Median seconds of one target pass over n new tokens after a fixed context."""

    model: str
    dtype: str
    device: str
    context: int
    seconds: dict[int, float]  # n -> seconds
    kernel: str = "aten"  # how the forwards ran (`KVModel.kernel`); tables before it: aten

    def ratio(self, n: int) -> float:
        """v(n): cost of a pass over n tokens relative to a one-token step."""
        return self.seconds[n] / self.seconds[1]

    def padded_width(self, n: int) -> int:
        """The cheapest measured width >= n (n itself when nothing wider is cheaper)."""
        wider = [m for m in self.seconds if m >= n]
        if n not in self.seconds or not wider:
            return n
        return min(wider, key=lambda m: (self.seconds[m], m))

    def save(self, path: Path) -> None:
        write_json(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> "VerifyCosts":
        """A table `save` wrote; a SpecstopError names the file and the bad field."""
        try:
            raw = json.loads(Path(path).read_text())
            raw["seconds"] = seconds_by_width(raw["seconds"], "seconds")
            return cls(**raw)
        except OSError as err:
            raise SpecstopError(f"{path}: cannot read the verify costs ({err.strerror})") from err
        except (KeyError, TypeError, ValueError) as err:
            raise SpecstopError(f"{path}: not a verify-cost table ({field_problem(err)})") \
                from err


def seconds_by_width(raw: object, field: str) -> dict[int, float]:
    """`{"n": seconds}` as {n: seconds}; a ValueError naming `field` unless it is non-empty,
    holds width 1 and every width >= 1 took a finite, positive time."""
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"field '{field}' must map widths to seconds, got {raw!r}")
    try:
        seconds = {int(k): float(v) for k, v in raw.items()}
    except (TypeError, ValueError) as err:
        raise ValueError(f"field '{field}': {first_line(err)}") from err
    if 1 not in seconds:
        raise ValueError(f"field '{field}' has no width 1, the one-token step")
    for n, time_s in seconds.items():
        if n < 1:
            raise ValueError(f"field '{field}': width {n} is below 1")
        if not math.isfinite(time_s) or time_s <= 0:
            raise ValueError(f"field '{field}': width {n} took {time_s} s, not a finite time > 0")
    return seconds


def field_problem(err: Exception) -> str:
    """What a JSON loader's KeyError, TypeError or ValueError says, in one line."""
    return f"missing field {err}" if isinstance(err, KeyError) else first_line(err)


def measure_verify_costs(lm: KVModel, name: str, widths: list[int], context: int = 200,
                         repeats: int = 15) -> VerifyCosts:
    """Time one pass of each width after `context` cached tokens (median of `repeats`)."""
    vocab = lm.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (context,), generator=generator)
    def features(n: int) -> torch.Tensor | None:  # a feature-conditioned head reads features
        return None if lm.feature_size is None else torch.zeros(n, lm.feature_size)

    lm.reset()
    lm.extend(prompt, torch.arange(context), None, features(context))
    no_nodes = torch.empty(0, dtype=torch.long)  # a round keeps the context alone
    batches = {}
    for n in sorted(set([1, *widths])):
        ids = torch.randint(0, vocab, (n,), generator=generator)
        allow = torch.eye(n, dtype=torch.bool)  # a flat tree: the cost depends on n, not shape
        batches[n] = (ids, torch.full((n,), context), allow if n > 1 else None, features(n))
    times: dict[int, list[float]] = {n: [] for n in batches}
    for i in range(repeats + 2):  # round-robin over widths, so drift hits every width alike
        for n, (ids, positions, allow, feats) in batches.items():
            start = time.perf_counter()
            lm.extend(ids, positions, allow, feats)
            if lm.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:  # the first two rounds warm up
                times[n].append(time.perf_counter() - start)
            lm.retain(context, no_nodes)
    seconds = {n: statistics.median(t) for n, t in times.items()}
    lm.reset()
    return VerifyCosts(name, str(lm.dtype).removeprefix("torch."), lm.device.type, context, seconds,
                       lm.kernel)


def measure_costs(target: KVModel, draft: KVModel | None, tree: Tree, repeats: int = 10,
                  verify_widths: tuple[int, ...] = (), step_widths: tuple[int, ...] = ()) -> dict:
    """The cost model's table (`costs.json`): seconds per target pass by size of the tree cut
    at each depth (and `verify_widths`), per draft step by level width (and `step_widths`: a
    dynamic tree feeds other widths), per decision (features + a threshold)."""
    tree_sizes = [tree.size(d) for d in range(tree.max_depth + 1)]
    level_widths = sorted({tree.level_start[d + 1] - tree.level_start[d]
                           for d in range(tree.max_depth)} | set(step_widths))
    verify = measure_verify_costs(target, "target", sorted(set(tree_sizes) | set(verify_widths)),
                                  repeats=repeats)
    result = {"tree_sizes": tree_sizes, "threads": torch.get_num_threads(),
              "target": asdict(verify)}
    if draft is not None:
        step = measure_verify_costs(draft, "draft", level_widths, repeats=repeats)
        result["draft"] = asdict(step)
        result["c"] = step.seconds[1] / verify.seconds[1]
    result["decision_seconds"] = _decision_seconds(target.vocab_size, max(level_widths),
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
                                  RoundContext(0, 0, 0.0, 0.0, root_statistics(q[0])))
        bool(policy(features).any())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass(frozen=True)
class CostModel:
    """Seconds from `costs.json` (stage `collect`), read as target one-token steps."""

    tree_sizes: tuple[int, ...]  # nodes of the tree cut at depth 0..max_depth
    target: dict[int, float]  # seconds of one target pass by width
    draft: dict[int, float]  # seconds of one draft step by width
    decision: float  # seconds of the features + a threshold decision for one level

    @classmethod
    def load(cls, path: Path) -> "CostModel":
        """The cost model of `costs.json`; a DataError names the file and the bad field."""
        try:
            raw = json.loads(Path(path).read_text())
            return cls(_tree_sizes(raw["tree_sizes"]),
                       seconds_by_width(raw["target"]["seconds"], "target.seconds"),
                       seconds_by_width(raw["draft"]["seconds"], "draft.seconds"),
                       _decision_field(raw.get("decision_seconds", 0.0)))
        except FileNotFoundError:
            raise DataError(f"{path}: cost model not found (run `specstop collect` first)")
        except OSError as err:
            raise DataError(f"{path}: cannot read the cost model ({err.strerror})") from err
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"{path}: not a cost model ({field_problem(err)})") from err

    @property
    def max_depth(self) -> int:
        return len(self.tree_sizes) - 1

    @property
    def target_step(self) -> float:
        return _at(self.target, 1)

    def draft_step(self, width: int, extra: float = 0.0) -> float:
        """Target steps of one draft step feeding `width` nodes, its features and decision
        (`extra` seconds more: a learned model's latency) included."""
        return (_at(self.draft, width) + self.decision + extra) / self.target_step

    def round_cost(self, extra: float = 0.0) -> np.ndarray:
        """[max_depth + 1] cost (target steps) of a round cut at depth D; `extra` seconds per
        decision (a learned model's latency)."""
        sizes = (0, *self.tree_sizes)
        steps = [_at(self.draft, sizes[d] - sizes[d - 1]) + self.decision + extra
                 for d in range(1, self.max_depth + 1)]
        draft = np.concatenate([[0.0], np.cumsum(steps)])
        verify = np.array([_at(self.target, n) for n in self.tree_sizes])
        return (draft + verify) / self.target_step

    def marginal_cost(self, extra: float = 0.0) -> np.ndarray:
        """[max_depth + 1] c + v: cost (target steps) of drafting and verifying level d + 1
        after level d (index d; the last entry is unused)."""
        cost = self.round_cost(extra)
        return np.append(np.diff(cost), np.inf)


def _tree_sizes(raw: object) -> tuple[int, ...]:
    """Nodes of the tree cut at depth 0..D: a non-empty increasing list of positive integers."""
    sizes = tuple(int(n) for n in raw) if isinstance(raw, list) else ()
    if not sizes or sizes[0] < 1 or any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"field 'tree_sizes' must be an increasing list of positive node "
                         f"counts, got {raw!r}")
    return sizes


def _decision_field(raw: object) -> float:
    seconds = float(raw)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"field 'decision_seconds' must be finite and >= 0, got {raw!r}")
    return seconds


def _at(seconds: dict[int, float], width: int) -> float:
    """Measured seconds at `width`, linearly interpolated (or extrapolated) between widths."""
    if width in seconds:
        return seconds[width]
    widths = np.array(sorted(seconds))
    values = np.array([seconds[w] for w in widths])
    if len(widths) == 1:
        return float(values[0])
    if width > widths[-1]:
        slope = (values[-1] - values[-2]) / (widths[-1] - widths[-2])
        return float(values[-1] + slope * (width - widths[-1]))
    return float(np.interp(width, widths, values))
