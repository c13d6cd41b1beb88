"""Stage `bench` end to end on tiny random models (draft = target, so every drafted token is
accepted), transformers' peers included: metrics keys, losslessness, summary, files; and the
paired bootstrap ratio and the rounds-only ratio on synthetic timings."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specstop.bench import report as bench_report
from specstop.bench import run as bench
from specstop.common.errors import SpecstopError
from specstop.common.params import Params, validate
from specstop.decoder.loop import DecodeStats
from specstop.evaluation.intervals import speed_ratio
from specstop.evaluation.side_by_side import MethodResult

from stop_models import write_stop_model, write_trained_outputs

CONTRACT = {"tokens_per_s", "speedup_vs_ar", "mean_accepted", "acceptance_rate", "target_calls",
            "draft_steps"}
METHODS = ["ar", "ar-aa", "sd", "mcsd", "ti-mcsd", "ti-mcsd+confidence", "ti-mcsd+mlp",
           "ti-mcsd+stop_model", "static-tree", "tree+confidence", "tree+mlp", "tree+stop_model",
           "tree+confidence+lookup", "tree+stop_model+lookup", "ti-mcsd-lossy", "sd-compact",
           "hf-assisted",
           "hf-assisted-static", "lookup", "hf-prompt-lookup"]
SAMPLED = ["ar", "sd", "tree+stop_model", "hf-assisted-static"]


def run_bench(params: Params) -> dict:
    return bench.run(params.bench, params.models, params.collect, params.costs)


def test_bench_measures_every_method_side_by_side(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_trained_outputs(tmp_path, families=("logistic", "mlp"))
    Path("data/prompts").mkdir(parents=True)
    pq.write_table(pa.table({"prompt_id": ["a", "b", "c", "d"],
                             "text": ["hi", "x", "hello there", "y"],
                             "source": ["code", "code", "chat", "chat"]}),
                   "data/prompts/test.parquet")
    tiny, peer = str(tiny_model_dir), shutil.copytree(tiny_model_dir, tmp_path / "peer")
    metrics = run_bench(validate(
        {"models": {"target": tiny, "draft": tiny, "dtype": "float32", "device": "cpu"},
         "costs": {"path": "absent.json"},
         "collect": {"ti_width": 2, "max_depth": 3, "mcsd_branching": [2]},
         "bench": {"prompts": 3, "max_new_tokens": 6, "temperature": 0.8,
                   "assistant_draft": str(peer), "sampling_methods": SAMPLED[1:],
                   "bootstrap_resamples": 200}}))
    assert metrics == json.loads(Path("metrics/bench.json").read_text())
    assert list(bench_report.methods(metrics)) == METHODS
    assert list(metrics["sampling"]) == SAMPLED
    for name in METHODS:
        assert CONTRACT | {"greedy_identical_to_ar", "speedup_vs_ar_ci95"} <= set(metrics[name])
        if "lossy" not in name:
            assert metrics[name]["greedy_identical_to_ar"], name
            assert metrics[name]["max_divergence_gap"] is None, name
    for name in SAMPLED:
        assert CONTRACT <= set(metrics["sampling"][name]), name
    summary = metrics["summary"]
    assert summary["winner"] == "tree+stop_model" and summary["prompts"] == 3
    assert summary["domains"] == ["chat", "code"]  # one from each source in turn
    assert summary["prompts_per_domain"] == {"chat": 1, "code": 2}
    for name in METHODS:  # every method against ar on each domain's prompts too
        assert set(metrics[name]["speedup_vs_ar_by_domain"]) == {"chat", "code"}, name
    lookup = summary["lookup"]
    for key in ("tree_with_vs_without", "alone_vs_ar", "hf_prompt_lookup_vs_ar",
                "alone_vs_hf_prompt_lookup", "tree_with_vs_alone"):
        assert set(lookup[key]) == {"all", "chat", "code"}, key
        low, high = lookup[key]["all"]["ci95"]
        assert low <= lookup[key]["all"]["ratio"] <= high, key
    assert lookup["alone_vs_ar"]["all"]["ratio"] == pytest.approx(
        metrics["lookup"]["speedup_vs_ar"])
    assert lookup["alone_vs_ar"]["code"] == metrics["lookup"]["speedup_vs_ar_by_domain"]["code"]
    assert lookup["tree_with_vs_without"]["chat"]["ci95"] is None  # one chat prompt
    assert summary["best_static"] in ("sd", "sd-compact", "mcsd", "ti-mcsd", "static-tree")
    for key in ("winner_vs_best_static", "winner_vs_ar", "winner_vs_hf_assisted",
                "winner_vs_confidence_tree", "sd_vs_hf_assisted_same_draft", "aa_noise"):
        low, high = summary[key]["ci95"]
        assert low <= summary[key]["ratio"] <= high, key
    assert summary["winner_vs_ar"]["ratio"] == metrics["tree+stop_model"]["speedup_vs_ar"]
    sampled = summary["sampling"]  # the exported policy sampled, against ar and sd (static)
    assert sampled["best_static"] == "sd"
    assert sampled["winner_vs_ar"]["ratio"] == \
        metrics["sampling"]["tree+stop_model"]["speedup_vs_ar"]
    low, high = sampled["winner_vs_best_static"]["ci95"]
    assert low <= sampled["winner_vs_best_static"]["ratio"] <= high
    best = metrics[summary["best_static"]]["tokens_per_s"]
    assert summary["winner_vs_best_static"]["ratio"] == pytest.approx(
        metrics["tree+stop_model"]["tokens_per_s"] / best)
    tree = metrics["tree+stop_model"]
    assert tree["verified_tokens"] <= tree["drafted_tokens"]
    assert summary["winner_decision_share"] == tree["decision_share"] and 0 < \
        tree["decision_share"] < 1
    assert tree["measured_over_simulated"] == pytest.approx(tree["round_speedup_vs_ar"] / 1.2)
    assert tree["round_speedup_vs_ar"] != tree["speedup_vs_ar"]  # the prefills left out
    peers = metrics["setup"]["peers"]
    assert peers["same_draft_sd"] == "sd-compact" and peers["draft"] == str(peer)
    assert peers["hf-assisted"]["num_assistant_tokens"] == 20
    assert peers["hf-assisted-static"] == {"num_assistant_tokens": 2,
                                           "num_assistant_tokens_schedule": "constant",
                                           "assistant_confidence_threshold": 0.0}
    assert peers["hf-prompt-lookup"]["prompt_lookup_num_tokens"] == 10
    assert metrics["hf-assisted-static"]["mean_accepted"] > 1  # the draft is the target
    assert metrics["ti-mcsd"]["mean_accepted"] > 1 and metrics["ar"]["speedup_vs_ar"] == 1
    assert metrics["setup"]["sd_gamma"] == metrics["setup"]["static_gamma"] == 2
    assert metrics["latency"]["decision_ms"]["stop_model"] > 0
    assert set(metrics["latency"]["draft_step_ms"]) == {"1", "2"}
    with open("metrics/bench_plots/per_prompt.csv") as f:
        assert len(list(csv.DictReader(f))) == 3 * (len(METHODS) + len(SAMPLED))
    for name in ("speedup/greedy.csv", "speedup/sampling.csv", "accepted_length/greedy.csv",
                 "speedup.png", "accepted_length.png"):
        assert (Path("metrics/bench_plots") / name).is_file(), name
    table = Path("metrics/bench_plots/results.md").read_text().splitlines()
    assert [row.split(" | ")[0] for row in table[4:4 + len(METHODS)]] == \
        [f"| `{name}`" for name in METHODS]


def test_a_chosen_few_methods_and_no_sampling_pass(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_trained_outputs(tmp_path, families=("logistic",))
    Path("data/prompts").mkdir(parents=True)
    pq.write_table(pa.table({"prompt_id": ["a", "b"], "text": ["hi", "x"],
                             "source": ["code", "code"]}), "data/prompts/test.parquet")
    tiny = str(tiny_model_dir)
    metrics = run_bench(validate(
        {"models": {"target": tiny, "draft": tiny, "dtype": "float32", "device": "cpu"},
         "costs": {"path": "absent.json"}, "collect": {"ti_width": 2, "max_depth": 3},
         "bench": {"max_new_tokens": 4, "methods": ["ti-mcsd", "hf-prompt-lookup"],
                   "sampling_methods": [], "bootstrap_resamples": 100}}))
    assert list(bench_report.methods(metrics)) == ["ar", "ti-mcsd", "hf-prompt-lookup"]
    assert metrics["sampling"] == {}
    summary = metrics["summary"]
    assert summary["winner"] is None and summary["best_static"] == "ti-mcsd"
    assert summary["winner_vs_ar"] is None and summary["aa_noise"] is None
    assert (Path("metrics/bench_plots") / "speedup.png").is_file()
    readme = Path("README.md")
    readme.write_text(f"intro\n{bench_report.README_START}\nold table\n"
                      f"{bench_report.README_END}\noutro\n")
    bench_report.update_readme(readme, metrics)
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{bench_report.README_END}\noutro\n")
    assert "old table" not in text and "| `hf-prompt-lookup` |" in text
    readme.write_text("no markers\n")
    with pytest.raises(SpecstopError, match="README.md: expected one"):
        bench_report.update_readme(readme, metrics)


def test_the_exported_fallback_runs_ar_and_reports_its_rounds_gated(tmp_path, tiny_model_dir,
                                                                   monkeypatch):
    """A stop model exported where nothing pays (`fallback: ar`): `tree+stop_model` is `ar`."""
    monkeypatch.chdir(tmp_path)
    write_trained_outputs(tmp_path, families=("logistic",))
    write_stop_model(Path("data/export/stop_model.pt"), fallback="ar", gated_speedup=1.0,
                     gated_share=1.0)
    Path("data/prompts").mkdir(parents=True)
    pq.write_table(pa.table({"prompt_id": ["a", "b"], "text": ["hi", "x"],
                             "source": ["code", "chat"]}), "data/prompts/test.parquet")
    tiny = str(tiny_model_dir)
    metrics = run_bench(validate(
        {"models": {"target": tiny, "draft": tiny, "dtype": "float32", "device": "cpu"},
         "costs": {"path": "absent.json"}, "collect": {"ti_width": 2, "max_depth": 3},
         "bench": {"max_new_tokens": 5, "methods": ["tree+stop_model"],
                   "sampling_methods": [], "bootstrap_resamples": 100}}))
    tree, ar = metrics["tree+stop_model"], metrics["ar"]
    assert tree["greedy_identical_to_ar"] and tree["draft_steps"] == 0
    assert (tree["gated_share"], ar["gated_share"]) == (1.0, 0.0)
    assert tree["simulated_speedup"] == 1.0 and tree["target_calls"] == ar["target_calls"]
    assert metrics["setup"]["winner_fallback"] == "ar"


def test_an_unknown_sampling_method_is_refused_before_the_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecstopError, match=r"bench\.sampling_methods\[0\]: expected one of "):
        validate({"bench": {"sampling_methods": ["sdd"]}})  # by the schema, before any stage
    write_trained_outputs(tmp_path, families=("logistic", "mlp"))
    with pytest.raises(SpecstopError, match=r"^bench\.sampling_methods: unknown method "
                                            r"'tree\+lightgbm' "):  # a family not trained
        run_bench(validate({"models": {"target": "absent", "draft": "absent"},
                            "bench": {"sampling_methods": ["tree+lightgbm"]}}))


def test_the_paired_bootstrap_recovers_a_known_ratio():
    rng = np.random.default_rng(0)
    seconds = rng.uniform(2, 9, 30)  # prompts of very different lengths
    tokens = [128] * 30
    exact = speed_ratio(tokens, seconds / 1.25, tokens, seconds)
    assert exact.ratio == pytest.approx(1.25) and exact.ci95 == pytest.approx((1.25, 1.25))
    noisy = speed_ratio(tokens, seconds / 1.25 * rng.lognormal(0, 0.05, 30), tokens, seconds,
                        resamples=2000)
    low, high = noisy.ci95
    assert 1.2 < low < noisy.ratio < high < 1.3
    unpaired = speed_ratio(tokens, rng.permutation(seconds) / 1.25, tokens, seconds,
                           resamples=2000)
    assert unpaired.ci95[1] - unpaired.ci95[0] > 3 * (high - low)  # pairing is what narrows it
    assert speed_ratio([10], [1.0], [10], [2.0]).as_dict() == {"ratio": 2.0, "ci95": None}


def test_the_replay_is_compared_with_the_rounds_alone():
    """A prefill the replay does not price (the same for both methods) dilutes the end-to-end
    ratio; `measured_over_simulated` divides the rounds' ratio by the replayed speed."""
    def result(name: str, round_seconds: float) -> MethodResult:
        stats = [DecodeStats(new_tokens=40, seconds=round_seconds + 0.1, prefill_seconds=0.1)
                 for _ in range(3)]
        return MethodResult(name, DecodeStats(), per_prompt=stats, identical=[True] * 3,
                            logprobs=[0.0] * 3)

    inputs = bench_report.Inputs({"greedy": [result("ar", 0.6), result("tree", 0.4)]},
                                 ["a", "b", "c"], ["code"] * 3, None,
                                 {"greedy": {"tree": 1.6}}, 100, 0)
    tree = bench_report._mode(inputs, "greedy")["tree"]
    assert tree["speedup_vs_ar"] == pytest.approx(0.7 / 0.5)
    assert tree["round_speedup_vs_ar"] == pytest.approx(1.5)
    assert tree["measured_over_simulated"] == pytest.approx(1.5 / 1.6)


