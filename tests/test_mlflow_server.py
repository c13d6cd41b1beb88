"""The training runs read back through a real `mlflow server` (loopback, SQLite in tmp_path).

Skipped only when the server cannot start within STARTUP_S."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from specstop.common.params import validate
from specstop.pipeline import train

from synthetic_rows import make_collect

STARTUP_S = 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def wait_until_up(base: str, server: subprocess.Popen) -> bool:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    return False


def test_runs_are_served_by_mlflow_server(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    make_collect(tmp_path / "collect", prompts={"train": 10, "val": 4}, rounds=10)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    train.run(validate({"train": {"data": "collect", "out": "train", "metrics": "train.json",
                                  "plots": "plots", "threshold_grid": 20,
                                  "families": ["logistic", "lightgbm"],
                                  "lightgbm": {"n_estimators": 20, "num_leaves": 7}},
                        "mlflow": {"tracking_uri": store}}))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", store,
         "--artifacts-destination", str(tmp_path / "mlruns"), "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        if not wait_until_up(base, server):
            pytest.skip(f"mlflow server did not start within {STARTUP_S} s")
        experiment = call(base, "/api/2.0/mlflow/experiments/get-by-name"
                                "?experiment_name=specstop-train")["experiment"]
        runs = call(base, "/api/2.0/mlflow/runs/search",
                    {"experiment_ids": [experiment["experiment_id"]]})["runs"]
        by_name = {r["info"]["run_name"]: r for r in runs}
        assert {"logistic", "lightgbm", "baselines"} <= set(by_name)
        metrics = {m["key"]: m["value"] for m in by_name["lightgbm"]["data"]["metrics"]}
        assert {"auc", "brier", "log_loss", "simulated_speedup", "fraction_of_oracle"} \
            <= set(metrics)
        summary = json.loads((tmp_path / "train" / "summary.json").read_text())
        assert summary["families"]["lightgbm"]["run_id"] == by_name["lightgbm"]["info"]["run_id"]
        tags = {t["key"]: t["value"] for t in experiment.get("tags", [])}
        assert tags.get("mlflow.experimentKind") == "custom_model_development"  # the runs first
        inputs = by_name["lightgbm"]["inputs"]["dataset_inputs"]  # the Dataset column
        assert {i["dataset"]["name"]: i["dataset"]["digest"] for i in inputs} == \
            {"collect-train": summary["dataset_digest"][:36],
             "collect-val": summary["dataset_digest"][:36]}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
