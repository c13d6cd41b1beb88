"""Stage `prepare`: de-quantise the embedded target once and measure its verification costs."""

from __future__ import annotations

from specstop.common.params import Params
from specstop.decoder.costs import measure_verify_costs
from specstop.decoder.kernels import pack_linears
from specstop.decoder.kv import KVModel, captures
from specstop.decoder.load import convert_embedded, load_model, resolve_device, resolve_dtype


def run(params: Params) -> dict:
    models, costs = params.models, params.costs
    if models.target == "embedded":
        convert_embedded(models.target_cache)
    device = resolve_device(models.device)
    dtype = resolve_dtype(models.dtype, device)
    captured = captures(models.compile, device, models.cpu_kernel)
    model = load_model(models.target, dtype, device, models.target_cache).model
    lm = KVModel(pack_linears(model, models.cpu_kernel))
    if captured:  # measured as the runtime will decode
        lm.capture()
    table = measure_verify_costs(lm, models.target, costs.widths, costs.context, costs.repeats)
    table.save(costs.path)
    print(f"{table.dtype} on {table.device} ({table.kernel}): "
          + " ".join(f"v({n})={table.curve.at(n):.2f}" for n in sorted(table.seconds)))
    return {"widths": len(table.seconds), "repeats": costs.repeats,
            "step_ms": round(1000 * table.curve.step, 2), "dtype": table.dtype}
