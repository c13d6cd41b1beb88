"""Stage `bench`'s work: every method side by side on the held-out test prompts, greedy and
sampling, in one process: `ar` (twice: the A/A noise floor); `sd` at its best fixed γ; `mcsd`
and `ti-mcsd` static and `static-tree`, the replay's best static shape (each mode's own: the
greedy replay's, the sampled replay's); the dynamic trees (method `tree`): `tree+confidence`
(EAGLE-2-style, the draft's path confidence) and `tree+stop_model` (the exported winner, the
policy the pipeline ships), each with the rule the replay tuned, and `tree+stop_model+lookup`,
the winner's tree with the prompt-lookup chain as one more source (`decoder.dynamic`): the
exported policy in a mode where its file adds the chain (`export.settle`), which the summary's
`winner` then names, beside `tree+confidence+lookup`, the confidence tree with the same chain
cut by the same lookup model; the level-wise stop on `ti-mcsd` (the confidence threshold and each
exported model); the published lossy `ti-mcsd --lossy`, static (the models never saw lossy
rounds); and the peers on equal terms: a plain draft (`bench.assistant_draft`, else the default
draft where it is one) run by specstop's `sd` (`sd-compact`) and by transformers' assisted
generation with the same distribution, dynamic (its defaults) and static (`sd`'s γ), plus
transformers' prompt-lookup decoding beside specstop's own (`lookup`: the same n-gram size and
chain length). Every method is warmed up and the order rotates per prompt; ratios carry paired
bootstrap intervals (`bench.report`). Writes metrics/bench.json, a CSV per prompt, the results
table, plot data and PNGs.

The trees are those the decision models were trained for (params `collect`); `mcsd` and
`ti-mcsd` draft `ti-mcsd`'s best depth in the tree replay (`metrics/train.json`), `sd` the γ the
draft stage measured best (`metrics/draft.json`), `sd-compact` that draft's own best γ there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from specstop.common.errors import SpecstopError
from specstop.common.files import read_json, require
from specstop.common.params import (BENCH_METHODS, STOP_FAMILIES, BenchConfig, CollectConfig,
                                    CostsConfig, ModelsConfig)
from specstop.decoder.costs import measure_verify_costs
from specstop.decoder.loop import DecodeConfig
from specstop.decoder.policy import (ConfidenceThreshold, ConfidenceTree, FixedDepth,
                                     exported_lookup_branch)
from specstop.decoder.runtime import Runtime, decode_config
from specstop.decoder.stop_model import STATIC_KEYS, LearnedPolicy, load_stop_model
from specstop.decoder.tree_rule import TreeRule
from specstop.drafts.loading import (is_plain_draft, plain_assistant, require_draft, runtime_from,
                                     with_draft)
from specstop.drafts.store import check_held_out
from specstop.evaluation.side_by_side import Method, bench_methods, decoder_method
from specstop.models.export import WINNER_FILE
from specstop.prompts.splits import interleave, read_split

from . import report
from .hf_assisted import (PROMPT_LOOKUP_NGRAM, assisted_method, dynamic_settings,
                          prompt_lookup_method, static_settings)

DEFAULT_GAMMA = 4
SAME_DRAFT_SD = "sd-compact"


@dataclass(frozen=True)
class Plan:
    """What the methods are made of, resolved from the earlier stages' outputs."""

    sd_gamma: int
    static_gamma: int
    confidence: float
    winner: LearnedPolicy
    families: dict[str, LearnedPolicy]  # the other exported families
    confidence_tree: TreeRule  # the EAGLE-2-style tree's tuned rule (the draft's confidence)
    static_tree: dict[str, dict]  # mode -> its replay's best static shape: {"widths": [...],
    # "depth": d} (greedy: on the greedy rounds; sampling: on the sampled ones)
    simulated: dict[str, dict[str, float]]  # mode -> method -> simulated speedup on val
    peer_draft: str | None  # the plain draft specstop and transformers both run
    peer_note: str  # what it is, or why there is none
    peer_gamma: int  # its `sd` γ, and transformers' static num_assistant_tokens


