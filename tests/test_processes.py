"""How many processes `collect --launch` starts, and that it becomes torchrun only for two or
more."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from specstop.collection import processes
from specstop.common.params import validate
from specstop.decoder.load import weight_bytes
from specstop.pipeline import collect


def test_an_explicit_count_is_kept():
    assert processes.process_count(3, "cpu", lambda: 1 << 40) == 3


@pytest.mark.parametrize("cores, memory, expected", [(8, 10 << 30, 5), (8, None, 8),
                                                     (8, 1 << 30, 1), (2, 64 << 30, 2)])
def test_auto_on_a_cpu_is_the_cores_the_memory_holds(monkeypatch, cores, memory, expected):
    monkeypatch.setattr(processes, "usable_cores", lambda: cores)
    monkeypatch.setattr(processes, "available_memory", lambda: memory)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert processes.process_count("auto", "auto", lambda: 1 << 30) == expected  # 2 GiB each


def test_auto_takes_every_gpu_only_when_the_device_is_auto(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert processes.process_count("auto", "auto", lambda: 1) == 4
    assert processes.process_count("auto", "cuda:1", lambda: 1) == 1


@pytest.mark.parametrize("cpu_max, expected", [("150000 100000", 2), ("50000 100000", 1),
                                               ("max 100000", None)])
def test_the_cgroup_quota_caps_the_cores(tmp_path, cpu_max, expected):
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    cores = len(os.sched_getaffinity(0))
    assert processes.usable_cores(tmp_path) == (cores if expected is None
                                                else min(cores, expected))
    assert processes.usable_cores(tmp_path / "absent") == cores


def test_available_memory_is_the_smaller_of_the_kernel_and_the_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert processes.available_memory(meminfo, cgroup) == 20000000 * 1024
    (cgroup / "memory.max").write_text("8000000000\n")
    (cgroup / "memory.current").write_text("3000000000\n")
    assert processes.available_memory(meminfo, cgroup) == 5000000000
    (cgroup / "memory.max").write_text("max\n")
    assert processes.available_memory(meminfo, cgroup) == 20000000 * 1024
    assert processes.available_memory(tmp_path / "absent", tmp_path / "absent") is None


def test_weight_bytes_count_the_parameters_at_the_dtype(tiny_target):
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    n = sum(p.numel() for p in model.parameters())
    assert weight_bytes(str(tiny_target), torch.float32) == 4 * n
    assert weight_bytes(str(tiny_target), torch.bfloat16) == 2 * n


@pytest.mark.parametrize("count, world, becomes_torchrun", [(2, None, True), (1, None, False),
                                                           (2, "2", False)])
def test_launch_becomes_torchrun_for_two_or_more(monkeypatch, tmp_path, count, world,
                                                 becomes_torchrun):
    """A torchrun worker (WORLD_SIZE set) or a count of one runs the stage itself."""
    calls = []
    monkeypatch.setattr(os, "execv", lambda path, argv: calls.append(argv))
    monkeypatch.setattr(collect, "process_count", lambda setting, device, weights: count)
    monkeypatch.setattr(collect, "usable_cores", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    collect.launch(validate({}), tmp_path / "p.yaml")
    if not becomes_torchrun:
        assert calls == []
        return
    assert calls == [[sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node=2", "-m", "specstop.pipeline.cli", "--params",
                      str(tmp_path / "p.yaml"), "collect"]]
    assert os.environ["OMP_NUM_THREADS"] == "2"  # the cores' share
