"""Measured verification cost by pass width, and the padding it suggests.

On CPUs the cost of one target pass over n new tokens is uneven in n (fast and slow GEMM shapes,
../shared/NOTES.md), so it is measured once per model/dtype/device rather than assumed.  The
decode loop pads a pass to the cheapest measured width at least as large.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specstop.common.errors import SpecstopError, first_line
from specstop.common.files import write_json
from .kv import KVModel


@dataclass(frozen=True)
class VerifyCosts:
    """Median seconds of one target pass over n new tokens after a fixed context."""

    model: str
    dtype: str
    device: str
    context: int
    seconds: dict[int, float]  # n -> seconds

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
    keep = torch.arange(context)
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
            lm.retain(keep)
    seconds = {n: statistics.median(t) for n, t in times.items()}
    lm.reset()
    return VerifyCosts(name, str(lm.dtype).removeprefix("torch."), lm.device.type, context, seconds)