@dataclass(frozen=True)
class Peers:
    """The same-draft rows: specstop's `sd` on the peer draft and transformers' assistant."""

    runtime: Runtime  # the runtime whose drafter is the peer draft
    assistant: torch.nn.Module
    dynamic: dict  # transformers' dynamic speculation settings for it, as loaded
    sd_name: str  # `sd` itself where the peer draft is the default one, else SAME_DRAFT_SD


def run(config: BenchConfig, models: ModelsConfig, collect: CollectConfig,
        costs: CostsConfig) -> dict:
    """Every method on the test prompts, greedy then sampling; writes the metrics and plots and
    returns bench.json's content."""
    from transformers.utils import logging

    logging.set_verbosity_error()  # assisted generation's own deprecation notices
    plan = _plan(config, models)  # every input of the earlier stages first, then the models
    _check_method_names(config, plan)
    test = _test_split(config)
    require_draft(models.draft)
    check_held_out(models.draft, test["prompt_id"], f"bench: the test prompts of "
                   f"{config.prompt_dir}")
    runtime = runtime_from(models, costs, need_draft=True)
    prompts = [runtime.encode(t, chat=False, special_tokens=False) for t in test["text"]]
    peers = _peers(runtime, plan, models)
    if peers is None:
        print(f"bench: no transformers assisted-generation peer: {plan.peer_note}")
    tree, results = _base_config(config, collect, 0.0), {}
    modes = {"greedy": (0.0, config.methods),
             "sampling": (config.temperature, config.sampling_methods)}
    winners = {mode: report.EXPORTED_LOOKUP
               if exported_lookup_branch(plan.winner, mode == "greedy") else report.EXPORTED
               for mode in modes}  # the method that decodes the file its own way, by mode
    for mode, (temperature, chosen) in modes.items():
        methods = _methods(runtime, _base_config(config, collect, temperature), plan, peers,
                           config.prompt_lookup_tokens)
        methods = [m for m in methods if chosen is None or m.name in {report.AR, *chosen}]
        if len(methods) > 1 or mode == "greedy":
            results[mode] = bench_methods(runtime, prompts, methods, config.seed,
                                          progress=f"bench {mode}", divergence=mode == "greedy")
    setup = {"prompts": len(prompts), "max_new_tokens": config.max_new_tokens,
             "temperature": config.temperature, "target": models.target, "draft": models.draft,
             "dtype": str(runtime.target.dtype),
             "device": str(runtime.target.device), "threads": torch.get_num_threads(),
             "ti_width": tree.ti_width, "max_depth": tree.max_depth,
             "sd_gamma": plan.sd_gamma, "static_gamma": plan.static_gamma,
             "confidence_threshold": plan.confidence, "winner": plan.winner.meta["family"],
             "winner_rule": plan.winner.rule,
             "winner_fallback": plan.winner.meta.get("fallback"),  # "ar": its tree never drafts
             "static_tree": plan.static_tree,  # `static-tree`'s shape by mode
             "winner_static_tree": {mode: plan.winner.meta.get(STATIC_KEYS[mode == "greedy"])
                                    for mode in ("greedy", "sampling")},  # decoded instead
             # of its tree (null: none)
             "winner_method": winners,  # by mode: with the lookup branch where the file adds it
             "methods": config.methods,
             "sampling_methods": config.sampling_methods,
             "order": "warm-up decode per method, then the method order rotated per prompt",
             "peers": _peer_setup(plan, peers, config.prompt_lookup_tokens)}
    latency = _latency(runtime, plan, tree.ti_width)
    inputs = report.Inputs(results, test["prompt_id"], test["source"],
                           None if peers is None else peers.sd_name, plan.simulated,
                           config.bootstrap_resamples, config.seed, winners)
    metrics = report.write(inputs, setup, latency, config.metrics, config.plots)
    print(report.table(metrics))
    print(f"bench: metrics in {config.metrics}, per-prompt CSV, results table and plots in "
          f"{config.plots}")
    return metrics