def test_the_summary_names_the_method_that_decodes_the_file_its_own_way():
    """Where the exported file adds the lookup branch in a mode, the summary's winner is
    `tree+stop_model+lookup` there and every winner ratio is that method's."""
    def result(name: str, seconds: float) -> MethodResult:
        stats = [DecodeStats(new_tokens=40, seconds=seconds * (1 + i / 10)) for i in range(3)]
        return MethodResult(name, DecodeStats(), per_prompt=stats, identical=[True] * 3,
                            logprobs=[0.0] * 3)

    names = {"ar": 1.0, "static-tree": 0.8, "tree+stop_model": 0.7, "tree+confidence+lookup": 0.65,
             "tree+stop_model+lookup": 0.6}
    results = {mode: [result(name, seconds) for name, seconds in names.items()]
               for mode in ("greedy", "sampling")}
    winners = {"greedy": "tree+stop_model+lookup", "sampling": "tree+stop_model"}
    inputs = bench_report.Inputs(results, ["a", "b", "c"], ["code"] * 3, None,
                                 {"greedy": {}, "sampling": {}}, 100, 0, winners)
    greedy, sampled = (bench_report._mode(inputs, mode) for mode in ("greedy", "sampling"))
    summary = bench_report._summary(inputs, greedy)
    assert summary["winner"] == "tree+stop_model+lookup"
    assert summary["winner_vs_ar"]["ratio"] == pytest.approx(1 / 0.6)
    assert summary["winner_vs_best_static"]["ratio"] == pytest.approx(0.8 / 0.6)
    assert summary["lookup"]["tree_with_vs_confidence_tree_with"]["all"]["ratio"] == \
        pytest.approx(0.65 / 0.6)
    sampling = bench_report._sampling_summary(inputs, sampled)
    assert sampling["winner"] == "tree+stop_model"
    assert sampling["winner_vs_best_static"]["ratio"] == pytest.approx(0.8 / 0.7)


