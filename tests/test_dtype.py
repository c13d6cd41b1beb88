"""`--dtype auto` follows native bf16 support: a GPU without bf16 units (V100, T4: emulated
bf16 only) gets fp16, an Ampere+ one bf16; a CPU gets bf16 only with AVX512-BF16 or AMX."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch

from specstop.decoder import load
from specstop.decoder.load import resolve_dtype

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def fake_gpu(major: int):
    """`torch.cuda.is_bf16_supported` of a GPU of compute capability `major`.x: bf16 units from
    8 (Ampere) on, emulation below."""
    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return major >= 8 or including_emulation
    return is_bf16_supported


GPUS = {"volta": (7, torch.float16), "ampere": (8, torch.bfloat16), "hopper": (9, torch.bfloat16)}


@pytest.mark.parametrize("gpu", GPUS)
def test_auto_on_a_gpu_is_bf16_only_where_it_is_native(monkeypatch: pytest.MonkeyPatch,
                                                       gpu: str):
    major, expected = GPUS[gpu]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", fake_gpu(major))
    assert resolve_dtype("auto", CUDA) == expected


@pytest.fixture
def cpuinfo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A /proc/cpuinfo stand-in, read afresh (`cpu_has_bf16` caches its answer)."""
    path = tmp_path / "cpuinfo"
    monkeypatch.setattr(load, "CPUINFO", path)
    load.cpu_has_bf16.cache_clear()
    yield path
    load.cpu_has_bf16.cache_clear()


@pytest.mark.parametrize("flags, expected", [
    ("fpu sse2 avx avx2 fma", torch.float32),
    ("fpu sse2 avx2 avx512f avx512_bf16", torch.bfloat16),
    ("fpu sse2 avx2 avx512f amx_bf16 amx_tile", torch.bfloat16),
], ids=["avx2", "avx512-bf16", "amx"])
def test_auto_on_a_cpu_reads_its_flags(cpuinfo: Path, flags: str, expected: torch.dtype):
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert resolve_dtype("auto", CPU) == expected


def test_an_unreadable_cpuinfo_means_fp32(cpuinfo: Path):
    assert resolve_dtype("auto", CPU) == torch.float32  # the file does not exist