def _peer_setup(plan: Plan, peers: Peers | None, lookup_tokens: int) -> dict:
    """Every peer's settings, as run."""
    lookup = {"prompt_lookup_num_tokens": lookup_tokens,
              "max_matching_ngram_size": PROMPT_LOOKUP_NGRAM}
    if peers is None:
        return {"hf-assisted": {"skipped": plan.peer_note}, "hf-prompt-lookup": lookup}
    return {"draft": plan.peer_note, "same_draft_sd": peers.sd_name, "sd_gamma": plan.peer_gamma,
            "vocabulary": "the draft's pruned vocabulary enforced (logits -inf outside it)",
            "hf-assisted": peers.dynamic,
            "hf-assisted-static": static_settings(plan.peer_gamma), "hf-prompt-lookup": lookup}


def _check_method_names(config: BenchConfig, plan: Plan) -> None:
    """The schema knows every name (BENCH_METHODS); here a family's must name an exported one
    beside the winner (the winner's is `+stop_model`)."""
    known = [m for m in BENCH_METHODS
             if m.partition("+")[2] not in STOP_FAMILIES or m.partition("+")[2] in plan.families]
    for key in ("methods", "sampling_methods"):
        unknown = [name for name in getattr(config, key) or () if name not in known]
        if unknown:
            raise SpecstopError(f"bench.{key}: unknown method '{unknown[0]}' "
                                f"(known: {', '.join(known)})")


def _test_split(config: BenchConfig) -> dict[str, list[str]]:
    """`prompts` test prompts (already chat-rendered), their ids and sources: one from each
    source in turn, in file order within a source, so every domain is represented."""
    table = read_split(config.prompt_dir, "test", ("prompt_id", "text", "source"))
    chosen = interleave(table["source"])[: config.prompts]
    if not chosen:
        raise SpecstopError(f"{config.prompt_dir / 'test.parquet'}: no test prompt")
    return {column: [values[i] for i in chosen] for column, values in table.items()}


def _plan(config: BenchConfig, models: ModelsConfig) -> Plan:
    summary = read_json(config.train / "summary.json", "train")
    train = read_json(config.train_metrics, "train")
    require(config.export / WINNER_FILE, "export")
    draft = read_json(config.draft_metrics, "draft") if config.draft_metrics.exists() else {}
    trees = train["replay"]["policies"]
    ti_static = trees.get("static_ti_mcsd", {})  # ti-mcsd's own best depth in the tree replay
    static_gamma = int(ti_static.get("depth") or summary.get("best_fixed_gamma") or DEFAULT_GAMMA)
    sd_gamma = int(draft.get("gamma") or static_gamma)
    winner = load_stop_model(config.export / WINNER_FILE)
    family = winner.meta["family"]
    families = {f: load_stop_model(config.export / f"{f}.pt")
                for f in summary["families"] if f != family}
    simulated = {"ti-mcsd": ti_static.get("simulated_speedup",
                                          train["fixed"]["simulated_speedup"]),
                 "ti-mcsd+confidence": train["confidence"]["simulated_speedup"],
                 "ti-mcsd+stop_model": winner.meta["simulated_speedup"],
                 **{f"ti-mcsd+{f}": p.meta["simulated_speedup"] for f, p in families.items()},
                 "static-tree": trees["static_tree"]["simulated_speedup"],
                 report.CONFIDENCE_TREE: trees["confidence_tree"]["simulated_speedup"],
                 report.EXPORTED: _tree_speedup(winner.meta),
                 **{f"tree+{f}": _tree_speedup(p.meta) for f, p in families.items()},
                 **_lookup_speedups(train["replay"].get("lookup") or {}, family
                                    if winner.confidence_tree is None else "confidence_tree")}
    sampling = train["replay"].get("sampling") or {}
    sampled = sampling.get("policies", {})
    simulated_sampling = {"static-tree": sampled.get("static_tree", {}).get("simulated_speedup"),
                          report.EXPORTED: _tree_speedup(winner.meta, greedy=False),
                          **_lookup_speedups(sampling.get("lookup") or {}, family)}
    peer, note = _peer_draft(config.assistant_draft, models.draft)
    measured = draft.get("drafts", {}).get(Path(peer).name, {}) if peer else {}
    return Plan(sd_gamma=sd_gamma, static_gamma=static_gamma,
                confidence=_probability(train["confidence"]["parameter"]),
                winner=winner,
                families=families,
                confidence_tree=TreeRule.from_dict(summary["confidence_tree_rule"]),
                static_tree={mode: {"widths": shape["widths"], "depth": shape["depth"]}
                             for mode, shape in (("greedy", trees["static_tree"]),
                                                 ("sampling", sampled.get("static_tree")
                                                  or trees["static_tree"]))},
                simulated={"greedy": simulated, "sampling": simulated_sampling},
                peer_draft=peer, peer_note=note,
                peer_gamma=int(measured.get("best_gamma") or sd_gamma)
                if peer != models.draft else sd_gamma)


