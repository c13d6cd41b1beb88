"""Every measured cost, in one place: what a pass costs by width, as measured and as paid.

- `CostCurve`: the one reading of a measured table (seconds of one pass by width).  `.at(n)` is
  a pass over n tokens in one-token steps: the measured ratio, linearly interpolated between
  measured widths, extrapolated beyond the widest with the slope of the two widest, never less
  than the mean slope over the table (a slow shape just below the widest, as an AVX2-only host's
  v(24) 5.86 against v(32) 3.84, would price wider passes below the widest, then below 0).
  `.padded(n)` is the width the decode loop runs a pass over n tokens at (`loop.score`) and
  what that costs: a measured n runs at the cheapest measured width >= n (ties to the narrower),
  an unmeasured n at n itself (priced by `.at`).  `.price(n)` is that cost in `ar` steps (a
  one-token pass as the loop pays it: itself padded where a wider pass is cheaper), the unit of
  every replay's speedup over `ar`; `.prices(N)` for n = 0..N is the table every replay, the
  level-wise rules, the sweep's prediction and the exported tree rule (`TreeRule.verify_cost`)
  price passes with, so they price what the loop pays.  On CPUs the cost is uneven in n (fast
  and slow GEMM shapes, ../shared/NOTES.md), so it is measured per model/dtype/device rather
  than assumed.
- `VerifyCosts`: stage `prepare`'s table for the target (data/costs/verify.json); its `.curve`
  is what the runtime pads with.
- `measure_costs`: the table stage `collect` records beside the logged rounds (costs.json):
  target pass by width (the runtime's `VerifyCosts` where one applies, else measured at the
  tree's sizes), draft step by level width, decision latency.
- `CostModel`: that table as the replay reads it: the target's and the draft's curves, and
  what a drafted tree round spends outside them (`RoundWork`, measured by `overhead.py`).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
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
class CostCurve:
    """A measured cost table by width, read one way (see the module docstring)."""

    seconds: dict[int, float]  # measured width -> seconds of one pass (width 1 required)

    def __post_init__(self) -> None:
        if 1 not in self.seconds or any(n < 1 or not t > 0 for n, t in self.seconds.items()):
            raise ValueError(f"a cost curve needs width 1 and positive times at widths >= 1, "
                             f"got {self.seconds}")

    @property
    def step(self) -> float:
        """Seconds of a one-token pass, the unit of `at`."""
        return self.seconds[1]

    def at(self, n: int) -> float:
        """One-token steps of a pass over n tokens (0 for none), interpolated where n was not
        measured, extrapolated beyond the widest measured width by the last slope or the mean
        slope from width 1, whichever is steeper (and never falling)."""
        if n in self.seconds:
            return self.seconds[n] / self.step
        if n < 1:
            return 0.0
        widths = sorted(self.seconds)
        if len(widths) == 1:
            return 1.0
        values = np.array([self.seconds[w] for w in widths]) / self.step
        if n > widths[-1]:
            last = (values[-1] - values[-2]) / (widths[-1] - widths[-2])
            mean = (values[-1] - values[0]) / (widths[-1] - widths[0])
            return float(values[-1] + max(last, mean, 0.0) * (n - widths[-1]))
        return float(np.interp(n, widths, values))

    def padded(self, n: int) -> tuple[int, float]:
        """(width, steps): the width the decode loop pads a pass over n tokens to, the cheapest
        measured width >= n when n is measured (else n), and its cost."""
        if n not in self.seconds:
            return n, self.at(n)
        width = min((m for m in self.seconds if m >= n), key=lambda m: (self.seconds[m], m))
        return width, self.at(width)

    @property
    def ar_seconds(self) -> float:
        """Seconds the loop pays for a one-token pass (`ar`'s step), padding included."""
        return self.padded(1)[1] * self.step

    def price(self, n: int) -> float:
        """What the loop pays for a pass over n tokens, in `ar` steps (0 for none)."""
        return self.padded(n)[1] / self.padded(1)[1] if n > 0 else 0.0

    def prices(self, up_to: int) -> np.ndarray:
        """[up_to + 1] `price` of a pass over n = 0..up_to tokens."""
        return np.array([self.price(n) for n in range(up_to + 1)])


@dataclass(frozen=True)
class VerifyCosts:
    """Median seconds of one target pass over n new tokens after a fixed context."""

    model: str
    dtype: str
    device: str
    context: int
    seconds: dict[int, float]  # n -> seconds
    kernel: str = "aten"  # how the forwards ran (`KVModel.kernel`); tables before it: aten

    @property
    def curve(self) -> CostCurve:
        return CostCurve(self.seconds)

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
                  verify_widths: tuple[int, ...] = (), step_widths: tuple[int, ...] = (),
                  runtime_table: VerifyCosts | None = None) -> dict:
    """The cost model's table (`costs.json`): seconds per target pass by size of the tree cut
    at each depth (and `verify_widths`), per draft step by level width (and `step_widths`: a
    dynamic tree feeds other widths), per decision (features + a threshold).

    With `runtime_table` (stage `prepare`'s, the one the decode loop pads with) the target's
    curve is that table, so the replay prices the passes the runtime pays; the target's step is
    timed once more beside the draft's, and the draft's seconds are scaled by the table's step
    over it, so that a host faster or slower than at `prepare` does not skew the draft's share.
    On a shared CPU two tables' ratios differ by several percent (README, Collect): the
    replay and the loop read one."""
    tree_sizes = [tree.size(d) for d in range(tree.max_depth + 1)]
    level_widths = sorted({tree.level_start[d + 1] - tree.level_start[d]
                           for d in range(tree.max_depth)} | set(step_widths))
    if runtime_table is None:
        widths = sorted(set(tree_sizes) | set(verify_widths))
        verify = measure_verify_costs(target, "target", widths, repeats=repeats)
        source, scale = "measured", 1.0
    else:
        verify, source = runtime_table, "runtime"
        scale = verify.seconds[1] / measure_verify_costs(target, "target", [], repeats=repeats
                                                         ).seconds[1]
    result = {"tree_sizes": tree_sizes, "threads": torch.get_num_threads(),
              "target": asdict(verify), "target_source": source}
    if draft is not None:
        step = measure_verify_costs(draft, "draft", level_widths, repeats=repeats)
        step = replace(step, seconds={n: t * scale for n, t in step.seconds.items()})
        result["draft"] = asdict(step)
        result["c"] = step.seconds[1] / verify.seconds[1]
    support = None if draft is None else draft.vocab_ids
    result["decision_seconds"] = _decision_seconds(
        target.vocab_size if support is None else len(support), max(level_widths),
        repeats) * scale
    return result


