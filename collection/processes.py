"""How many processes stage `collect` runs: one per GPU; on a CPU one per core this process may
use (its affinity and its cgroup's CPU quota: a container's share, not the host's cores that
`torchrun --nproc_per_node auto` counts), no more than the available memory holds, each process
loading the target and the draft."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Literal

import torch

CGROUP = Path("/sys/fs/cgroup")  # cgroup v2: cpu.max, memory.max, memory.current
MEMINFO = Path("/proc/meminfo")
HEADROOM = 2.0  # a process's memory over its target's weights: the draft, the caches, the
# activations and the libraries


def usable_cores(cgroup: Path = CGROUP) -> int:
    """The cores this process may use: its affinity, capped by its cgroup's CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    quota = _cpu_quota(cgroup)
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def _cpu_quota(cgroup: Path) -> float | None:
    """`cpu.max` ("quota period", or "max period" for none) in cores; None without a limit."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def available_memory(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int | None:
    """Bytes this process may still take: the kernel's MemAvailable, capped by what its
    cgroup's `memory.max` leaves beside `memory.current`; None where neither is readable."""
    limits = []
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines())
        limits.append(int(fields["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            limits.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def process_count(setting: int | Literal["auto"], device: str,
                  weight_bytes: Callable[[], int]) -> int:
    """`setting` itself, or for auto: one per GPU where `device` is auto (one where it names a
    GPU); on a CPU one per usable core, no more than the available memory holds at HEADROOM
    times the target's `weight_bytes` each, and at least one."""
    if setting != "auto":
        return setting
    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count() if device == "auto" else 1
    cores, memory = usable_cores(), available_memory()
    if memory is None:
        return cores
    return max(1, min(cores, int(memory // (HEADROOM * weight_bytes()))))
