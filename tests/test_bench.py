"""Stage `bench` end to end on tiny random models (draft = target, so every drafted token is
accepted), transformers' assisted generation included: metrics keys, losslessness, files."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from specstop.common.params import validate
from specstop.pipeline import bench

from stop_models import write_trained_outputs

CONTRACT = {"tokens_per_s", "speedup_vs_ar", "mean_accepted", "acceptance_rate", "target_calls",
            "draft_steps"}
METHODS = ["ar", "sd", "mcsd", "ti-mcsd", "ti-mcsd+confidence", "ti-mcsd+mlp",
           "ti-mcsd+stop_model", "ti-mcsd-lossy+stop_model", "hf-assisted"]


def test_bench_measures_every_method_side_by_side(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_trained_outputs(tmp_path, families=("logistic", "mlp"))
    Path("data/prompts").mkdir(parents=True)
    pq.write_table(pa.table({"prompt_id": ["a", "b", "c"], "text": ["hi", "hello there", "x"]}),
                   "data/prompts/test.parquet")
    tiny = str(tiny_model_dir)
    bench.run(validate({"models": {"target": tiny, "draft": tiny, "dtype": "float32", "device": "cpu"},
               "costs": {"path": "absent.json"},
               "collect": {"ti_width": 2, "max_depth": 3, "mcsd_branching": [2]},
               "bench": {"prompts": 2, "max_new_tokens": 6, "temperature": 0.8,
                         "assistant_draft": tiny}}))
    metrics = json.loads(Path("metrics/bench.json").read_text())
    for name in METHODS:
        assert CONTRACT | {"greedy_identical_to_ar"} <= set(metrics[name]), name
        assert CONTRACT <= set(metrics["sampling"][name]), name
        if "lossy" not in name:
            assert metrics[name]["greedy_identical_to_ar"], name
    exported = metrics["ti-mcsd+stop_model"]
    assert {"speedup_vs_hf_assisted", "speedup_vs_best_static_sd", "simulated_speedup",
            "measured_over_simulated"} <= set(exported)
    assert metrics["ti-mcsd"]["mean_accepted"] > 1 and metrics["ar"]["speedup_vs_ar"] == 1
    assert metrics["setup"]["hf_assisted"]["num_assistant_tokens"] == 20
    assert metrics["setup"]["sd_gamma"] == metrics["setup"]["static_gamma"] == 2
    assert metrics["latency"]["decision_ms"]["stop_model"] > 0
    assert set(metrics["latency"]["draft_step_ms"]) == {"1", "2"}
    with open("metrics/bench_plots/per_prompt.csv") as f:
        assert len(list(csv.DictReader(f))) == 2 * len(METHODS) * 2
    for name in ("speedup/greedy.csv", "speedup/sampling.csv", "accepted_length/greedy.csv",
                 "speedup.png", "accepted_length.png"):
        assert (Path("metrics/bench_plots") / name).is_file(), name
    table = Path("metrics/bench_plots/results.md").read_text().splitlines()
    assert [row.split(" | ")[0] for row in table[4:]] == [f"| `{name}`" for name in METHODS]
