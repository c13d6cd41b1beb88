"""Stage records (`specstop.pipeline.stage_record`): every stage's wall time, what it achieved
and the machine as data; the README's stage table from them; the budgeted default and the
other profiles of this project's params.yaml."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specstop.bench.report import stages_markdown
from specstop.common.params import apply_profile, validate
from specstop.decoder import load
from specstop.pipeline import stage_record
from specstop.pipeline.params import read_params_file

from conftest import ROOT


@pytest.fixture()
def avx2_cpu(tmp_path, monkeypatch):
    """A /proc/cpuinfo stand-in for an AVX2-only CPU (`cpu_has_bf16` caches its answer)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Test CPU\nflags\t\t: fpu sse2 avx2 fma\n")
    monkeypatch.setattr(load, "CPUINFO", cpuinfo)
    load.cpu_has_bf16.cache_clear()
    yield
    load.cpu_has_bf16.cache_clear()


def test_a_stage_writes_its_seconds_achievements_and_machine(tmp_path, avx2_cpu):
    stage_record.timed_stage("collect", lambda: {"prompts": 8, "rows": 120}, folder=tmp_path)
    record = json.loads((tmp_path / "collect.json").read_text())
    assert record["stage"] == "collect" and record["seconds"] >= 0
    assert record["achieved"] == {"prompts": 8, "rows": 120}
    machine = record["machine"]
    assert machine["cpu"] == "Test CPU" and machine["cpu_flags"] == ["avx2"]
    assert machine["native_bf16"] is False and machine["torch_threads"] >= 1


def test_only_rank_zero_writes_under_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    stage_record.timed_stage("collect", lambda: None, folder=tmp_path)
    assert not (tmp_path / "collect.json").exists()
    monkeypatch.setenv("RANK", "0")
    stage_record.timed_stage("collect", lambda: None, folder=tmp_path)
    assert json.loads((tmp_path / "collect.json").read_text())["achieved"] == {}


def test_a_failed_stage_leaves_no_record(tmp_path):
    def fail() -> dict:
        raise RuntimeError("stage failed")

    with pytest.raises(RuntimeError):
        stage_record.timed_stage("train", fail, folder=tmp_path)
    assert stage_record.read_records(tmp_path) == {}


def test_the_readme_table_gives_minutes_per_stage_and_the_cpu(tmp_path, avx2_cpu):
    stage_record.timed_stage("prepare", lambda: {"widths": 4}, folder=tmp_path)
    stage_record.timed_stage("bench", lambda: {"prompts": 24, "max_new_tokens": 64},
                             folder=tmp_path)
    records = stage_record.read_records(tmp_path)
    records["bench"]["seconds"] = 480.0
    text = stages_markdown(records)
    assert "Test CPU, " in text and "CPU flags avx2;" in text
    assert "| bench | 8.0 | prompts 24, max_new_tokens 64 |" in text
    assert "| prepare | 0.0 | widths 4 |" in text and "more than one machine" not in text
    assert stages_markdown({}) == ""


def test_a_stage_scaled_to_the_machine_says_so_in_its_record_and_the_table(tmp_path, avx2_cpu):
    sizes = {"scale": 0.452, "step_ms": 53.1, "counts": {"bench.prompts": 11}}
    stage_record.timed_stage("bench", lambda: {"prompts": 11}, sizes, folder=tmp_path)
    stage_record.timed_stage("train", lambda: {"rows": 3}, folder=tmp_path)
    records = stage_record.read_records(tmp_path)
    assert records["bench"]["sizes"] == sizes and "sizes" not in records["train"]
    text = stages_markdown(records)
    assert "| prompts 11 (sizes x0.452: the target's step 53.1 ms) |" in text
    assert "| rows 3 |" in text


def test_the_default_is_budgeted_and_full_keeps_the_old_sizes():
    """The default runs fewer, shorter decodes than `full` but is still a sound experiment:
    both domains in the bench with at least 24 test prompts, the compact peer draft kept."""
    raw = read_params_file(ROOT / "params.yaml")
    default, full = validate(raw), validate(apply_profile(raw, "full"))
    assert default.bench.prompts >= 24 and default.sizes.full_until_step_ms is not None
    assert full.sizes.full_until_step_ms is None
    assert set(default.draft.domains) == {"humaneval", "magpie", "magpie-draft"}
    assert default.collect.max_prompts < full.collect.max_prompts
    assert default.bench.max_new_tokens < full.bench.max_new_tokens == 128
    assert len(full.draft.sweep) == 3 and full.bench.methods and len(full.bench.methods) == 12
    peer = default.bench.assistant_draft.rsplit("/", 1)[-1]
    assert peer in {spec.name for spec in default.draft.sweep}


def test_the_gpu_profile_is_a_cuda_run_of_a_hub_target():
    gpu = validate(apply_profile(read_params_file(ROOT / "params.yaml"), "gpu"))
    assert gpu.models.device == "cuda" and "/" in gpu.models.target
    assert gpu.bench.methods is None and gpu.collect.max_new_tokens >= 256


def test_as_avx2_shows_an_avx2_only_cpu_to_the_command():
    """scripts/as_avx2.sh (`make repro-avx2`): the flags the defaults read lose avx512/amx, so
    `dtype: auto` is fp32, and torch's kernels are capped at AVX2."""
    if "avx2" not in load.CPUINFO.read_text():
        pytest.skip("this CPU has no AVX2")
    probe = ("import torch; from specstop.decoder.load import cpu_has_bf16, resolve_dtype; "
             "print(torch.backends.cpu.get_cpu_capability(), cpu_has_bf16(), "
             "resolve_dtype('auto', torch.device('cpu')))")
    run = subprocess.run(["bash", str(ROOT / "scripts" / "as_avx2.sh"), sys.executable, "-c",
                          probe], capture_output=True, text=True, timeout=120)
    if run.returncode != 0 and run.stderr.startswith(("unshare:", "mount:")):  # util-linux
        pytest.skip(f"no mount namespace here: {run.stderr.strip()[:120]}")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["AVX2", "False", "torch.float32"]
