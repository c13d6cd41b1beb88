"""Stage `collect`: the decision models' logged rounds and cost model
(`specstop.collection.collection`), one process or several under `torchrun` (`--launch` starts
`collect.processes` of them: `collection.processes`); one run at a time per output folder
(rank 0 holds its lock: a second run, or a second torchrun, fails at once)."""

import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

from specstop.common.files import folder_lock
from specstop.common.params import Params
from specstop.decoder.costs import VerifyCosts
from specstop.decoder.load import resolve_dtype, weight_bytes
from specstop.decoder.runtime import decode_config
from specstop.drafts.loading import load_runtime, require_draft
from specstop.drafts.store import check_held_out
from specstop.collection import collection
from specstop.collection.processes import process_count, usable_cores


def launch(params: Params, params_file: Path | None) -> None:
    """`specstop collect --launch`: where `collect.processes` comes to more than one, this
    process becomes torchrun starting that many workers of `specstop collect` (one thread each
    of the usable cores' share on a CPU, unless OMP_NUM_THREADS says); it returns to run the
    stage alone where it comes to one, or where it already is a torchrun worker."""
    if "WORLD_SIZE" in os.environ:
        return
    models = params.models
    n = process_count(params.collect.processes, models.device, lambda: weight_bytes(
        models.target, resolve_dtype(models.dtype, torch.device("cpu")), models.target_cache))
    if n == 1:
        return
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // n)))
    cli = [*(["--params", str(params_file)] if params_file else []), "collect"]
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc_per_node={n}", "-m", "specstop.pipeline.cli", *cli])


def run(params: Params) -> dict | None:
    collect, models = params.collect, params.models
    rank, world = collection.init_distributed()
    config = decode_config(collect, collect.method)
    require_draft(models.draft)
    parts = collection.plan_parts(collect.prompts, collect.splits, collect.part_size,
                                  collect.max_prompts)
    for split in collect.splits:
        check_held_out(models.draft, [i for p in parts if p.split == split for i in p.prompt_ids],
                       f"collect: the {split} prompts of {collect.prompts}")
    with folder_lock(collect.out, "collect") if rank == 0 else nullcontext():
        runtime = load_runtime(models.target, models.draft, models.dtype,
                               collection.process_device(models.device),
                               models.target_cache,  # every check before the logs are touched
                               costs=params.costs.path, cpu_kernel=models.cpu_kernel,
                               compile=models.compile)
        table = None if runtime.costs is None else VerifyCosts.load(params.costs.path)
        return collection.collect(runtime, parts, config, collect, models, rank, world,
                                  tuple(params.costs.widths), table)
