"""What a user sees in the MLflow UI, read back through MlflowClient: the experiments open on
their runs, the training runs show their datasets, and a bench run is linked both ways to the
registered model version (train -> export -> bench on synthetic rows, SQLite in a temp folder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from specstop.bench.tracking import check_store, log_bench
from specstop.common import tracking
from specstop.common.errors import SpecstopError
from specstop.common.params import ExportConfig, validate
from specstop.decoder.stop_model import read_stop_model
from specstop.collection import data
from specstop.models import experiment
from specstop.models.export import export
from specstop.pipeline import bench as bench_stage

from synthetic_rows import make_collect
from test_train import params_for

KIND = ("mlflow.experimentKind", "custom_model_development")
RATIO = {"ratio": 1.2, "ci95": [1.1, 1.3]}
PNG = b"\x89PNG\r\n\x1a\n"


def bench_metrics() -> dict:
    """bench.json as stage bench writes it, cut down to what the run logs."""
    method = {"tokens_per_s": 30.0, "speedup_vs_ar": 1.5, "speedup_vs_ar_ci95": [1.4, 1.6]}
    return {"ar": {**method, "speedup_vs_ar": 1.0}, "ti-mcsd+stop_model": method,
            "sampling": {"ar": method, "sd": {**method, "tokens_per_s": 25.0}},
            "setup": {"prompts": 8, "max_new_tokens": 64, "device": "cpu",
                      "sampling_methods": ["sd"], "peers": {"hf-assisted": {"num_assistant_tokens": 20}}},
            "latency": {"decision_ms": {"stop_model": 0.2}},
            "summary": {"winner": "ti-mcsd+stop_model", "prompts": 8, "domains": ["chat"],
                        "winner_vs_best_static": RATIO, "winner_vs_ar": RATIO,
                        "winner_vs_hf_assisted": None,
                        "aa_noise": {"ratio": 1.0, "ci95": None},
                        "sampling": {"best_static": "sd", "winner_vs_best_static": RATIO,
                                     "winner_vs_ar": None},
                        "lookup": {"alone_vs_ar": {"all": RATIO,
                                                   "chat": {"ratio": 0.9, "ci95": None}},
                                   "tree_with_vs_without": None}},
            "targets": {"winner_faster_than_best_static": True}}


def write_bench(folder: Path) -> tuple[dict, Path, Path]:
    """bench.json and its plots folder (the table, the CSV, a PNG, DVC's plot data)."""
    metrics, plots = bench_metrics(), folder / "bench_plots"
    (plots / "speedup").mkdir(parents=True, exist_ok=True)
    (plots / "results.md").write_text("| method | speedup |\n")
    (plots / "per_prompt.csv").write_text("prompt_id,method\n")
    (plots / "speedup.png").write_bytes(PNG)
    (plots / "speedup" / "greedy.csv").write_text("method,speedup_vs_ar\n")
    bench_json = folder / "bench.json"
    bench_json.write_text(json.dumps(metrics))
    return metrics, bench_json, plots


@pytest.fixture(autouse=True)
def in_tmp(monkeypatch, tmp_path):
    """The project's store only, and run artifacts under the test's folder."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """Synthetic rows -> stage train (logistic) -> stage export, in a temp folder."""
    folder = tmp_path_factory.mktemp("ui")
    make_collect(folder / "collect", prompts={"train": 10, "val": 4}, rounds=10)
    params = params_for(folder, families=["logistic"])
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        store = params.mlflow.store("train")
        experiment.run(params.train, store)
        config = ExportConfig(train=folder / "train", data=folder / "collect",
                              out=folder / "export", metrics=folder / "metrics" / "export.json")
        export(config, store)
    return folder, params, config


def client_of(params) -> MlflowClient:
    return MlflowClient(params.mlflow.tracking_uri)


def runs_by_name(client: MlflowClient, name: str) -> dict:
    experiment_id = client.get_experiment_by_name(name).experiment_id
    return {r.info.run_name: r for r in client.search_runs([experiment_id])}


def test_the_train_experiment_opens_on_its_runs(registered):
    folder, params, _ = registered
    client = client_of(params)
    train = client.get_experiment_by_name("specstop-train")
    assert train.tags.get(KIND[0]) == KIND[1]


def test_a_kind_chosen_in_the_ui_is_kept(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking.start(uri, "specstop-kept")
    client = MlflowClient(uri)
    experiment_id = client.get_experiment_by_name("specstop-kept").experiment_id
    client.set_experiment_tag(experiment_id, KIND[0], "genai_development")
    tracking.start(uri, "specstop-kept")
    assert client.get_experiment(experiment_id).tags[KIND[0]] == "genai_development"


def test_training_runs_show_their_datasets(registered):
    folder, params, config = registered
    dataset = data.load(folder / "collect")
    _, meta = read_stop_model(config.out / "stop_model.pt")
    assert meta["dataset_digest"] == dataset.digest  # what the export records
    runs = runs_by_name(client_of(params), "specstop-train")
    expected = {"logistic": {"collect-train": ("training", len(dataset.train.rows)),
                             "collect-val": ("validation", len(dataset.val.rows))},
                "baselines": {"collect-val": ("validation", len(dataset.val.rows))}}
    for run_name, datasets in expected.items():
        inputs = runs[run_name].inputs.dataset_inputs
        seen = {i.dataset.name: ({t.key: t.value for t in i.tags}["mlflow.data.context"],
                                 json.loads(i.dataset.profile)["num_rows"]) for i in inputs}
        assert seen == datasets, run_name
        for i in inputs:
            assert i.dataset.digest == dataset.digest[:36]
            assert json.loads(i.dataset.source) == {"uri": str((folder / "collect").resolve())}
            assert i.dataset.source_type == "local"


def test_a_bench_run_is_linked_to_the_registered_version(registered, tmp_path, capsys):
    folder, params, config = registered
    metrics, bench_json, plots = write_bench(tmp_path)
    store = params.mlflow.store("bench")
    run_id = log_bench(metrics, bench_json, plots, config.metrics, store)
    client, export_metrics = client_of(params), json.loads(config.metrics.read_text())
    bench = client.get_experiment_by_name("specstop-bench")
    assert bench.tags.get(KIND[0]) == KIND[1]
    run = client.get_run(run_id)
    assert run.info.experiment_id == bench.experiment_id
    logged = run.data.metrics
    assert logged["summary.winner_vs_ar.ratio"] == 1.2
    assert (logged["summary.winner_vs_ar.ci95_lo"], logged["summary.winner_vs_ar.ci95_hi"]) \
        == (1.1, 1.3)
    assert logged["summary.aa_noise.ratio"] == 1.0 and "summary.aa_noise.ci95_lo" not in logged
    assert not any(k.startswith("summary.winner_vs_hf_assisted") for k in logged)
    assert logged["ti-mcsd_stop_model.speedup_vs_ar"] == 1.5
    assert logged["sampling.sd.tokens_per_s"] == 25.0
    assert logged["summary.sampling.winner_vs_best_static.ratio"] == 1.2
    assert run.data.params["summary.sampling.best_static"] == "sd"
    assert logged["summary.lookup.alone_vs_ar.all.ci95_hi"] == 1.3
    assert logged["summary.lookup.alone_vs_ar.chat.ratio"] == 0.9
    assert not any(k.startswith("summary.lookup") for k in run.data.params)
    assert not any(k.startswith("summary.sampling.winner_vs") for k in run.data.params)
    assert run.data.params["prompts"] == "8"
    assert run.data.params["peers.hf-assisted.num_assistant_tokens"] == "20"
    assert run.data.params["summary.winner"] == "ti-mcsd+stop_model"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert artifacts == {"bench.json", "results.md", "per_prompt.csv", "speedup.png"}
    tags = run.data.tags
    version = str(export_metrics["model_version"])
    assert (tags["registered_model"], tags["model_version"]) == \
        (export_metrics["registered_model"], version)
    assert (tags["model_run_id"], tags["model_uri"]) == \
        (export_metrics["mlflow_run_id"], export_metrics["model_uri"])
    model = client.get_model_version(export_metrics["registered_model"], version)
    assert model.tags["bench_run_id"] == run_id
    assert model.tags["bench_winner_vs_ar"] == "1.200"
    assert f"MLflow run {run_id}" in capsys.readouterr().out


@pytest.mark.parametrize("export_json, why", [
    (None, "not found"),
    ({"registered_model": "specstop-stop-model", "model_version": 99}, "not in this tracking")])
def test_a_bench_run_without_its_model_is_logged_unlinked(registered, tmp_path, capsys,
                                                          export_json, why):
    folder, params, _ = registered
    export_metrics = tmp_path / "export.json"
    if export_json is not None:
        export_metrics.write_text(json.dumps(export_json))
    run_id = log_bench(*write_bench(tmp_path), export_metrics, params.mlflow.store("bench"))
    run = client_of(params).get_run(run_id)
    assert "registered_model" not in run.data.tags
    assert run.data.metrics["summary.winner_vs_ar.ratio"] == 1.2
    lines = [line for line in capsys.readouterr().out.splitlines() if "not linked" in line]
    assert len(lines) == 1 and why in lines[0]


def test_the_stage_checks_the_store_first_and_logs_the_bench_after(tmp_path, monkeypatch):
    calls = []

    def fake_bench(config, models, collect, costs) -> dict:
        calls.append(config)
        return write_bench(tmp_path)[0]

    monkeypatch.setattr(bench_stage.bench, "run", fake_bench)
    bench = {"metrics": str(tmp_path / "bench.json"), "plots": str(tmp_path / "bench_plots")}
    bad = validate({"bench": bench, "mlflow": {"tracking_uri": "bogus://nowhere"}})
    with pytest.raises(SpecstopError, match="unknown scheme"):
        bench_stage.run(bad)
    with pytest.raises(SpecstopError, match="unknown scheme"):
        check_store(bad.mlflow.store("bench"))
    assert calls == []
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    bench_stage.run(validate({"bench": bench, "mlflow": {"tracking_uri": uri},
                              "export": {"metrics": str(tmp_path / "absent.json")}}))
    assert len(calls) == 1
    runs = runs_by_name(MlflowClient(uri), "specstop-bench")
    assert runs["bench"].data.metrics["summary.winner_vs_ar.ratio"] == 1.2
