"""Stage `prepare`: de-quantise the embedded target once and measure its verification costs."""

from __future__ import annotations

from pathlib import Path

from specstop.decoder.costs import measure_verify_costs
from specstop.decoder.models import convert_embedded, load_model, resolve_device, resolve_dtype
from specstop.decoder.kv import KVModel

from .params import section


def run(params: dict) -> None:
    models, costs = section(params, "models"), section(params, "costs")
    target = models.get("target", "embedded")
    cache_dir = Path(models.get("cache_dir", "data/models/target"))
    if target == "embedded":
        convert_embedded(cache_dir)
    device = resolve_device(models.get("device", "auto"))
    dtype = resolve_dtype(models.get("dtype", "auto"), device)
    lm = KVModel(load_model(target, dtype, device, cache_dir).model)
    table = measure_verify_costs(lm, target, list(costs.get("widths", [2, 4, 8, 16])),
                                 int(costs.get("context", 200)), int(costs.get("repeats", 15)))
    table.save(Path(costs.get("path", "data/costs/verify.json")))
    print(" ".join(f"v({n})={table.ratio(n):.2f}" for n in sorted(table.seconds)))
