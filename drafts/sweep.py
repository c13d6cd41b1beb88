"""The draft sweep (stage `draft`): build, distil and compare drafts; the fastest is the default.

1. The target answers the train prompts (mixed by source as `domains` says) at each corpus
   temperature, and the val and held-out prompts greedily: `drafts.corpus`.
2. Each sweep entry (family x layers x vocabulary x fusion) is built from the target and
   distilled (`drafts.distill`, Lightning + MLflow, resumable); a finished draft folder is not
   redone; its greedy agreement alpha is taken on the val responses per source, on as many
   train responses and on the held-out sources' (another kind of request) per source.
3. Each draft is measured side by side with `ar` in the runtime dtype: alpha, step cost ratio
   c, the `sd` speedup predicted from alpha, c and the measured verification cost, and the
   `sd` speedup and acceptance per drafted level measured at the best γ.
4. The draft with the best measured speedup is copied to `out/default`; metrics/draft.json and
   the DVC plot data describe the sweep; a best draft slower than `ar` ends with a warning.

Corpora and drafts made with other settings are moved to `out/stale/`, never deleted.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import torch

from specstop.common.errors import SpecstopError
from specstop.common.files import resume_or_set_aside, write_atomic, write_json
from specstop.common.params import (DraftConfig, DraftSpec, DraftTrainConfig, ModelsConfig,
                                    TrackingStore)
from specstop.common.tracking import check, mark_model_training, tracking_uri
from specstop.decoder.costs import CostCurve, VerifyCosts, measure_verify_costs
from specstop.decoder.load import cpu_has_bf16, load_model, resolve_device, resolve_dtype
from specstop.decoder.loop import DecodeConfig
from specstop.evaluation.side_by_side import bench
from specstop.prompts.splits import HELD_OUT, read_split

from .corpus import RESPONSE, Sequence, build_corpus, corpus_timing, token_counts
from .distill import DraftDistiller, fit, greedy_agreement, read_curve, resolve_precision
from .families import (LAST_LAYER, build_compact, build_feature_head, fusion_layers,
                       most_frequent_tokens)
from .loading import load_runtime
from .store import read_meta, save_draft
from .text_corpus import build_text_corpus

STALE = "stale"  # corpora and drafts made with other settings are moved here, never deleted


def run(cfg: DraftConfig, models: ModelsConfig, tracking: TrackingStore) -> dict:
    """The whole sweep: corpora, each draft distilled (or resumed), measured, the best published;
    returns what it achieved (corpus tokens, drafts, the winner's alpha and speedup)."""
    out, seed = cfg.out, cfg.seed
    device = resolve_device(models.device)
    dtype = resolve_dtype(models.dtype, device)
    check(tracking_uri(tracking.uri))  # before the corpus, not after
    val_prompts = draft_prompts(cfg.prompts, "val", cfg.max_prompts, None)
    train_prompts = draft_prompts(cfg.prompts, "draft", cfg.max_prompts, cfg.domains)
    held_out = held_out_prompts(cfg.prompts)
    train_config = cfg.train.model_copy(
        update={"precision": resolve_precision(cfg.train.precision, device)})
    target = load_model(models.target, dtype, device, models.target_cache)
    layers = corpus_layers(cfg.sweep, target.model.config.num_hidden_layers)
    train, val, held = _corpora(cfg, train_prompts["text"], val_prompts["text"],
                                held_out["text"], target, layers, out)
    counts = token_counts(train, target.model.config.vocab_size)
    del target
    measured_on = {"alpha_by_domain": by_source(val, val_prompts["source"]),
                   "alpha_heldout": by_source(held, held_out["source"])}

    for spec in cfg.sweep:
        folder = out / "sweep" / spec.name
        config = train_config if spec.max_minutes is None else train_config.model_copy(
            update={"max_minutes": spec.max_minutes})
        recipe = {"spec": spec.model_dump(), "train": config.model_dump(),
                  "corpus": cfg.corpus.model_dump(), "max_prompts": cfg.max_prompts,
                  "target": models.target, "seed": seed,
                  "trained_on_prompts": train_prompts["prompt_id"]}
        if resume_or_set_aside(folder, recipe, out / STALE, f"draft: {folder}") \
                and read_meta(folder) is not None:
            continue  # finished with these settings
        _distil(spec, models, device, counts, train, val, layers, measured_on,
                train_prompts["prompt_id"], folder, config, tracking, seed)

    results = {spec.name: _measure(spec, out / "sweep" / spec.name, cfg, models)
               for spec in cfg.sweep}
    winner = max(results, key=lambda name: results[name]["measured_speedup"])
    _publish(out / "sweep" / winner, out / "default")
    best = results[winner]
    warning = _useless_draft_warning(best, train_config.precision)
    corpus = _corpus_summary(out / "corpus", cfg.corpus.text.tokens > 0, bool(held))
    write_json(cfg.metrics,
               {"alpha": best["alpha"], "alpha_by_domain": best["alpha_by_domain"],
                "alpha_heldout": best["alpha_heldout"], "train_alpha": best["train_alpha"],
                "c": best["c"], "default": winner,
                "sd_speedup": best["measured_speedup"], "sd_acceptance": best["sd_acceptance"],
                "sd_acceptance_by_level": best["sd_acceptance_by_level"],
                "gamma": best["best_gamma"], "corpus": corpus,
                "precision": train_config.precision, "dtype": best["dtype"],
                "cpu_native_bf16": cpu_has_bf16(), "warning": warning, "drafts": results})
    _write_plots(cfg.plots, results, out / "sweep")
    print(_table(results, winner))
    if warning:
        print(f"specstop: warning: {warning}", file=sys.stderr)
    return {"corpus_response_tokens": sum(c["response_tokens"] for c in corpus.values()),
            "drafts": len(results),
            "tokens_seen": sum(r["tokens_seen"] or 0 for r in results.values()),
            "winner": winner, "alpha": best["alpha"], "sd_speedup": best["measured_speedup"]}


def _useless_draft_warning(best: dict, precision: str) -> str | None:
    """A line naming the likely cause when even the best draft makes decoding slower than `ar`."""
    if best["measured_speedup"] >= 1.0:
        return None
    return (f"the best draft ({best['name']}) decodes at {best['measured_speedup']:.2f}x `ar` "
            f"(slower): alpha {best['alpha']:.3f}, c {best['c']:.3f}, {best['dtype']} on "
            f"{'a CPU with' if cpu_has_bf16() else 'a CPU without'} native bf16, trained in "
            f"{precision}; likely cause: {_likely_cause(best)}")


def _likely_cause(best: dict) -> str:
    if best["alpha"] < 0.45:
        return "too little training (raise draft.train.max_minutes or the corpus)"
    if best["dtype"] == "float32":
        return "fp32 verification (a pass over several tokens costs far more than one step here)"
    return f"a draft step too slow for its acceptance (c {best['c']:.3f})"


def draft_prompts(folder: Path, split: str, cap: int | None,
                  domains: dict[str, float] | None) -> dict[str, list[str]]:
    """The split's ids, texts and sources: its first `cap` (the sources interleaved), or with
    `domains` round(cap * fraction) of each named source's first ones."""
    rows = read_split(folder, split, ("prompt_id", "text", "source"))
    if not rows["text"]:
        raise SpecstopError(f"{folder}: the draft needs draft and val prompts ({split} is empty)")
    if domains is None:
        return {k: v[:cap] for k, v in rows.items()}
    unknown = sorted(set(domains) - set(rows["source"]))
    if unknown:
        raise SpecstopError(f"draft.domains: no {split} prompts from source '{unknown[0]}' in "
                            f"{folder} (sources: {', '.join(sorted(set(rows['source'])))})")
    cap = cap or len(rows["text"])
    keep = []
    for name, share in domains.items():
        of_source = [i for i, source in enumerate(rows["source"]) if source == name]
        keep += of_source[: round(cap * share)]
    return {k: [v[i] for i in sorted(keep)] for k, v in rows.items()}


def held_out_prompts(folder: Path) -> dict[str, list[str]]:
    """The `heldout` split's texts and sources (none where the prompts stage wrote no such file:
    a folder from before it)."""
    if not (Path(folder) / f"{HELD_OUT}.parquet").is_file():
        return {"text": [], "source": []}
    return read_split(folder, HELD_OUT, ("text", "source"))


def by_source(sequences: list[Sequence], sources: list[str]) -> dict[str, list[Sequence]]:
    """Responses grouped by their prompt's source (`sources[prompt_index]`), names sorted."""
    return {name: [s for s in sequences if sources[s.prompt_index] == name]
            for name in sorted(set(sources))}


def corpus_layers(sweep: list[DraftSpec], num_layers: int) -> tuple[int, ...]:
    """The target's hidden-state layers the corpus keeps: the fused heads' and the last (-1)."""
    fused = fusion_layers(num_layers) if any(spec.fuse for spec in sweep) else ()
    return (*fused, *LAST_LAYER)


def _corpora(cfg: DraftConfig, train_texts: list[str], val_texts: list[str],
             held_texts: list[str], target, layers: tuple[int, ...],
             out: Path) -> tuple[list[Sequence], list[Sequence], list[Sequence]]:
    """Train responses (at every corpus temperature) and teacher-forced text (`text`, where
    on); val and held-out responses (greedy; none without held-out prompts)."""
    greedy = cfg.corpus.model_copy(update={"temperatures": [0.0]})
    val = build_corpus(target.model, target.tokenizer, val_texts, out / "corpus" / "val",
                       greedy, layers, cfg.seed, "val responses", out / STALE)
    held = build_corpus(target.model, target.tokenizer, held_texts, out / "corpus" / HELD_OUT,
                        greedy, layers, cfg.seed, "held-out responses", out / STALE) \
        if held_texts else []
    train = build_corpus(target.model, target.tokenizer, train_texts, out / "corpus" / "train",
                         cfg.corpus, layers, cfg.seed, "train responses", out / STALE)
    text = cfg.corpus.text
    if text.tokens:
        train += build_text_corpus(target.model, target.tokenizer, text, cfg.corpus.top_k,
                                   out / "corpus" / "text", layers, cfg.seed, out / STALE)
    return train, val, held


def _corpus_summary(folder: Path, text: bool, held_out: bool) -> dict:
    """Per corpus (train, val, and the held-out responses and teacher-forced text where there
    are any): sequences, tokens and the labelling's tokens/s (`corpus_timing`)."""
    splits = ("train", "val") + ((HELD_OUT,) if held_out else ()) + (("text",) if text else ())
    return {split: corpus_timing(folder / split) for split in splits}


def _distil(spec: DraftSpec, models: ModelsConfig, device: torch.device, counts: torch.Tensor,
            train: list[Sequence], val: list[Sequence], layers: tuple[int, ...],
            measured_on: dict[str, dict[str, list[Sequence]]], trained_on: list[str],
            folder: Path, config: DraftTrainConfig, tracking: TrackingStore, seed: int) -> None:
    """Build one draft from an fp32 copy of the target, distil it, save the folder with its
    alpha per group of `measured_on` (key -> source -> responses: val per source, held-out per
    source), its alpha on (as many) greedy train responses and the ids of the prompts it
    learned from (`store.check_held_out`)."""
    target = load_model(models.target, torch.float32, device, models.target_cache)
    eos = target.tokenizer.eos_token_id
    vocab_ids = None if not spec.vocab else most_frequent_tokens(
        counts, spec.vocab, [eos] if eos is not None else [])
    torch.manual_seed(config.seed)  # the fresh layers' initialisation, whatever ran before
    if spec.family == "feature":
        draft = build_feature_head(target.model, spec.layers, vocab_ids, spec.fuse)
    else:
        draft = build_compact(target.model, spec.layers, vocab_ids)
    draft = draft.float().train()
    module = DraftDistiller(draft, spec.family, vocab_ids, target.model.config.vocab_size,
                            config, layers)
    logger = _mlflow_logger(tracking, spec, folder)
    start = time.perf_counter()
    metrics = fit(module, train, val, folder, logger)
    draft.eval()
    alphas = {key: {name: greedy_agreement(module, sequences, config.batch_size)
                    for name, sequences in groups.items()}
              for key, groups in measured_on.items()}
    greedy_train = [s for s in train if s.source == RESPONSE and s.temperature == 0][: len(val)]
    info = {"name": spec.name, "layers": spec.layers, "train_metrics": metrics,
            **alphas,
            "train_alpha": greedy_agreement(module, greedy_train, config.batch_size),
            "train_seconds_last_run": round(time.perf_counter() - start, 1),
            "train_sequences": len(train),
            "train_tokens": int(sum(s.ids.shape[0] for s in train)), "seed": seed,
            "trained_on_prompts": trained_on}
    save_draft(folder, draft, spec.family, target.model, vocab_ids, info,
               tokenizer=target.tokenizer)
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)


