"""Stage `collect`: the decision models' logged rounds and cost model
(`specstop.collection.collection`), one process or several under `torchrun`; one run at a time
per output folder (rank 0 holds its lock: a second run, or a second torchrun, fails at once)."""

from contextlib import nullcontext

from specstop.common.files import folder_lock
from specstop.common.params import Params
from specstop.decoder.costs import VerifyCosts
from specstop.decoder.runtime import decode_config
from specstop.drafts.loading import load_runtime, require_draft
from specstop.drafts.store import check_held_out
from specstop.collection import collection


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