def _lookup_speedups(lookup: dict, exported: str) -> dict[str, float]:
    """The replayed speeds of `tree+stop_model+lookup` (`exported`: the winner's family, or
    the confidence tree where the file decodes that with the lookup chain),
    `tree+confidence+lookup` and `lookup` alone, where train replayed the logged chains
    (greedy, or sampled: `lookup` alone is replayed greedy only)."""
    out, policies = {}, lookup.get("policies", {})
    for method, name in ((report.EXPORTED_LOOKUP, exported),
                         (report.CONFIDENCE_LOOKUP, "confidence_tree")):
        if name in policies:
            out[method] = policies[name]["simulated_speedup"]
    if lookup.get("alone"):
        out[report.LOOKUP] = lookup["alone"]["simulated_speedup"]
    return out


def _tree_speedup(meta: dict, greedy: bool = True) -> float | None:
    """A stop model's replayed `tree` speed: the static shape's where it decodes one instead,
    else greedy its tree's behind its round gate (1 where it falls back to `ar`), sampled its
    sampling rule's."""
    static = meta.get(STATIC_KEYS[greedy])
    if static:
        return static["speedup"]
    if not greedy:
        return meta.get("sampling_tree_speedup")
    return meta.get("gated_speedup") or meta["tree_speedup"]


def _probability(threshold: float) -> float:
    """A tuned threshold on a probability in [0, 1]: the replay's -inf (never stop) and +inf
    (stop after one level) are 0 and 1 for the draft's probability of its own token (> 0)."""
    return min(max(float(threshold), 0.0), 1.0)


def _peer_draft(preferred: str | None, default: str) -> tuple[str | None, str]:
    """(the plain draft both runtimes run, what it is): `preferred` where it is a finished
    model folder, else the default draft where transformers can drive it; None and why else."""
    if preferred is not None and (Path(preferred) / "config.json").is_file():
        return preferred, preferred
    if is_plain_draft(default):
        return default, default
    why = ("bench.assistant_draft is not set" if preferred is None
           else f"'{preferred}' is not a finished model folder")
    return None, (f"'{default}' is a feature-conditioned head, which transformers cannot use "
                  f"as an assistant, and {why}")


def _peers(runtime: Runtime, plan: Plan, models: ModelsConfig) -> Peers | None:
    if plan.peer_draft is None:
        return None
    assistant = plain_assistant(plan.peer_draft, runtime, models.target_cache)
    dynamic = dynamic_settings(assistant)
    if plan.peer_draft == models.draft:
        return Peers(runtime, assistant, dynamic, "sd")
    return Peers(with_draft(plan.peer_draft, runtime, models.target_cache), assistant, dynamic,
                 SAME_DRAFT_SD)


def _base_config(config: BenchConfig, collect: CollectConfig, temperature: float) -> DecodeConfig:
    """The collect stage's trees with the bench's budget and sampling."""
    tree = collect.model_copy(update={"max_new_tokens": config.max_new_tokens,
                                      "temperature": temperature, "top_p": config.top_p,
                                      "lossy": False})
    return decode_config(tree, "ar")