def _mlflow_logger(tracking: TrackingStore, spec: DraftSpec, folder: Path):
    """An MLflow logger in the project's tracking store, continuing this draft's run on resume."""
    from pytorch_lightning.loggers import MLFlowLogger

    uri = tracking_uri(tracking.uri)
    run_file = folder / "mlflow_run_id"
    run_id = run_file.read_text().strip() if run_file.is_file() else None
    if run_id is not None and not _run_exists(uri, run_id):
        run_id = None  # the store was reset: log the resumed training as a new run
    logger = MLFlowLogger(experiment_name=tracking.experiment,
                          tracking_uri=uri, run_name=spec.name, run_id=run_id)
    mark_model_training(uri, logger.experiment_id)
    folder.mkdir(parents=True, exist_ok=True)
    logger.log_hyperparams({"family": spec.family, "layers": spec.layers,
                            "vocab": spec.vocab or "full"} if run_id is None else {})
    write_atomic(run_file, lambda tmp: tmp.write_text(logger.run_id))
    return logger


def _run_exists(uri: str, run_id: str) -> bool:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        MlflowClient(uri).get_run(run_id)
    except MlflowException:
        return False
    return True


def _measure(spec: DraftSpec, folder: Path, cfg: DraftConfig, models: ModelsConfig) -> dict:
    """alpha, c, predicted and measured `sd` speedup of one draft, beside `ar`, same dtype."""
    meta = read_meta(folder)
    alpha = float(meta["train_metrics"]["val_alpha"])
    runtime = load_runtime(models.target, str(folder), models.dtype, models.device,
                           models.target_cache, cpu_kernel=models.cpu_kernel,
                           compile=models.compile)
    target_costs = measure_verify_costs(runtime.target, "target", [], repeats=10)
    draft_costs = measure_verify_costs(runtime.draft, "draft", [], repeats=10)
    c = draft_costs.seconds[1] / target_costs.seconds[1]
    verify = (VerifyCosts.load(cfg.verify_costs).curve if cfg.verify_costs.is_file()
              else None)
    predicted = {g: _predicted_speedup(alpha, c, g, verify) for g in range(1, 9)}
    best_predicted = max(predicted, key=predicted.get)
    gammas = sorted(set(cfg.eval.gammas))
    texts = read_split(cfg.prompts, "val")["text"]
    prompts = [runtime.encode(t, chat=False, special_tokens=False)
               for t in texts[: cfg.eval.prompts]]
    tokens = cfg.eval.max_new_tokens
    configs = [DecodeConfig(method="ar", max_new_tokens=tokens)] + [
        DecodeConfig(method="sd", max_new_tokens=tokens, max_depth=g) for g in gammas]
    results = bench(runtime, prompts, configs, None, 0)
    ar = results[0].stats.tokens_per_s
    measured = {g: r.stats.tokens_per_s / ar for g, r in zip(gammas, results[1:])}
    best_gamma = max(measured, key=measured.get)
    best = results[1 + gammas.index(best_gamma)]
    curve = read_curve(folder / "curve.csv")
    return {"name": spec.name, "family": spec.family, "layers": spec.layers,
            "vocab": spec.vocab or "full", "fuse": spec.fuse, "alpha": alpha,
            "alpha_by_domain": meta.get("alpha_by_domain"),
            "alpha_heldout": meta.get("alpha_heldout"),
            "train_alpha": meta.get("train_alpha"), "c": c,
            "predicted_speedup": predicted[best_predicted],
            "predicted_gamma": best_predicted, "measured_speedup": measured[best_gamma],
            "best_gamma": best_gamma, "measured_by_gamma": measured,
            "sd_acceptance": best.stats.acceptance_rate,
            "sd_acceptance_by_level": acceptance_by_level(best.accepted_per_round, best_gamma),
            "identical_to_ar": f"{best.identical_to_ar}/{len(prompts)}",
            "ar_tokens_per_s": ar, "sd_tokens_per_s": best.stats.tokens_per_s,
            "train_seconds": curve[-1]["train_seconds"] if curve else None,
            "tokens_seen": int(curve[-1]["tokens_seen"]) if curve else None,
            "dtype": str(runtime.target.dtype).removeprefix("torch.")}


