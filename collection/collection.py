"""The decision models' data (stage `collect`): decode the train/val prompts in logging mode and
write one row per drafted token (features, hard and soft labels) as Parquet parts, plus the
measured cost model.

Prompts are cut into fixed parts of `part_size` prompts; with `torchrun`, rank r of W takes
parts r, r+W, ...  Each part is written atomically and a re-run skips finished parts, so an
interrupted run resumes, and the union of the parts does not depend on the number of processes.
Parts logged with other settings are moved to `out/stale/`, after the models have loaded.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pyarrow as pa
import torch
from tqdm import tqdm

from specstop.common.files import remove_temp_files, resume_or_set_aside, write_json
from specstop.common.params import CollectConfig, ModelsConfig
from specstop.decoder.costs import CostModel, VerifyCosts, measure_costs
from specstop.decoder.loop import DecodeConfig, DecodeStats, tree_for
from specstop.decoder.overhead import measuring_policy, round_overhead
from specstop.decoder.policy import FixedDepth
from specstop.decoder.runtime import Runtime
from specstop.decoder.sampling import Sampling
from specstop.prompts.splits import read_split

from .processes import usable_cores
from .rows import LOOKUP, LOOKUP_SCHEMA, RoundLogger, read_parts, write_part, write_schema

STALE = "stale"  # parts logged under other settings are moved here, never deleted


@dataclass(frozen=True)
class Part:
    name: str
    split: str
    prompt_ids: list[str]
    texts: list[str]
    temperature: float = 0.0  # the rounds' sampling temperature (0: greedy)


def plan_parts(prompts_dir: Path, splits: list[str], part_size: int,
               max_prompts: int | None) -> list[Part]:
    """Cut each split's prompts (file order) into parts of `part_size`."""
    parts = []
    for split in splits:
        table = read_split(prompts_dir, split)
        ids, texts = table["prompt_id"][:max_prompts], table["text"][:max_prompts]
        for start in range(0, len(ids), part_size):
            parts.append(Part(f"{split}-{start // part_size:05d}", split,
                              ids[start : start + part_size], texts[start : start + part_size]))
    return parts


def at_temperatures(parts: list[Part], temperatures: list[float]) -> list[Part]:
    """Each part once per temperature, a sampled one named `<part>-T<temperature>`."""
    return [replace(p, name=p.name if t == 0 else f"{p.name}-T{t:g}", temperature=t)
            for t in temperatures for p in parts]


DYNAMIC_STEP_WIDTHS = tuple(range(1, 9))  # draft step widths a dynamic tree may feed


def collect_part(runtime: Runtime, part: Part, config: DecodeConfig, seed: int,
                 progress: tqdm, totals: DecodeStats, lookup_tokens: int) -> RoundLogger:
    """Decode every prompt of a part at its temperature with the policy 'draft to the maximum
    depth', logging the lookup chain of up to `lookup_tokens` below each round's root: greedy,
    read off the text; sampled, verified beside the drafted tree."""
    logger, policy = RoundLogger(), FixedDepth(config.max_depth)
    config = replace(config, sampling=Sampling(part.temperature, config.sampling.top_p),
                     lookup_branch=part.temperature > 0, lookup_tokens=lookup_tokens)
    for prompt_id, text in zip(part.prompt_ids, part.texts):
        logger.start(prompt_id, part.split, part.temperature)
        prompt = runtime.encode(text, chat=False, special_tokens=False)
        generation = runtime.generate(prompt, config, policy, seed=_prompt_seed(seed, prompt_id),
                                      hook=logger)
        if part.temperature == 0:
            logger.finish(prompt.tolist(), generation.tokens, lookup_tokens, config.lookup_ngram)
        totals.add(generation.stats)
        progress.update(1)
        progress.set_postfix(tok_s=f"{totals.tokens_per_s:.1f}",
                             accept=f"{totals.acceptance_rate:.3f}", rows=len(logger))
    return logger


def _prompt_seed(seed: int, prompt_id: str) -> int:
    """A per-prompt seed independent of which process decodes the prompt."""
    return (seed * 1_000_003 + int.from_bytes(prompt_id.encode()[-6:].ljust(6, b"\0"), "big")) \
        % (1 << 62)


