"""Fault tolerance of the two long stages: `collect` and `draft` are killed mid-way (SIGKILL, or
SIGTERM), re-run, and end with exactly the data of an uninterrupted run in another folder.

Every run is a CLI subprocess with one thread, so floating point is the same in all of them.  A
run is killed as soon as a file shows it is past the point under test (polled, with a timeout);
a run that ends before it could be killed fails the test (the settings are too small)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
import yaml
from safetensors.torch import load_file

from specstop.drafts.store import DRAFT_META_FILE, HEAD_WEIGHTS, read_meta
from specstop.collection.rows import read_parts
from specstop.drafts.distill import EpochBatches, ResumableLoader, read_curve

from conftest import write_chat_prompts

ENV = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"},
       "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
REQUESTS = [f"task {i}: {verb} a list" for i, verb in
            enumerate(["sort", "reverse", "sum", "count", "filter", "print", "copy", "merge"])]
TRAIN = 5  # the first TRAIN requests are the draft and train prompts (the collect runs draft
# with layers:1, which learned from nothing), the others val prompts
COLLECT_PARTS = len(REQUESTS)  # part_size 1
DRAFT = "feature-l1-v256"
SAMPLES, BATCH = 2, 2
STEPS_PER_EPOCH = TRAIN * SAMPLES // BATCH  # 5; a checkpoint every 4 steps: all mid-epoch
POLL_S, TIMEOUT_S = 0.01, 300.0


def workdir(folder: Path, target: Path) -> Path:
    """A run folder: prompts and a params file for tiny `collect` and `draft` runs (relative
    paths, so every folder runs the same settings)."""
    folder.mkdir()
    write_chat_prompts(folder / "data" / "prompts", target,
                       {"draft": REQUESTS[:TRAIN], "train": REQUESTS[:TRAIN],
                        "val": REQUESTS[TRAIN:]})
    params = {
        "models": {"target": str(target), "draft": "layers:1", "dtype": "float32",
                   "device": "cpu"},
        "collect": {"prompts": "data/prompts", "out": "data/collect",
                    "summary": "metrics/collect.json", "part_size": 1, "max_new_tokens": 64,
                    "max_depth": 4, "ti_width": 2},
        "draft": {"out": "data/draft", "metrics": "metrics/draft.json",
                  "plots": "metrics/draft_plots", "prompts": "data/prompts",
                  "corpus": {"temperatures": [0.0, 1.0][:SAMPLES], "max_new_tokens": 24,
                             "batch_size": 2, "top_k": 4},
                  "sweep": [{"family": "feature", "layers": 1, "vocab": 256}],
                  "train": {"max_minutes": 60, "max_epochs": 4, "batch_size": BATCH,
                            "warmup_steps": 3, "unroll": 2, "val_every_steps": 4,
                            "patience": 100},
                  "eval": {"prompts": 1, "max_new_tokens": 8, "gammas": [1]}},
        "mlflow": {"tracking_uri": "sqlite:///mlflow.db", "experiment": "kill"},
    }
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    return folder


def start(folder: Path, stage: str) -> subprocess.Popen:
    """The stage as a CLI process in `folder`, its output appended to `folder/<stage>.log`."""
    with (folder / f"{stage}.log").open("a") as log:
        return subprocess.Popen([sys.executable, "-m", "specstop.pipeline.cli", "--params",
                                 "params.yaml", stage], cwd=folder, env=ENV, stdout=log,
                                stderr=subprocess.STDOUT)


def wait(process: subprocess.Popen) -> int:
    """The exit status; a process still running after TIMEOUT_S is killed (and the test fails)."""
    try:
        return process.wait(TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


def finish(folder: Path, stage: str) -> None:
    assert wait(start(folder, stage)) == 0, log(folder, stage)[-3000:]


def kill_when(folder: Path, stage: str, ready: Callable[[], bool], sig: signal.Signals) -> int:
    """Start the stage, send `sig` as soon as `ready()`; the exit status of the killed process."""
    process = start(folder, stage)
    deadline = time.monotonic() + TIMEOUT_S
    while not ready():
        if process.poll() is not None:
            pytest.fail(f"{stage} ended (rc {process.returncode}) before the kill: make the "
                        f"run longer\n{log(folder, stage)[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"{stage}: no kill point within {TIMEOUT_S} s")
        time.sleep(POLL_S)  # polling interval only: `ready()` decides
    process.send_signal(sig)
    status = wait(process)
    assert status != 0, f"{stage} finished although killed"
    return status


def log(folder: Path, stage: str) -> str:
    return (folder / f"{stage}.log").read_text()


def leftover_temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob(".*.tmp") if p.is_file()]


# ---------------------------------------------------------------------------------- collect


@pytest.fixture(scope="module")
def collect_reference(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted `collect` run."""
    folder = workdir(tmp_path_factory.mktemp("collect") / "reference", tiny_target)
    finish(folder, "collect")
    return folder / "data" / "collect"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: s.name)
