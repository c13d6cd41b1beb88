"""Stage `draft`: build, distil and compare drafts for the target; the fastest becomes the default.

1. The target answers the train prompts (and, greedily, the val prompts): `models.draft_corpus`.
2. Each sweep entry (family x layers x vocabulary) is built from the target and distilled
   (`models.draft_train`, Lightning + MLflow, resumable); a finished draft folder is not redone.
3. Each draft is measured side by side with `ar` in the runtime dtype: greedy agreement alpha
   on the held-out responses, step cost ratio c, the `sd` speedup predicted from alpha, c and
   the measured verification cost, and the `sd` speedup measured at the best γ.
4. The draft with the best measured speedup is copied to `out/default`; metrics/draft.json and
   the DVC plot data describe the sweep.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import torch

from specstop.decoder.costs import VerifyCosts, measure_verify_costs
from specstop.decoder.draft_models import (build_compact, build_feature_head,
                                           most_frequent_tokens, read_meta, save_draft)
from specstop.common.errors import SpecstopError
from specstop.common.files import write_atomic, write_json
from specstop.decoder.loop import DecodeConfig
from specstop.decoder.models import load_model, resolve_device, resolve_dtype
from specstop.decoder.runtime import load_runtime
from specstop.models.draft_corpus import CorpusConfig, Sequence, build_corpus, token_counts
from specstop.models.draft_train import DraftDistiller, TrainConfig, fit, read_curve
from specstop.models.tracking import check, tracking_uri

from .bench_decode import bench
from .params import mlflow_settings, section
from .prompt_splits import read_split


@dataclasses.dataclass(frozen=True)
class DraftSpec:
    family: str  # compact | feature
    layers: int
    vocab: int  # output vocabulary size; 0 = the full vocabulary
    max_minutes: float | None = None  # overrides draft.train.max_minutes

    @property
    def name(self) -> str:
        return f"{self.family}-l{self.layers}-v{self.vocab or 'full'}"


def run(params: dict) -> None:
    cfg, models = section(params, "draft"), section(params, "models")
    out = Path(cfg.get("out", "data/draft"))
    specs = _specs(cfg.get("sweep", []))
    device = resolve_device(models.get("device", "auto"))
    dtype = resolve_dtype(str(models.get("dtype", "auto")), device)
    target_name, cache_dir = models.get("target", "embedded"), Path(models.get("cache_dir",
                                                                               "data/models/target"))
    seed = int(cfg.get("seed", 0))
    tracking = mlflow_settings(params, "draft")
    check(tracking_uri(tracking.get("tracking_uri")))  # before the corpus, not after
    train, val, vocab = _corpora(cfg, target_name, dtype, device, cache_dir, out, seed)
    counts = token_counts(train, vocab)

    train_config = TrainConfig(**cfg.get("train", {}))
    for spec in specs:
        folder = out / "sweep" / spec.name
        config = train_config if spec.max_minutes is None else dataclasses.replace(
            train_config, max_minutes=spec.max_minutes)
        recipe = {"spec": dataclasses.asdict(spec), "train": dataclasses.asdict(config),
                  "corpus": cfg.get("corpus", {}), "max_prompts": cfg.get("max_prompts"),
                  "target": target_name, "seed": seed}
        if _same_recipe(folder, recipe) and read_meta(folder) is not None:
            continue  # finished with these settings
        _distil(spec, target_name, cache_dir, device, counts, train, val, folder, config,
                tracking, seed)

    results = {spec.name: _measure(spec, out / "sweep" / spec.name, target_name, cfg, models)
               for spec in specs}
    winner = max(results, key=lambda name: results[name]["measured_speedup"])
    _publish(out / "sweep" / winner, out / "default")
    best = results[winner]
    write_json(Path(cfg.get("metrics", "metrics/draft.json")),
               {"alpha": best["alpha"], "c": best["c"], "default": winner,
                "sd_speedup": best["measured_speedup"], "gamma": best["best_gamma"],
                "drafts": results})
    _write_plots(Path(cfg.get("plots", "metrics/draft_plots")), results, out / "sweep")
    print(_table(results, winner))


def _specs(raw: list) -> list[DraftSpec]:
    if not raw:
        raise SpecstopError("params draft.sweep: give at least one {family, layers, vocab}")
    specs = []
    for i, entry in enumerate(raw):
        try:
            minutes = entry.get("max_minutes")
            spec = DraftSpec(str(entry["family"]), int(entry["layers"]), int(entry.get("vocab", 0)),
                             None if minutes is None else float(minutes))
        except (KeyError, TypeError, ValueError) as err:
            raise SpecstopError(f"params draft.sweep[{i}]: expected family, layers, vocab "
                                f"({err})") from err
        if spec.family not in ("compact", "feature") or spec.layers < 1:
            raise SpecstopError(f"params draft.sweep[{i}]: family must be compact or feature "
                                f"and layers >= 1")
        specs.append(spec)
    return specs


def _corpora(cfg: dict, target_name: str, dtype: torch.dtype, device: torch.device,
             cache_dir: Path, out: Path, seed: int) -> tuple[list[Sequence], list[Sequence], int]:
    """Train responses (sampled), held-out val responses (greedy), the target's vocabulary."""
    corpus = CorpusConfig(**cfg.get("corpus", {}))
    prompts_dir = Path(cfg.get("prompts", "data/prompts"))
    limit = cfg.get("max_prompts")
    target = load_model(target_name, dtype, device, cache_dir)
    val = build_corpus(target.model, target.tokenizer, read_split(prompts_dir, "val")["text"][:limit],
                       out / "corpus" / "val", dataclasses.replace(corpus, samples_per_prompt=1),
                       seed, "val responses")
    train = build_corpus(target.model, target.tokenizer, read_split(prompts_dir, "train")["text"][:limit],
                         out / "corpus" / "train", corpus, seed, "train responses")
    if not train or not val:
        raise SpecstopError(f"{prompts_dir}: the draft needs train and val prompts")
    return train, val, target.model.config.vocab_size


