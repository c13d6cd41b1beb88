"""Sizes that follow the machine: where stage `prepare` measured the target's one-token step
slower than `sizes.full_until_step_ms`, the size-bound stages take the first part of the same
prompts, each count scaled by the ratio of the two (never below `sizes.min_scale`), so a slower
CPU runs the same experiment, smaller, within the budget."""

from __future__ import annotations

import os
from typing import Any

from specstop.common.errors import SpecstopError
from specstop.common.params import Params, with_overrides
from specstop.decoder.costs import VerifyCosts

SCALED = {  # stage -> its size-bound counts (dotted keys of params.yaml)
    "draft": ("draft.max_prompts",),
    "collect": ("collect.max_prompts",),  # not overhead_prompts: a prompt's round overhead
    # spreads widely (a greedy tree round's 0.03-0.59 ar steps over 8 val prompts in fp32), and
    # the mean of 3 over 0.07-0.38 (README, Collect)
    "export": ("export.settle.prompts",),
    "bench": ("bench.prompts",),
}


def size_scale(params: Params) -> tuple[float, float]:
    """The scale of the size-bound counts and the measured step (ms) it follows."""
    try:
        step_ms = 1000 * VerifyCosts.load(params.costs.path).curve.step
    except SpecstopError as err:
        raise SpecstopError(f"{err}; the sizes follow its one-token step (run `specstop "
                            f"prepare` first, or set sizes.full_until_step_ms: null)") from None
    scale = min(1.0, params.sizes.full_until_step_ms / step_ms)
    return round(max(scale, params.sizes.min_scale), 3), step_ms


def sized(stage: str, params: Params) -> tuple[Params, dict[str, Any] | None]:
    """`params` with `stage`'s counts scaled to this machine, and what was scaled (None for a
    stage without size-bound counts, or where `sizes.full_until_step_ms` is null)."""
    if stage not in SCALED or params.sizes.full_until_step_ms is None:
        return params, None
    scale, step_ms = size_scale(params)
    written = {key: _get(params, key) for key in SCALED[stage]}
    counts = {key: n if n is None else max(1, round(n * scale)) for key, n in written.items()}
    params = with_overrides(params, "sizes", **_nested(counts))
    if scale < 1 and os.environ.get("RANK", "0") == "0":  # once under torchrun
        print(f"sizes: the target's step took {step_ms:.1f} ms ({params.costs.path}), over "
              f"sizes.full_until_step_ms {params.sizes.full_until_step_ms:g}: counts x{scale:g} ("
              + ", ".join(f"{k} {written[k]} -> {n}" for k, n in counts.items()) + ")")
    return params, {"scale": scale, "step_ms": round(step_ms, 1), "counts": counts}


def _get(params: Params, key: str) -> Any:
    value: Any = params
    for name in key.split("."):
        value = getattr(value, name)
    return value


def _nested(values: dict[str, Any]) -> dict[str, dict]:
    """{"export.settle.prompts": 8} as sections of nested mappings: {"export": {"settle":
    {"prompts": 8}}}."""
    out: dict[str, dict] = {}
    for key, value in values.items():
        *path, last = key.split(".")
        into = out
        for name in path:
            into = into.setdefault(name, {})
        into[last] = value
    return out