def test_killed_collect_resumes_to_the_same_rows(tiny_target, collect_reference, tmp_path,
                                                 sig):
    folder = workdir(tmp_path / "killed", tiny_target)
    parts = folder / "data" / "collect" / "parts"
    kill_when(folder, "collect", lambda: any(parts.glob("*.parquet")), sig)
    done = sorted(p.name for p in parts.glob("*.parquet"))
    assert 0 < len(done) < COLLECT_PARTS, f"killed after {len(done)} of {COLLECT_PARTS} parts"
    assert not (folder / "metrics" / "collect.json").exists()
    (parts / ".train-00004.parquet.0123abcd.tmp").write_bytes(b"as a kill mid-write leaves")
    stamps = {name: (parts / name).stat().st_mtime_ns for name in done}

    finish(folder, "collect")
    assert {name: (parts / name).stat().st_mtime_ns for name in done} == stamps  # not redone
    assert leftover_temp_files(folder / "data" / "collect") == []
    resumed, reference = read_parts(folder / "data" / "collect"), read_parts(collect_reference)
    assert sorted(p.name for p in parts.iterdir()) == \
        sorted(p.name for p in (collect_reference / "parts").iterdir())
    assert resumed.equals(reference)
    keys = list(zip(*[resumed.column(c).to_pylist() for c in ("prompt_id", "round", "node")]))
    assert len(keys) == len(set(keys)), "duplicated rows"
    assert set(resumed.column("prompt_id").to_pylist()) == {f"p-{r}" for r in REQUESTS}


# ------------------------------------------------------------------------------------ draft


@pytest.fixture(scope="module")
def mlflow_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow SQLite store, created once (its migrations take seconds)."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def draft_workdir(folder: Path, target: Path, mlflow_db: Path) -> Path:
    workdir(folder, target)
    shutil.copy(mlflow_db, folder / "mlflow.db")
    return folder


@pytest.fixture(scope="module")
def draft_reference(tiny_target: Path, mlflow_db: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted `draft` run."""
    folder = draft_workdir(tmp_path_factory.mktemp("draft") / "reference", tiny_target, mlflow_db)
    finish(folder, "draft")
    return folder / "data" / "draft"


def shards(corpus: Path) -> dict[str, list[dict]]:
    return {f"{split.name}/{shard.name}": torch.load(shard, weights_only=True)
            for split in sorted(corpus.iterdir()) for shard in sorted(split.glob("*.pt"))}


def same_shards(a: dict[str, list[dict]], b: dict[str, list[dict]]) -> bool:
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k]) and all(
            x.keys() == y.keys() and all(
                torch.equal(x[f], y[f]) if torch.is_tensor(x[f]) else x[f] == y[f] for f in x)
            for x, y in zip(a[k], b[k])) for k in a)


def curve(draft: Path) -> list[tuple]:
    """The learning curve without its wall-clock column."""
    return [(r["step"], r["sequences_seen"], r["val_loss"], r["val_alpha"])
            for r in read_curve(draft / "curve.csv")]


def checkpoint_step(draft: Path) -> int:
    path = draft / "checkpoints" / "last.ckpt"
    return int(torch.load(path, weights_only=False, map_location="cpu")["global_step"])


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: s.name)
def test_killed_draft_resumes_to_the_same_weights(tiny_target, mlflow_db, draft_reference,
                                                  tmp_path, sig):
    """Killed once while the corpus is generated and once mid-epoch in training (after a
    checkpoint), the stage ends with the reference's corpus, weights and learning curve."""
    folder = draft_workdir(tmp_path / "killed", tiny_target, mlflow_db)
    out = folder / "data" / "draft"
    train_shards = out / "corpus" / "train"
    kill_when(folder, "draft", lambda: any(train_shards.glob("shard-*.pt")), sig)
    total = len(list((draft_reference / "corpus" / "train").glob("shard-*.pt")))
    assert 0 < len(list(train_shards.glob("shard-*.pt"))) < total
    assert not (out / "sweep").exists()
    (train_shards / ".shard-00004.pt.0123abcd.tmp").write_bytes(b"as a kill mid-write leaves")

    sweep = out / "sweep" / DRAFT
    status = kill_when(folder, "draft", (sweep / "checkpoints" / "last.ckpt").is_file, sig)
    assert status == (-sig if sig == signal.SIGKILL else 128 + sig)  # Lightning took the SIGTERM
    assert read_meta(sweep) is None, "killed after training had finished"
    final = int(read_curve(draft_reference / "sweep" / DRAFT / "curve.csv")[-1]["step"])
    assert 0 < checkpoint_step(sweep) < final and checkpoint_step(sweep) % STEPS_PER_EPOCH

    finish(folder, "draft")
    assert same_shards(shards(out / "corpus"), shards(draft_reference / "corpus"))
    reference = draft_reference / "sweep" / DRAFT
    weights, expected = load_file(sweep / HEAD_WEIGHTS), load_file(reference / HEAD_WEIGHTS)
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    assert curve(sweep) == curve(reference)
    assert read_meta(sweep)["train_metrics"] == read_meta(reference)["train_metrics"]
    published = json.loads((out / "default" / DRAFT_META_FILE).read_text())
    assert published["name"] == DRAFT  # and it names the prompts it learned from
    assert published["trained_on_prompts"] == [f"p-{r}" for r in REQUESTS[:TRAIN]]
    assert "not resumable" not in log(folder, "draft")  # Lightning's mid-epoch warning
    assert leftover_temp_files(out) == []


def test_loader_resumes_the_epoch_order():
    """Each epoch is a permutation of its own; a loader given a saved position yields the rest
    of that epoch."""
    def loader() -> ResumableLoader:
        return ResumableLoader(range(7), batch_sampler=EpochBatches(7, 3, seed=0),
                               collate_fn=list)

    running, epochs = loader(), []
    for _ in range(3):
        epochs.append(list(running))
        for trained in range(1, len(running) + 1):
            running.batch_sampler.advance(trained)
            assert running.state_dict()["trained"] == trained % len(running)
    assert all(sorted(sum(epoch, [])) == list(range(7)) for epoch in epochs)
    assert len({str(epoch) for epoch in epochs}) == 3
    assert [len(batch) for batch in epochs[0]] == [3, 3, 1]
    resumed = loader()
    resumed.load_state_dict({"epoch": 2, "trained": 2})
    assert list(resumed) == epochs[2][2:]