def _same_recipe(folder: Path, recipe: dict) -> bool:
    """True if `folder` was (or is being) trained with `recipe`; otherwise it is removed and
    the recipe recorded, so a checkpoint resumes only the same training."""
    path = folder / "recipe.json"
    same = path.is_file() and json.loads(path.read_text()) == json.loads(json.dumps(recipe))
    if not same:
        shutil.rmtree(folder, ignore_errors=True)
        write_json(path, recipe)
    return same


def _distil(spec: DraftSpec, target_name: str, cache_dir: Path, device: torch.device,
            counts: torch.Tensor, train: list[Sequence], val: list[Sequence], folder: Path,
            config: TrainConfig, tracking: dict, seed: int) -> None:
    """Build one draft from an fp32 copy of the target, distil it, save the folder."""
    target = load_model(target_name, torch.float32, device, cache_dir)
    eos = target.tokenizer.eos_token_id
    vocab_ids = None if not spec.vocab else most_frequent_tokens(
        counts, spec.vocab, [eos] if eos is not None else [])
    build = build_feature_head if spec.family == "feature" else build_compact
    draft = build(target.model, spec.layers, vocab_ids).float().train()
    module = DraftDistiller(draft, spec.family, vocab_ids, target.model.config.vocab_size, config)
    logger = _mlflow_logger(tracking, spec, folder)
    start = time.perf_counter()
    metrics = fit(module, train, val, folder, logger)
    draft.eval()
    info = {"name": spec.name, "layers": spec.layers, "train_metrics": metrics,
            "train_seconds_last_run": round(time.perf_counter() - start, 1),
            "train_sequences": len(train),
            "train_tokens": int(sum(s.ids.shape[0] for s in train)), "seed": seed}
    save_draft(folder, draft, spec.family, target.model, vocab_ids, info,
               tokenizer=target.tokenizer)
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)


def _mlflow_logger(tracking: dict, spec: DraftSpec, folder: Path):
    """An MLflow logger in the project's tracking store, continuing this draft's run on resume."""
    from pytorch_lightning.loggers import MLFlowLogger

    uri = tracking_uri(tracking.get("tracking_uri"))
    run_file = folder / "mlflow_run_id"
    run_id = run_file.read_text().strip() if run_file.is_file() else None
    if run_id is not None and not _run_exists(uri, run_id):
        run_id = None  # the store was reset: log the resumed training as a new run
    logger = MLFlowLogger(experiment_name=tracking.get("experiment", "specstop-draft"),
                          tracking_uri=uri, run_name=spec.name, run_id=run_id)
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


