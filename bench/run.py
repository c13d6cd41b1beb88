"""Stage `bench`'s work: every method side by side on the held-out test prompts, greedy and sampling,
in one process: `ar`; `sd` at its best fixed γ; `mcsd` and `ti-mcsd` static; `ti-mcsd` with the
confidence threshold and with each exported decision model (the winner from `stop_model.pt`);
the published lossy `ti-mcsd --lossy` with the winner; transformers' assisted generation with
the same target and a standalone draft.  Writes metrics/bench.json (`bench.report`), a CSV per
prompt, plot data and PNGs.

The trees are those the decision models were trained for (params `collect`); static methods
draft the best fixed γ of the replay (`data/train/summary.json`), `sd` the γ the draft stage
measured best (`metrics/draft.json`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specstop.common.errors import SpecstopError
from specstop.common.files import require
from specstop.common.params import BenchConfig, CollectConfig, CostsConfig, ModelsConfig
from specstop.decoder.costs import measure_verify_costs
from specstop.decoder.loop import DecodeConfig
from specstop.decoder.policy import ConfidenceThreshold, FixedDepth
from specstop.decoder.runtime import Runtime, decode_config
from specstop.decoder.stop_model import LearnedPolicy, load_stop_model
from specstop.drafts.loading import require_draft, runtime_from
from specstop.evaluation.side_by_side import Method, bench_methods, decoder_method
from specstop.models.export import WINNER_FILE
from specstop.prompts.splits import read_split

from . import report
from .hf_assisted import hf_method, load_assistant, speculation_settings

DEFAULT_GAMMA = 4


@dataclass(frozen=True)
class Plan:
    """What the methods are made of, resolved from the earlier stages' outputs."""

    sd_gamma: int
    static_gamma: int
    confidence: float
    winner: LearnedPolicy
    lossy_winner: LearnedPolicy
    families: dict[str, LearnedPolicy]  # the other exported families
    simulated: dict[str, float]  # method -> simulated speedup on val (greedy)


def run(config: BenchConfig, models: ModelsConfig, collect: CollectConfig,
        costs: CostsConfig) -> None:
    """Every method on the test prompts, greedy then sampling; writes the metrics and plots."""
    from transformers.utils import logging

    logging.set_verbosity_error()  # assisted generation's own deprecation notices
    plan = _plan(config)  # every input of the earlier stages first, then the models
    test = _test_split(config)
    require_draft(models.draft)
    runtime = runtime_from(models, costs, need_draft=True)
    prompts = [runtime.encode(t, chat=False, special_tokens=False) for t in test["text"]]
    prompt_ids = test["prompt_id"]
    assistant, assistant_note = load_assistant(runtime, config.assistant_draft, models.draft,
                                               models.target_cache)
    if assistant is None:
        print(f"bench: no transformers assisted-generation peer: {assistant_note}")
    tree, results = _base_config(config, collect, 0.0), {}
    for mode, temperature in (("greedy", 0.0), ("sampling", config.temperature)):
        methods = _methods(runtime, _base_config(config, collect, temperature), plan, assistant)
        results[mode] = bench_methods(runtime, prompts, methods, config.seed,
                                      progress=f"bench {mode}")
    setup = {"prompts": len(prompts), "max_new_tokens": config.max_new_tokens,
             "temperature": config.temperature, "target": models.target, "draft": models.draft,
             "dtype": str(runtime.target.dtype),
             "device": str(runtime.target.device), "threads": torch.get_num_threads(),
             "ti_width": tree.ti_width, "max_depth": tree.max_depth,
             "sd_gamma": plan.sd_gamma, "static_gamma": plan.static_gamma,
             "confidence_threshold": plan.confidence, "winner": plan.winner.meta["family"],
             "winner_rule": plan.winner.rule,
             "hf_assisted": ({"assistant": assistant_note, **speculation_settings(assistant)}
                             if assistant is not None else {"skipped": assistant_note})}
    latency = _latency(runtime, plan, tree.ti_width)
    metrics = report.write(results, prompt_ids, setup, latency, plan.simulated,
                                 config.metrics, config.plots)
    print(report.table(metrics))
    print(f"bench: metrics in {config.metrics}, per-prompt CSV and plots in {config.plots}")