def acceptance_by_level(accepted_per_round: list[int], gamma: int) -> list[float | None]:
    """P(level k accepted | level k-1 accepted), k = 1..gamma, over rounds that drafted gamma
    levels and accepted `accepted_per_round` of them (None where no round reached level k-1)."""
    reached = [sum(a >= k for a in accepted_per_round) for k in range(gamma + 1)]
    return [reached[k] / reached[k - 1] if reached[k - 1] else None
            for k in range(1, gamma + 1)]


def _predicted_speedup(alpha: float, c: float, gamma: int, verify: CostCurve | None) -> float:
    """i.i.d. acceptance (Leviathan et al.): tokens per round over the round's cost in `ar`
    steps, gamma draft steps (c one-token target steps each) and a pass over gamma + 1 tokens
    as the decode loop pays them (`CostCurve.price`; 1 step each without a measured curve)."""
    tokens = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    if verify is None:
        return tokens / (gamma * c + 1.0)
    return tokens / (gamma * c / verify.padded(1)[1] + verify.price(gamma + 1))


def _publish(source: Path, dest: Path) -> None:
    """Copy the winning draft folder to `dest` atomically (copy beside it, then rename)."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("checkpoints", "lightning_logs"))
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)


def _write_plots(folder: Path, results: dict, sweep: Path) -> None:
    """DVC plot data: the sweep (alpha, c, predicted vs measured) and each learning curve
    (against seconds, and tokens seen in all, in responses and in teacher-forced text)."""
    rows = ["draft,alpha,c,predicted_speedup,measured_speedup"] + [
        f"{name},{r['alpha']:.4f},{r['c']:.4f},{r['predicted_speedup']:.4f},"
        f"{r['measured_speedup']:.4f}" for name, r in results.items()]
    write_atomic(folder / "sweep.csv", lambda tmp: tmp.write_text("\n".join(rows) + "\n"))
    curve = ["draft,step,train_seconds,sequences_seen,tokens_seen,response_tokens_seen,"
             "text_tokens_seen,val_alpha"]
    for name in results:
        curve += [f"{name},{int(r['step'])},{r['train_seconds']:.1f},{int(r['sequences_seen'])},"
                  f"{int(r['tokens_seen'])},{int(r['tokens_seen'] - r['text_tokens_seen'])},"
                  f"{int(r['text_tokens_seen'])},{r['val_alpha']:.4f}"
                  for r in read_curve(sweep / name / "curve.csv")]
    write_atomic(folder / "learning_curve.csv", lambda tmp: tmp.write_text("\n".join(curve) + "\n"))


def _table(results: dict, winner: str) -> str:
    lines = [f"{'draft':<22} {'alpha':>6} {'c':>6} {'pred':>6} {'meas':>6} {'gamma':>5}"]
    for name, r in results.items():
        mark = " *" if name == winner else ""
        lines.append(f"{name:<22} {r['alpha']:6.3f} {r['c']:6.3f} {r['predicted_speedup']:6.2f} "
                     f"{r['measured_speedup']:6.2f} {r['best_gamma']:5d}{mark}")
    return "\n".join(lines)
