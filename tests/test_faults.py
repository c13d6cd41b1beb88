"""Bad inputs at the CLI: each ends `specstop <stage>` with exit code 2 and one stderr line,
`specstop: error: ...`, naming the problem and the file or URI, within seconds.

Covered elsewhere, not repeated here: a stop model of another feature schema
(test_export.test_generate_with_a_stop_model), prompt files with bad rows skipped and counted
(test_prompts.test_cli_prompts_end_to_end, test_prompts.test_local_file_bad_rows_are_counted),
parts unit by unit (test_collect.test_reading_bad_parts_gives_clear_errors).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import yaml

from specstop.pipeline.cli import main

from synthetic_rows import make_collect

FAST_S = 8.0  # "within seconds": the probe waits 3 s at most; the rest is Python on a busy CPU


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def specstop(tmp_path: Path, capsys, stage: str, tracking_uri: str,
             collect: Path | None = None) -> tuple[int, str, float]:
    """(exit code, the one stderr line, seconds) of `specstop --params <file> <stage>`."""
    collect = collect or tmp_path / "collect"
    params = {"mlflow": {"tracking_uri": tracking_uri, "experiment": "faults"},
              "train": {"data": str(collect), "out": str(tmp_path / "train"),
                        "metrics": str(tmp_path / "metrics" / "train.json"),
                        "plots": str(tmp_path / "metrics" / "plots"), "families": ["logistic"]},
              "export": {"train": str(tmp_path / "train"), "data": str(collect),
                         "out": str(tmp_path / "export"),
                         "metrics": str(tmp_path / "metrics" / "export.json")},
              "draft": {"out": str(tmp_path / "draft"),
                        "sweep": [{"family": "feature", "layers": 1, "vocab": 64}]}}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    capsys.readouterr()
    start = time.perf_counter()
    code = main(["--params", str(path), stage])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("specstop: error: "), lines[0]
    return code, lines[0], seconds


@pytest.fixture(autouse=True)
def no_env_uri(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)


def test_train_on_a_truncated_part_names_the_part(tmp_path, capsys):
    folder = make_collect(tmp_path / "collect", prompts={"train": 3, "val": 2}, rounds=3)
    part = folder / "parts" / "val-00000.parquet"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    code, line, _ = specstop(tmp_path, capsys, "train", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert code == 2
    assert f"{part}: corrupt or truncated Parquet file" in line


@pytest.mark.parametrize("stage", ["train", "export", "draft"])
def test_unreachable_tracking_server_fails_fast(tmp_path, capsys, stage):
    uri = f"http://127.0.0.1:{free_port()}"
    code, line, seconds = specstop(tmp_path, capsys, stage, uri)
    assert code == 2 and seconds < FAST_S, (code, seconds)
    assert f"MLflow tracking server {uri} is not reachable" in line
    assert "mlflow server" in line and "mlflow.tracking_uri" in line


@pytest.mark.parametrize("case", ["folder-not-creatable", "not-a-database", "unknown-scheme"])
def test_unusable_tracking_store_fails_fast(tmp_path, capsys, case):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder, not a database\n")
    uri, expected = {
        "folder-not-creatable": (f"sqlite:///{blocker / 'sub' / 'mlflow.db'}",
                                 f"cannot create the folder {blocker / 'sub'}"),
        "not-a-database": (f"sqlite:///{blocker}", f"{blocker} is not an SQLite database"),
        "unknown-scheme": ("mlfow://localhost:5000", "unknown scheme 'mlfow'"),
    }[case]
    code, line, seconds = specstop(tmp_path, capsys, "train", uri)
    assert code == 2 and seconds < FAST_S, (code, seconds)
    assert uri in line and expected in line and "mlflow.tracking_uri" in line