def _test_split(config: BenchConfig) -> dict[str, list[str]]:
    """The first `prompts` test prompts (already chat-rendered) and their ids."""
    table = read_split(config.prompt_dir, "test")
    table = {column: values[: config.prompts] for column, values in table.items()}
    if not table["text"]:
        raise SpecstopError(f"{config.prompt_dir / 'test.parquet'}: no test prompt")
    return table


def _plan(config: BenchConfig) -> Plan:
    summary = _read_json(config.train / "summary.json", "train")
    train = _read_json(config.train_metrics, "train")
    require(config.export / WINNER_FILE, "export")
    draft = _read_json(config.draft_metrics, None) if config.draft_metrics.is_file() else {}
    static_gamma = int(summary.get("best_fixed_gamma") or DEFAULT_GAMMA)
    winner = load_stop_model(config.export / WINNER_FILE)
    family = winner.meta["family"]
    families = {f: load_stop_model(config.export / f"{f}.pt")
                for f in summary["families"] if f != family}
    simulated = {"ti-mcsd": train["fixed"]["simulated_speedup"],
                 "ti-mcsd+confidence": train["confidence"]["simulated_speedup"],
                 "ti-mcsd+stop_model": winner.meta["simulated_speedup"],
                 **{f"ti-mcsd+{f}": p.meta["simulated_speedup"] for f, p in families.items()}}
    return Plan(sd_gamma=int(draft.get("gamma") or static_gamma), static_gamma=static_gamma,
                confidence=float(train["confidence"]["parameter"]),
                winner=winner, lossy_winner=load_stop_model(config.export / WINNER_FILE),
                families=families, simulated=simulated)


def _read_json(path: Path, stage: str | None) -> dict:
    try:
        return json.loads(require(path, stage).read_text())
    except ValueError as err:
        raise SpecstopError(f"{path}: not valid JSON ({err})") from err


def _base_config(config: BenchConfig, collect: CollectConfig, temperature: float) -> DecodeConfig:
    """The collect stage's trees with the bench's budget and sampling."""
    tree = collect.model_copy(update={"max_new_tokens": config.max_new_tokens,
                                      "temperature": temperature, "top_p": config.top_p,
                                      "lossy": False})
    return decode_config(tree, "ar")


def _methods(runtime: Runtime, base: DecodeConfig, plan: Plan,
             assistant: torch.nn.Module | None) -> list[Method]:
    def cfg(method: str, **changes) -> DecodeConfig:
        return dataclasses.replace(base, method=method, **changes)

    ti = cfg("ti-mcsd")
    methods = [
        decoder_method(runtime, base, None, "ar"),
        decoder_method(runtime, cfg("sd", max_depth=max(base.max_depth, plan.sd_gamma)),
                       FixedDepth(plan.sd_gamma), "sd"),
        decoder_method(runtime, cfg("mcsd"), FixedDepth(plan.static_gamma), "mcsd"),
        decoder_method(runtime, ti, FixedDepth(plan.static_gamma), "ti-mcsd"),
        decoder_method(runtime, ti, ConfidenceThreshold(plan.confidence), "ti-mcsd+confidence"),
        *[decoder_method(runtime, ti, p, f"ti-mcsd+{f}") for f, p in plan.families.items()],
        decoder_method(runtime, ti, plan.winner, "ti-mcsd+stop_model"),
        decoder_method(runtime, cfg("ti-mcsd", lossy=True), plan.lossy_winner,
                       "ti-mcsd-lossy+stop_model"),
    ]
    if assistant is not None:
        methods.append(hf_method(runtime, assistant, base))
    return methods


def _latency(runtime: Runtime, plan: Plan, width: int) -> dict:
    """A draft step (1 and `width` tokens, median after a context of up to 200 tokens) beside
    each decision model's mean time per decision during the runs."""
    draft = measure_verify_costs(runtime.drafter.lm, "draft", [width],
                                 context=min(200, runtime.context_limit // 2), repeats=10)
    policies = {"stop_model": plan.winner, **plan.families}
    return {"draft_step_ms": {str(n): s * 1e3 for n, s in draft.seconds.items()},
            "decision_ms": {name: p.seconds / max(p.calls, 1) * 1e3
                            for name, p in policies.items()},
            "decisions": {name: p.calls for name, p in policies.items()}}