def test_a_sampled_winner_the_replay_does_not_price_reports_its_trees_replay_instead():
    """Sampled, the lookup branch has no replay: the winner's rounds-vs-replay is null, and the
    summary and its claim give the exported tree's, which has one."""
    results = {"sampling": [MethodResult(name, DecodeStats(), per_prompt=[
        DecodeStats(new_tokens=40, target_calls=21, seconds=s * f) for s in (1.0, 1.1)],
        identical=[True] * 2, logprobs=[0.0] * 2)
        for name, f in (("ar", 1.0), ("static-tree", 0.8), ("tree+stop_model", 0.8),
                        ("tree+stop_model+lookup", 0.7))]}
    winners = {"greedy": "tree+stop_model", "sampling": "tree+stop_model+lookup"}
    inputs = bench_report.Inputs(results, ["a", "b"], ["code"] * 2, None,
                                 {"sampling": {"tree+stop_model": 1.5}}, 100, 0, winners)
    sampling = bench_report._sampling_summary(inputs, bench_report._mode(inputs, "sampling"))
    assert sampling["winner_measured_over_simulated"] is None
    assert sampling["tree_measured_over_simulated"] == pytest.approx(1.25 / 1.5)
    metrics = {"summary": {"winner": "tree+stop_model", "best_static": "static-tree",
                           "winner_vs_best_static": None, "winner_vs_ar": None,
                           "winner_vs_sd": None, "hf_assisted_best": None, "prompts": 2,
                           "prompts_per_domain": {"code": 2}, "aa_noise": None,
                           "max_divergence_gap": None, "sampling": sampling}}
    assert any(line.endswith("`tree+stop_model`'s rounds vs its replay 0.83")
               for line in bench_report.claims(metrics))