def _decision_seconds(vocab: int, width: int, repeats: int) -> float:
    """Features of one draft level plus a threshold decision (median seconds), over the `vocab`
    columns the runtime computes them on (a pruned draft's support: `drafter.draft_level`)."""
    q = torch.softmax(torch.randn(width, vocab), dim=-1)
    tokens = q.argmax(dim=1, keepdim=True)
    ones = torch.ones(width)
    policy = ConfidenceThreshold(0.4)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        features = draft_features(q, tokens, 1, torch.zeros(width), ones, ones, ones,
                                  RoundContext(0, 0, 0.0, 0.0, root_statistics(q[0]), (0,)))
        bool(policy(features).any())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass(frozen=True)
class RoundWork:
    """`ar` steps a drafted round spends on the host outside its passes and decisions, beyond
    what an `ar` round spends: a base per round plus a term per level drafted
    (`overhead.round_overhead`), so a shallow round is not charged for levels it skips."""

    base: float = 0.0
    per_level: float = 0.0

    def at(self, levels: float | np.ndarray) -> float | np.ndarray:
        """The work of a drafted round of `levels` levels."""
        return self.base + self.per_level * levels


@dataclass(frozen=True)
class CostModel:
    """`costs.json` (stage `collect`) as the replay reads it: cost curves and the decision."""

    tree_sizes: tuple[int, ...]  # nodes of the tree cut at depth 0..max_depth
    target: CostCurve  # one target pass by width
    draft: CostCurve  # one draft step by width
    decision: float  # seconds of the features + a threshold decision for one level
    tree_overhead: tuple[RoundWork, RoundWork] = (RoundWork(), RoundWork())  # a drafted
    # `tree` round's host work, greedy and sampled
    static_overhead: tuple[RoundWork, RoundWork] = (RoundWork(), RoundWork())  # the same for
    # a static tree's round (`overhead.py`)

    @classmethod
    def load(cls, path: Path) -> "CostModel":
        """The cost model of `costs.json`; a DataError names the file and the bad field."""
        try:
            return cls.from_table(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise DataError(f"{path}: cost model not found (run `specstop collect` first)")
        except OSError as err:
            raise DataError(f"{path}: cannot read the cost model ({err.strerror})") from err
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"{path}: not a cost model ({field_problem(err)})") from err

    @classmethod
    def from_table(cls, raw: dict) -> "CostModel":
        """The cost model of a `measure_costs` table (a KeyError, TypeError or ValueError names
        the bad field)."""
        return cls(_tree_sizes(raw["tree_sizes"]),
                   CostCurve(seconds_by_width(raw["target"]["seconds"], "target.seconds")),
                   CostCurve(seconds_by_width(raw["draft"]["seconds"], "draft.seconds")),
                   _decision_field(raw.get("decision_seconds", 0.0)),
                   *_overhead_field(raw.get("round_overhead", {})))

    @property
    def max_depth(self) -> int:
        return len(self.tree_sizes) - 1

    @property
    def target_step(self) -> float:
        """Seconds of `ar`'s step, the unit of every cost here (`CostCurve.ar_seconds`)."""
        return self.target.ar_seconds

    def overhead(self, sampled: bool, static: bool = False) -> RoundWork:
        """The host work of a drafted round (a `tree` round; a `static` tree's), greedy or
        `sampled` (`overhead.round_overhead`; none in a table without it)."""
        return (self.static_overhead if static else self.tree_overhead)[sampled]

    def scaled(self, draft: float = 1.0, verify_slope: float = 1.0) -> "CostModel":
        """This model on another machine's shape of curve: each draft step's seconds times
        `draft`, each target pass's seconds above a one-token step's times `verify_slope`
        (a what-if for the replay; the decisions and the rounds' host work unchanged)."""
        step = self.target.step
        target = {n: step + verify_slope * (t - step) for n, t in self.target.seconds.items()}
        return replace(self, target=CostCurve(target),
                       draft=CostCurve({n: t * draft for n, t in self.draft.seconds.items()}))

    def draft_step(self, width: int, extra: float = 0.0) -> float:
        """`ar` steps of one draft step feeding `width` nodes, its features and decision
        (`extra` seconds more: a learned model's latency) included."""
        return (self.draft.at(width) * self.draft.step + self.decision + extra) / self.target_step

    def round_cost(self, extra: float = 0.0) -> np.ndarray:
        """[max_depth + 1] cost (`ar` steps) of a round cut at depth D: its draft steps and the
        target pass over the cut tree as the loop pays it (`CostCurve.price`); `extra` seconds
        per decision (a learned model's latency)."""
        sizes = (0, *self.tree_sizes)
        steps = [self.draft_step(sizes[d] - sizes[d - 1], extra)
                 for d in range(1, self.max_depth + 1)]
        draft = np.concatenate([[0.0], np.cumsum(steps)])
        verify = np.array([self.target.price(n) for n in self.tree_sizes])
        return draft + verify

    def marginal_cost(self, extra: float = 0.0) -> np.ndarray:
        """[max_depth + 1] c + v: cost (`ar` steps) of drafting and verifying level d + 1
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


def _overhead_field(raw: object) -> tuple[tuple[RoundWork, RoundWork], ...]:
    """((greedy, sampled) of a `tree` round, the same of a static round) from {"tree": {...},
    "static": {...}}, each {"base", "per_level"} (a plain number: a base alone, as tables from
    before the per-level term hold); a table timing one kind (flat {"greedy", "sampled"})
    charges it to both."""
    tree = raw.get("tree", raw) if isinstance(raw, dict) else None
    static = raw.get("static", tree) if isinstance(raw, dict) else None
    if not isinstance(tree, dict) or not isinstance(static, dict):
        raise ValueError(f"field 'round_overhead' must map tree and static rounds, greedy and "
                         f"sampled, to `ar` steps, got {raw!r}")
    return tuple(tuple(_round_work(kind.get(decoding, 0.0), raw) for decoding in
                       ("greedy", "sampled")) for kind in (tree, static))


def _round_work(raw: object, table: object) -> RoundWork:
    """A {"base", "per_level"} entry, or a number (a base alone)."""
    if isinstance(raw, dict) and "base" not in raw:
        raise ValueError(f"field 'round_overhead' needs a base per round, got {table!r}")
    work = RoundWork(float(raw["base"]), float(raw.get("per_level", 0.0))) \
        if isinstance(raw, dict) else RoundWork(float(raw))
    if not (math.isfinite(work.base) and math.isfinite(work.per_level)):
        raise ValueError(f"field 'round_overhead' must be finite, got {table!r}")
    return work


def _decision_field(raw: object) -> float:
    seconds = float(raw)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"field 'decision_seconds' must be finite and >= 0, got {raw!r}")
    return seconds