def _measure(spec: DraftSpec, folder: Path, target_name: str, cfg: dict, models: dict) -> dict:
    """alpha, c, predicted and measured `sd` speedup of one draft, beside `ar`, same dtype."""
    meta = read_meta(folder)
    alpha = float(meta["train_metrics"]["val_alpha"])
    runtime = load_runtime(target_name, str(folder), str(models.get("dtype", "auto")),
                           str(models.get("device", "auto")),
                           Path(models.get("cache_dir", "data/models/target")))
    target_costs = measure_verify_costs(runtime.target, "target", [], repeats=10)
    draft_costs = measure_verify_costs(runtime.drafter.lm, "draft", [], repeats=10)
    c = draft_costs.seconds[1] / target_costs.seconds[1]
    verify_path = Path(cfg.get("verify_costs", "data/costs/verify.json"))
    verify = VerifyCosts.load(verify_path) if verify_path.is_file() else None
    predicted = {g: _predicted_speedup(alpha, c, g, verify) for g in range(1, 9)}
    best_predicted = max(predicted, key=predicted.get)
    evaluation = cfg.get("eval", {})
    gammas = sorted({int(g) for g in evaluation.get("gammas", [1, 2, 3, 4])})
    texts = read_split(Path(cfg.get("prompts", "data/prompts")), "val")["text"]
    prompts = [runtime.encode(t, chat=False, special_tokens=False)
               for t in texts[: int(evaluation.get("prompts", 6))]]
    tokens = int(evaluation.get("max_new_tokens", 96))
    configs = [DecodeConfig(method="ar", max_new_tokens=tokens)] + [
        DecodeConfig(method="sd", max_new_tokens=tokens, max_depth=g) for g in gammas]
    results = bench(runtime, prompts, configs, None, 0)
    ar = results[0].stats.tokens_per_s
    measured = {g: r.stats.tokens_per_s / ar for g, r in zip(gammas, results[1:])}
    best_gamma = max(measured, key=measured.get)
    best = results[1 + gammas.index(best_gamma)]
    curve = read_curve(folder / "curve.csv")
    return {"family": spec.family, "layers": spec.layers, "vocab": spec.vocab or "full",
            "alpha": alpha, "c": c, "predicted_speedup": predicted[best_predicted],
            "predicted_gamma": best_predicted, "measured_speedup": measured[best_gamma],
            "best_gamma": best_gamma, "measured_by_gamma": measured,
            "sd_acceptance": best.stats.acceptance_rate,
            "identical_to_ar": f"{best.identical_to_ar}/{len(prompts)}",
            "ar_tokens_per_s": ar, "sd_tokens_per_s": best.stats.tokens_per_s,
            "train_seconds": curve[-1]["train_seconds"] if curve else None,
            "dtype": str(runtime.target.dtype).removeprefix("torch.")}


def _predicted_speedup(alpha: float, c: float, gamma: int, verify: VerifyCosts | None) -> float:
    """i.i.d. acceptance (Leviathan et al.): tokens per round over the round's cost in target
    steps, with the measured cost of verifying gamma + 1 tokens (1 where not measured)."""
    tokens = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    v = 1.0
    if verify is not None:
        width = verify.padded_width(gamma + 1)
        v = verify.ratio(width) if width in verify.seconds else 1.0
    return tokens / (gamma * c + v)


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
    """DVC plot data: the sweep (alpha, c, predicted vs measured) and each learning curve."""
    rows = ["draft,alpha,c,predicted_speedup,measured_speedup"] + [
        f"{name},{r['alpha']:.4f},{r['c']:.4f},{r['predicted_speedup']:.4f},"
        f"{r['measured_speedup']:.4f}" for name, r in results.items()]
    write_atomic(folder / "sweep.csv", lambda tmp: tmp.write_text("\n".join(rows) + "\n"))
    curve = ["draft,step,train_seconds,sequences_seen,val_alpha"]
    for name in results:
        curve += [f"{name},{int(r['step'])},{r['train_seconds']:.1f},{int(r['sequences_seen'])},"
                  f"{r['val_alpha']:.4f}" for r in read_curve(sweep / name / "curve.csv")]
    write_atomic(folder / "learning_curve.csv", lambda tmp: tmp.write_text("\n".join(curve) + "\n"))


def _table(results: dict, winner: str) -> str:
    lines = [f"{'draft':<22} {'alpha':>6} {'c':>6} {'pred':>6} {'meas':>6} {'gamma':>5}"]
    for name, r in results.items():
        mark = " *" if name == winner else ""
        lines.append(f"{name:<22} {r['alpha']:6.3f} {r['c']:6.3f} {r['predicted_speedup']:6.2f} "
                     f"{r['measured_speedup']:6.2f} {r['best_gamma']:5d}{mark}")
    return "\n".join(lines)