def _methods(runtime: Runtime, base: DecodeConfig, plan: Plan, peers: Peers | None,
             lookup_tokens: int) -> list[Method]:
    def cfg(method: str, **changes) -> DecodeConfig:
        return dataclasses.replace(base, method=method, **changes)

    ti = cfg("ti-mcsd")
    shape = plan.static_tree["greedy" if base.sampling.greedy else "sampling"]  # this mode's
    static_tree = cfg("mcsd", mcsd_branching=tuple(shape["widths"]),
                      max_depth=max(base.max_depth, shape["depth"]))
    sd = cfg("sd", max_depth=max(base.max_depth, plan.sd_gamma))
    lookup_options = {"max_depth": max(base.max_depth, lookup_tokens),
                      "lookup_ngram": PROMPT_LOOKUP_NGRAM}
    methods = [
        decoder_method(runtime, base, None, report.AR),
        decoder_method(runtime, base, None, report.AA),
        decoder_method(runtime, sd, FixedDepth(plan.sd_gamma), report.SD),
        decoder_method(runtime, cfg("mcsd"), FixedDepth(plan.static_gamma), "mcsd"),
        decoder_method(runtime, ti, FixedDepth(plan.static_gamma), "ti-mcsd"),
        decoder_method(runtime, ti, ConfidenceThreshold(plan.confidence), "ti-mcsd+confidence"),
        *[decoder_method(runtime, ti, p, f"ti-mcsd+{f}") for f, p in plan.families.items()],
        decoder_method(runtime, ti, plan.winner, "ti-mcsd+stop_model"),
        decoder_method(runtime, static_tree, FixedDepth(shape["depth"]), "static-tree"),
        decoder_method(runtime, cfg("tree"), ConfidenceTree(plan.confidence_tree),
                       report.CONFIDENCE_TREE),
        *[decoder_method(runtime, cfg("tree"), p, f"tree+{f}") for f, p in plan.families.items()],
        decoder_method(runtime, cfg("tree"), plan.winner, report.EXPORTED),
        decoder_method(runtime, cfg("tree", lookup_branch=True, **lookup_options),
                       ConfidenceTree(plan.confidence_tree, lookup_model=plan.winner.lookup_model),
                       report.CONFIDENCE_LOOKUP),
        decoder_method(runtime, cfg("tree", lookup_branch=True, **lookup_options), plan.winner,
                       report.EXPORTED_LOOKUP),
        decoder_method(runtime, cfg("ti-mcsd", lossy=True), FixedDepth(plan.static_gamma),
                       "ti-mcsd-lossy"),  # static: the models never saw lossy rounds
    ]
    if peers is not None:
        if peers.sd_name != "sd":
            peer_sd = cfg("sd", max_depth=max(base.max_depth, plan.peer_gamma))
            methods.append(decoder_method(peers.runtime, peer_sd, FixedDepth(plan.peer_gamma),
                                          peers.sd_name))
        methods += [assisted_method(runtime, peers.assistant, base, peers.dynamic, "hf-assisted"),
                    assisted_method(runtime, peers.assistant, base,
                                    static_settings(plan.peer_gamma), "hf-assisted-static")]
    return methods + [decoder_method(runtime, cfg("lookup", **lookup_options),
                                     FixedDepth(lookup_tokens), report.LOOKUP),
                      prompt_lookup_method(runtime, base, lookup_tokens)]


def _latency(runtime: Runtime, plan: Plan, width: int) -> dict:
    """A draft step (1 and `width` tokens, median after a context of up to 200 tokens) beside
    the mean time per decision of each decision model the runs used."""
    draft = measure_verify_costs(runtime.draft, "draft", [width],
                                 context=min(200, runtime.context_limit // 2), repeats=10)
    policies = {name: p for name, p in {"stop_model": plan.winner, **plan.families}.items()
                if p.calls}  # the ones the timed methods ran
    return {"draft_step_ms": {str(n): s * 1e3 for n, s in draft.seconds.items()},
            "decision_ms": {name: p.seconds / max(p.calls, 1) * 1e3
                            for name, p in policies.items()},
            "decisions": {name: p.calls for name, p in policies.items()}}
