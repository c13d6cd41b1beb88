"""The whole DAG on the `smoke` profile, in a workspace copy of this checkout: `dvc repro` from
nothing to the exported stop model, metrics, plots and MLflow runs; the analysis notebook on
its outputs; a second `dvc repro` that does nothing; a changed training param that re-runs
only train, export and bench.  The tests share one workspace and run in file order."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from specstop.decoder.policy import exported_lookup_branch
from specstop.decoder.stop_model import (BRANCH_WAYS, CONFIDENCE_WAY, STATIC_WAY, TREE_WAY,
                                         load_stop_model)
from specstop.models import settle
from specstop.pipeline.params import read_params_file
from specstop.pipeline.stage_record import read_records
from specstop.pipeline.workspace import make_workspace

from conftest import ROOT
from notebook_run import figures, run_notebook

pytestmark = pytest.mark.integration

STAGES = ["prepare", "prompts", "draft", "collect", "train", "export", "bench"]


def dvc(workspace: Path, *args: str) -> subprocess.CompletedProcess:
    """`dvc` in the workspace, with this interpreter's environment first on PATH."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(["dvc", *args], cwd=workspace, env=env, capture_output=True, text=True)


def stages_run(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return re.findall(r"Running stage '([^']+)'", result.stdout)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workspace with the smoke profile after one full `dvc repro`."""
    workspace = make_workspace(ROOT, tmp_path_factory.mktemp("smoke") / "project", "smoke",
                               read_params_file(ROOT / "params.yaml"))
    assert stages_run(dvc(workspace, "repro")) == STAGES
    return workspace


def test_repro_ends_with_stop_model_metrics_plots_and_runs(smoke: Path):
    policy = load_stop_model(smoke / "data/export/stop_model.pt")
    assert policy.meta["family"] in {"logistic", "lightgbm", "mlp"}
    draft = json.loads((smoke / "metrics/draft.json").read_text())
    assert 0 < draft["alpha"] <= 1 and draft["c"] > 0
    assert {"sd_speedup", "sd_acceptance", "precision", "dtype", "warning"} <= set(draft)
    assert set(draft["alpha_heldout"]) == {"tasks"}  # the held-out source, measured apart
    assert 0 <= draft["alpha_heldout"]["tasks"] <= 1 and draft["corpus"]["heldout"]["shards"]
    if not torch.cuda.is_available():  # trained on this CPU: its bf16 support decides
        assert draft["precision"] == ("bf16-mixed" if draft["cpu_native_bf16"] else "32-true")
    assert (draft["warning"] is None) == (draft["sd_speedup"] >= 1.0)
    train = json.loads((smoke / "metrics/train.json").read_text())
    for name in ["logistic", "lightgbm", "mlp"]:
        assert {"auc", "log_loss", "brier", "simulated_speedup", "fraction_of_oracle"} \
            <= set(train[name])
    assert train["oracle"]["simulated_speedup"] >= train["mlp"]["simulated_speedup"]
    bench = json.loads((smoke / "metrics/bench.json").read_text())
    assert train["replay"]["winner"]["family"] == policy.meta["family"]
    depth = policy.tree_rule.max_depth  # the superset tree collect logs, to the tuned depth
    assert 1 <= depth <= 4 and policy.tree_rule.branching == (3, 2, 2, 1)[:depth]
    assert train["replay"]["policies"][policy.meta["family"]]["depth"] == depth
    chosen = read_params_file(smoke / "params.yaml")["bench"]["methods"]
    assert {"ar-aa", "sd", "ti-mcsd", "static-tree", "tree+stop_model"} <= set(chosen)
    for method in ["ar", *[m for m in chosen if not m.startswith("hf-assisted")]]:  # no peer
        assert {"tokens_per_s", "speedup_vs_ar", "mean_accepted", "acceptance_rate",
                "greedy_identical_to_ar"} <= set(bench[method])
    assert bench["summary"]["domains"] == ["humaneval", "magpie"]
    assert bench["summary"]["winner_vs_best_static"]["ratio"] > 0
    # sampled rounds: a sampling tree rule tuned on them, exported, benched against static
    assert train["replay"]["sampling"]["temperature"] == 1.0
    assert policy.sampling_rule is not None and policy.sampling_rule.rank_accept
    assert bench["summary"]["sampling"]["best_static"] == "static-tree"
    assert bench["summary"]["sampling"]["winner_vs_best_static"]["ratio"] > 0
    settled = json.loads((smoke / "metrics/export.json").read_text())["settled"] or {}
    summary = json.loads((smoke / "data/train/summary.json").read_text())
    config = read_params_file(smoke / "params.yaml")["export"]["settle"]
    contested = {settle.MODES[greedy] for greedy in settle.contested(
        policy.meta, summary["static_shapes"], config["margin"], config.get("lookup", True),
        summary["confidence_tree_rule"])}
    assert set(settled) == contested and settled == policy.meta.get("settled", {})
    for greedy, mode in settle.MODES.items():  # the measured fastest way
        if mode not in settled:
            continue
        speeds = {settled[mode]["replay_decodes"]: 1.0,
                  **{way: r["ratio"] for way, r in settled[mode]["vs_replay"].items()}}
        assert settled[mode]["decodes"] == max(speeds, key=speeds.get)
        if STATIC_WAY in speeds and TREE_WAY in speeds:
            faster = speeds[STATIC_WAY] > speeds[TREE_WAY]
            assert (greedy in policy.static_shapes) == faster
            assert bench["setup"]["winner_static_tree"][mode] == (
                settled[mode]["static_tree"] if faster else None)
        chain = settled[mode]["decodes"] in BRANCH_WAYS
        assert exported_lookup_branch(policy, greedy) == chain
        confidence = settled[mode]["decodes"] == CONFIDENCE_WAY  # greedy only: its way there
        assert (greedy and policy.confidence_tree is not None) == confidence
        assert bench["setup"]["winner_method"][mode] == (
            "tree+stop_model+lookup" if chain else "tree+stop_model")
    assert bench["summary"]["winner"] == bench["setup"]["winner_method"]["greedy"]
    assert (smoke / "metrics/bench_plots/speedup.png").stat().st_size > 0
    assert len(list((smoke / "metrics/train_plots/speedup").glob("*.csv"))) >= 4
    assert (smoke / "metrics/draft_plots/learning_curve.csv").is_file()
    assert _runs(smoke, "specstop-draft") >= 1 and _runs(smoke, "specstop-train") >= 4
    records = read_records(smoke / "metrics/stages")
    assert list(records) == sorted(STAGES) and all(r["seconds"] > 0 for r in records.values())
    assert records["bench"]["achieved"]["prompts"] == bench["summary"]["prompts"]


def _runs(workspace: Path, experiment: str) -> int:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    found = client.get_experiment_by_name(experiment)
    return len(client.search_runs([found.experiment_id])) if found else 0


def test_notebook_runs_on_the_outputs(smoke: Path):
    assert figures(run_notebook(smoke)) == 5


def test_second_repro_does_nothing(smoke: Path):
    assert stages_run(dvc(smoke, "repro")) == []
    assert json.loads(dvc(smoke, "status", "--json").stdout) == {}


def test_a_training_param_reruns_only_train_export_bench(smoke: Path):
    path = smoke / "params.yaml"
    params = yaml.safe_load(path.read_text())
    params["train"]["mlp"]["lr"] *= 2
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    assert stages_run(dvc(smoke, "repro")) == ["train", "export", "bench"]