def test_a_tuned_threshold_at_infinity_is_the_probability_it_means():
    """The replay's "never stop" / "stop after a level" (-inf / +inf) run as 0 / 1."""
    assert [bench._probability(t) for t in (-math.inf, 0.3, math.inf)] == [0.0, 0.3, 1.0]


def test_static_tree_decodes_each_modes_best_static_shape(tmp_path, monkeypatch):
    """Greedy, the greedy replay's best static shape; sampled, the sampled replay's."""
    monkeypatch.chdir(tmp_path)
    write_trained_outputs(tmp_path, families=("logistic",))
    train = json.loads(Path("metrics/train.json").read_text())
    train["replay"]["sampling"] = {"policies": {"static_tree": {
        "simulated_speedup": 1.05, "widths": [3, 1, 1], "depth": 1}}}
    Path("metrics/train.json").write_text(json.dumps(train))
    config = validate({"bench": {"prompts": 2}}).bench
    plan = bench._plan(config, validate({}).models)
    assert plan.static_tree == {"greedy": {"widths": [2, 1, 1], "depth": 2},
                                "sampling": {"widths": [3, 1, 1], "depth": 1}}

    class Recorded:  # a runtime that returns what it was asked to decode
        def generate(self, prompt, config, policy, seed):
            return config, policy

    for temperature, widths, depth in [(0.0, (2, 1, 1), 2), (0.8, (3, 1, 1), 1)]:
        base = bench._base_config(config, validate({}).collect, temperature)
        methods = {m.name: m for m in bench._methods(Recorded(), base, plan, None, 10)}
        decoded, policy = methods["static-tree"].decode(None, 0)
        assert (decoded.method, decoded.mcsd_branching, policy.gamma) == ("mcsd", widths, depth)
