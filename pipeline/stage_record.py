"""Each stage's wall time and what it achieved, as data: `metrics/stages/<stage>.json`, with the
machine it ran on (CPU flags that decide the dtype, cores, threads, GPU), so minutes per stage
can be compared across CPU generations (`specstop results` puts them in the README)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

import torch

from specstop.common.files import write_json
from specstop.common.paths import STAGE_METRICS
from specstop.decoder import load

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # the ones that decide kernels and dtype


def timed_stage(stage: str, run: Callable[[], dict | None], sizes: dict | None = None,
                folder: Path = STAGE_METRICS) -> None:
    """Run a stage and write its record, with `sizes` (its counts as scaled to the machine,
    `pipeline.sizes`) where given; under torchrun only rank 0 writes (after every rank's work:
    the stages end with a barrier)."""
    start = time.perf_counter()
    achieved = run() or {}
    if os.environ.get("RANK", "0") != "0":
        return
    write_json(Path(folder) / f"{stage}.json",
               {"stage": stage, "seconds": round(time.perf_counter() - start, 1),
                "achieved": achieved, **({"sizes": sizes} if sizes else {}),
                "machine": machine()})


def machine() -> dict:
    """What a stage's speed depends on: CPU model and flags, cores, torch threads, GPU."""
    try:
        info = load.CPUINFO.read_text()
    except OSError:
        info = ""
    words = set(next((line for line in info.splitlines() if line.startswith("flags")), "").split())
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cpu_flags": [f for f in FLAGS if f in words],
            "native_bf16": load.cpu_has_bf16(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def read_records(folder: Path = STAGE_METRICS, order: tuple[str, ...] = ()) -> dict[str, dict]:
    """The stage records in `folder` by stage name, the names in `order` first in that order
    (none where no stage has run)."""
    paths = sorted(Path(folder).glob("*.json"),
                   key=lambda p: (order.index(p.stem) if p.stem in order else len(order), p.stem))
    return {p.stem: json.loads(p.read_text()) for p in paths}