def collect(runtime: Runtime, parts: list[Part], config: DecodeConfig, collect: CollectConfig,
            models: ModelsConfig, rank: int = 0, world: int = 1,
            verify_widths: tuple[int, ...] = (),
            runtime_table: VerifyCosts | None = None) -> dict | None:
    """Decode this process's share of `parts` (each at every temperature of
    `collect.temperatures`) not written yet; rank 0 sets aside parts logged
    under other settings first and, at the end, measures the cost model (target passes at the
    tree's sizes and `verify_widths`, draft steps up to DYNAMIC_STEP_WIDTHS nodes) and writes
    the summary, which it returns (the other ranks return None).  With `runtime_table` (the
    verify costs the runtime pads with) the cost model's target curve is that table
    (`measure_costs`)."""
    out, parts = collect.out, at_temperatures(parts, collect.temperatures)
    if rank == 0:
        resume_or_set_aside(out / "parts", _fingerprint(collect, models), out / STALE,
                            f"collect: the parts logged in {out / 'parts'}")
        remove_temp_files(out)  # of parts a killed run was writing
    barrier(world)
    mine = [p for i, p in enumerate(parts) if i % world == rank]
    todo = [p for p in mine if not (out / "parts" / f"{p.name}.parquet").is_file()]
    write_schema(out)
    progress = tqdm(total=sum(len(p.prompt_ids) for p in todo), desc=f"collect[{rank}/{world}]",
                    unit="prompt", mininterval=5)
    start, totals = time.perf_counter(), DecodeStats()
    for part in todo:
        logger = collect_part(runtime, part, config, collect.seed, progress, totals,
                              collect.lookup_tokens)
        # before the part, whose file marks the part done
        write_part(logger.lookup_table(), out / "parts" / LOOKUP / f"{part.name}.parquet")
        write_part(logger.table(), out / "parts" / f"{part.name}.parquet")
    progress.close()
    elapsed = time.perf_counter() - start
    barrier(world)
    if rank == 0:
        threads = torch.get_num_threads()
        torch.set_num_threads(usable_cores())  # costs as one decoding process sees them
        table = measure_costs(runtime.target, runtime.draft, tree_for(config),
                              verify_widths=verify_widths, step_widths=DYNAMIC_STEP_WIDTHS,
                              runtime_table=runtime_table)
        table["round_overhead"] = _round_overhead(runtime, parts, config, collect, table)
        torch.set_num_threads(threads)
        write_json(out / "costs.json", table)
        summary = _summary(out, parts, elapsed, world)
        write_json(collect.summary, summary)
        return summary
    return None


def _round_overhead(runtime: Runtime, parts: list[Part], config: DecodeConfig,
                    collect: CollectConfig, table: dict) -> dict[str, dict[str, dict]]:
    """The work a drafted round spends beyond an `ar` round's that the table's curves do not
    price (`overhead.round_overhead`: {"base", "per_level"} in `ar` steps), by kind of round
    ("tree", "static"), greedy and at the first sampled temperature, on the first
    `overhead_prompts` val prompts (any split's without val); {} without a draft."""
    texts = [t for p in sorted(parts, key=lambda p: p.split != "val") for t in p.texts]
    if runtime.drafter is None or not collect.overhead_prompts or not texts:
        return {}
    prompts = [runtime.encode(t, chat=False, special_tokens=False)
               for t in texts[: collect.overhead_prompts]]
    costs = CostModel.from_table(table)
    policy = measuring_policy(tree_for(config).branching, costs.target)
    configs = {"greedy": config}
    sampled = [t for t in collect.temperatures if t > 0]
    if sampled:
        configs["sampled"] = replace(config, sampling=Sampling(sampled[0], collect.top_p))
    out: dict[str, dict[str, dict]] = {}
    for decoding, decode in configs.items():
        for kind, work in round_overhead(runtime, prompts, decode, policy, costs).items():
            out.setdefault(kind, {})[decoding] = asdict(work)
    return out


def _fingerprint(collect: CollectConfig, models: ModelsConfig) -> dict:
    """What the logged rows depend on: the options (not how many processes log them), the
    models and the draft's files."""
    draft = Path(models.draft)
    files = sorted(f for f in draft.rglob("*") if f.is_file()) if draft.is_dir() else []
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.relative_to(draft).as_posix().encode())
        digest.update(f.read_bytes())
    return {"collect": collect.model_dump(mode="json", exclude={"overhead_prompts", "processes"}),
            "models": models.model_dump(mode="json"), "draft_files": digest.hexdigest(),
            "lookup_columns": LOOKUP_SCHEMA.names}


def _summary(out: Path, parts: list, elapsed: float, world: int) -> dict:
    table = read_parts(out)
    labels = table.column("label").to_numpy()
    return {"parts": len(parts), "rows": int(table.num_rows),
            "labelled": int((labels >= 0).sum()), "accepted": int((labels == 1).sum()),
            "rejected": int((labels == 0).sum()), "after_rejection": int((labels < 0).sum()),
            "by_split": acceptance_by_split(table),
            "last_run_seconds": round(elapsed, 1), "processes": world}


def acceptance_by_split(table: pa.Table) -> dict[str, dict]:
    """Per split, greedy rounds: prompts, labelled rows, the share accepted and the first
    candidate's (depth 1, rank 0) acceptance: a draft that has seen a split's prompts shows
    there as a higher rate."""
    columns = ["prompt_id", "split", "label", "depth", "sibling_rank", "temperature"]
    rows = table.select(columns).to_pandas()
    rows = rows[(rows["label"] >= 0) & (rows["temperature"] == 0)]
    first = (rows["depth"] == 1) & (rows["sibling_rank"] == 0)
    return {str(split): {"prompts": int(group["prompt_id"].nunique()), "labelled": len(group),
                         "acceptance": _rate(group["label"]),
                         "first_candidate_acceptance": _rate(group["label"][first[group.index]])}
            for split, group in rows.groupby("split", sort=True)}


def _rate(labels) -> float | None:
    return round(float(labels.mean()), 4) if len(labels) else None


def init_distributed() -> tuple[int, int]:
    """(rank, world size) under torchrun (gloo on CPU, NCCL on GPU), else (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), world


def process_device(device: str) -> str:
    """Under torchrun on GPUs each process takes the GPU of its local rank."""
    if device == "auto" and torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        return f"cuda:{os.environ['LOCAL_RANK']}"
    return device


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
