"""Sizes that follow the machine: where stage `prepare` measured the target's one-token step
slower than `sizes.full_until_step_ms`, the size-bound stages take the first part of the same
prompts, each count scaled by the ratio of the two (never below `sizes.min_scale`), so a slower
CPU runs the same experiment, smaller, within the budget."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel

from specstop.common.errors import SpecstopError
from specstop.common.params import Params
from specstop.decoder.costs import VerifyCosts

SCALED = {  # stage -> its size-bound counts (dotted keys of params.yaml)
    "draft": ("draft.max_prompts",),
    "collect": ("collect.max_prompts", "collect.overhead_prompts"),
    "export": ("export.settle.prompts",),
    "bench": ("bench.prompts",),
}


def size_scale(params: Params) -> tuple[float, float]:
    """The scale of the size-bound counts and the measured step (ms) it follows."""
    try:
        step_ms = 1000 * VerifyCosts.load(params.costs.path).seconds[1]
    except SpecstopError as err:
        raise SpecstopError(f"{err}; the sizes follow its one-token step (run `specstop "
                            f"prepare` first, or set sizes.full_until_step_ms: null)") from None
    full_until = params.sizes.full_until_step_ms
    scale = 1.0 if full_until is None else min(1.0, full_until / step_ms)
    return round(max(scale, params.sizes.min_scale), 3), step_ms


def sized(stage: str, params: Params) -> tuple[Params, dict[str, Any] | None]:
    """`params` with `stage`'s counts scaled to this machine, and what was scaled (None for a
    stage without size-bound counts, or where `sizes.full_until_step_ms` is null)."""
    if stage not in SCALED or params.sizes.full_until_step_ms is None:
        return params, None
    scale, step_ms = size_scale(params)
    written = {key: _get(params, key) for key in SCALED[stage]}
    counts = {key: n if n is None else max(1, round(n * scale)) for key, n in written.items()}
    for key, n in counts.items():
        params = _replace(params, key.split("."), n)
    if scale < 1 and os.environ.get("RANK", "0") == "0":  # once under torchrun
        print(f"sizes: the target's step took {step_ms:.1f} ms ({params.costs.path}), over "
              f"sizes.full_until_step_ms {params.sizes.full_until_step_ms:g}: counts x{scale:g} ("
              + ", ".join(f"{k} {written[k]} -> {n}" for k, n in counts.items()) + ")")
    return params, {"scale": scale, "step_ms": round(step_ms, 1), "counts": counts}


def _get(model: BaseModel, key: str) -> Any:
    for name in key.split("."):
        model = getattr(model, name)
    return model


def _replace(model: BaseModel, names: list[str], value: Any) -> BaseModel:
    """A copy of the frozen `model` with the attribute at `names` set to `value`."""
    head, *rest = names
    new = value if not rest else _replace(getattr(model, head), rest, value)
    return model.model_copy(update={head: new})
