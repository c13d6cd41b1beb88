"""Stage `export`: every trained decision model as TorchScript, the winner registered
(`specstop.models.export`)."""

from __future__ import annotations

import functools
import time

from specstop.common.errors import SpecstopError
from specstop.common.params import Params
from specstop.decoder.runtime import decode_config
from specstop.drafts.loading import require_draft, runtime_from
from specstop.models.export import WINNER_FILE, export
from specstop.models.settle import Decoding, DecodingSource
from specstop.prompts.splits import interleave, read_split


def run(params: Params) -> dict:
    config = params.export
    start = time.perf_counter()
    decoding = _decoding(params) if config.costs is None and config.settle.decodes else None
    metrics = export(config, params.mlflow.store("train"), decoding)
    print(table(metrics))
    for mode, settled in (metrics["settled"] or {}).items():
        ratios = "; ".join(f"the {way} at {ratio['ratio']:.3f}x (95% CI "
                           f"{_interval(ratio['ci95'])})"
                           for way, ratio in settled["vs_replay"].items())
        print(f"export: settled {mode} on {settled['prompts']} val prompts, against the "
              f"replay's choice, the {settled['replay_decodes']}: {ratios}; so it decodes the "
              f"{settled['decodes']}")
    print(f"export: {time.perf_counter() - start:.0f} s; {config.out / WINNER_FILE} "
          f"({metrics['winner']}), registered as {metrics['registered_model']} version "
          f"{metrics['model_version']}; metrics in {config.metrics}")
    return {"families": len(metrics["families"]), "winner": metrics["winner"],
            "settled": {mode: s["decodes"] for mode, s in (metrics["settled"] or {}).items()}}


def table(metrics: dict) -> str:
    rows = [f"{'family':12}{'rule':>12}{'sim. speedup':>14}{'max |diff|':>12}{'ms/decision':>13}"]
    for family, m in metrics["families"].items():
        mark = "  <- winner" if family == metrics["winner"] else ""
        rows.append(f"{family:12}{m['rule']:>12}{m['simulated_speedup']:>14.4f}"
                    f"{m['max_abs_diff']:>12.2e}{m['decision_latency_ms']:>13.4f}{mark}")
    return "\n".join(rows)


def _decoding(params: Params) -> DecodingSource:
    """What the settle decodes with: `collect`'s trees and lookup chains at `export.settle`'s
    budget on the first val prompts of `collect.prompts`, the sources in turn; the models load
    only where a mode is contested."""
    settle, collect = params.export.settle, params.collect

    @functools.cache  # read once: checked before any work, decoded after it
    def texts() -> list[str]:
        table = read_split(collect.prompts, "val", ("text", "source"))
        chosen = [table["text"][i] for i in interleave(table["source"])[: settle.prompts]]
        if not chosen:
            raise SpecstopError(f"{collect.prompts / 'val.parquet'}: no val prompt to settle on")
        return chosen

    def check() -> None:
        texts()
        require_draft(params.models.draft)

    def load() -> Decoding:
        runtime = runtime_from(params.models, params.costs, need_draft=True)
        tree = collect.model_copy(update={"max_new_tokens": settle.max_new_tokens,
                                          "temperature": 0.0, "lossy": False})
        return Decoding(runtime, [runtime.encode(t, chat=False, special_tokens=False)
                                  for t in texts()], decode_config(tree, "tree"),
                        collect.lookup_tokens, settle.seed)
    return DecodingSource(check, load)


def _interval(ci95: list[float] | None) -> str:
    return "-" if ci95 is None else f"{ci95[0]:.3f}-{ci95[1]:.3f}"
