"""A drafted round's work beyond its priced passes: measured beside them, charged by the tree
replay."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from specstop.common.errors import DataError
from specstop.decoder import dynamic, methods, overhead
from specstop.decoder.costs import CostCurve, CostModel, RoundWork
from specstop.decoder.kv import KVModel
from specstop.decoder.methods import DecodeConfig
from specstop.decoder.overhead import (measuring_policy, measuring_runs, outside_per_round,
                                       round_overhead, timed_passes)
from specstop.decoder.sampling import Sampling
from specstop.drafts.loading import load_runtime
from specstop.replay.tree_replay import TreeCosts

CONFIG = DecodeConfig(method="mcsd", max_new_tokens=12, max_depth=3, mcsd_branching=(2, 2))
SLEEP = 0.03
LEVEL_SLEEP = 0.1  # a level's: long beside what another test's load adds to a round's passes


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: Path):
    return load_runtime(str(tiny_model_dir), "layers:1", "float32", "cpu", cpu_kernel="aten")


@pytest.fixture(scope="module")
def prompts(runtime) -> list[torch.Tensor]:
    return [runtime.encode(text) for text in ("def f(x):", "Say hello to the")]


@pytest.fixture(scope="module")
def costs() -> CostModel:
    """Costs that price every pass and decision at a microsecond, so what a round spends shows
    whole, whatever else shares the host when the tests run."""
    return CostModel((1,), CostCurve({1: 1e-6, 16: 2e-6}), CostCurve({1: 1e-6}), 1e-6)


def outside(runtime, prompts, config, costs, policy=None) -> overhead.Outside:
    """One decoding's figure."""
    return outside_per_round(runtime, prompts, {"run": (config, policy)}, costs)["run"]


def policy():
    return measuring_policy((2, 2, 1), CostCurve({1: 1.0, 8: 1.2}))


def test_every_pass_is_timed_once_and_the_models_are_restored(runtime, prompts) -> None:
    with timed_passes(runtime.target, runtime.draft) as (target, draft):
        stats = runtime.generate(prompts[0], replace(CONFIG, method="tree"), policy()).stats
    assert len(target) == stats.target_calls and len(draft) == stats.draft_steps > 0
    assert all(width > 0 and t > 0 for width, t in target + draft)
    assert target[0][0] == prompts[0].shape[0]  # the prefill, at the prompt's width
    for lm in (runtime.target, runtime.draft):
        assert "extend" not in vars(lm) and "extend_with_hidden" not in vars(lm)
        assert type(lm).extend is KVModel.extend


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_host_work_outside_the_passes_is_what_the_overhead_counts(
        runtime, prompts, costs, monkeypatch, temperature: float) -> None:
    """A round that sleeps outside its passes and decisions spends the sleep beyond what its
    passes are priced at; the overhead is finite and in `ar` steps."""
    config = replace(CONFIG, method="tree", sampling=Sampling(temperature))
    verify_proposal = dynamic.DraftedTree.verify_proposal

    def slow(self, *args):
        time.sleep(SLEEP)
        return verify_proposal(self, *args)

    monkeypatch.setattr(dynamic.DraftedTree, "verify_proposal", slow)
    figure = outside(runtime, prompts, config, costs, policy())
    assert figure.seconds > SLEEP / 2 and figure.levels >= 1
    work = round_overhead(runtime, prompts, config, policy(), costs)
    assert set(work) == {"tree", "static"}
    assert all(np.isfinite([w.base, w.per_level]).all() and w.per_level >= 0
               for w in work.values())
    assert work["tree"].at(1) > 0 and work["tree"].at(1) > work["static"].at(1)  # the sleep
    # is the tree's only


def test_a_pass_slower_in_a_decode_than_its_price_is_charged_to_the_round(
        runtime, prompts, costs, monkeypatch) -> None:
    """The target's passes sleep inside the decode, not where the curve was measured: the
    rounds' unpriced seconds hold the sleep once a round (the prefill's aside)."""
    extend = KVModel.extend_with_hidden

    def slow(self, *args, **kwargs):
        if self is runtime.target:
            time.sleep(SLEEP)
        return extend(self, *args, **kwargs)

    config = replace(CONFIG, method="tree")
    fast = outside(runtime, prompts, config, costs, policy())
    monkeypatch.setattr(KVModel, "extend_with_hidden", slow)
    slowed = outside(runtime, prompts, config, costs, policy())
    assert slowed.seconds - fast.seconds > SLEEP / 2  # taking the passes' seconds out: 0


def test_the_decisions_are_taken_out_at_their_price(runtime, prompts, costs) -> None:
    """What the replay charges a decision (one a draft step) is what the overhead takes out,
    whatever the policy's decisions took: a dearer price leaves less, by the price a level."""
    config = replace(CONFIG, method="tree")
    cheap = outside(runtime, prompts, config, costs, policy())
    dear = outside(runtime, prompts, config, replace(costs, decision=10.0), policy())
    assert cheap.levels == dear.levels  # the same rounds (greedy)
    assert cheap.seconds - dear.seconds == pytest.approx((10.0 - 1e-6) * cheap.levels, rel=0.02)


def test_a_levels_host_work_is_charged_per_level(runtime, prompts, costs, monkeypatch) -> None:
    """A static round that sleeps in every level it drafts: its deeper measurement spends the
    sleep more a level (at least half of it, whatever else shares the host), and the static
    line is the one through its two measurements."""
    draft_level, measure = methods.draft_level, overhead.outside_per_round
    measured = {}

    def slow(*args, **kwargs):
        time.sleep(LEVEL_SLEEP)
        return draft_level(*args, **kwargs)

    def recorded(*args):
        measured.update(measure(*args))
        return measured

    monkeypatch.setattr(methods, "draft_level", slow)
    monkeypatch.setattr(overhead, "outside_per_round", recorded)
    work = round_overhead(runtime, prompts, CONFIG, policy(), costs)
    ar, shallow, deep = measured["ar"], measured["static"], measured["static_deep"]
    assert shallow.levels == 1 and deep.levels > 1.5
    assert (deep.seconds - shallow.seconds) / (deep.levels - shallow.levels) > LEVEL_SLEEP / 2
    assert work["static"] == overhead._line([shallow, deep], ar, costs.target.ar_seconds)
    assert work["static"].per_level > 0


def test_the_line_goes_through_the_deeper_figure_and_never_falls_per_level() -> None:
    ar = overhead.Outside(0.010, 0.0)
    shallow, deep = overhead.Outside(0.012, 1.0), overhead.Outside(0.018, 2.5)
    work = overhead._line([shallow, deep], ar, 0.1)
    assert work.per_level == pytest.approx(0.04) and work.at(2.5) == pytest.approx(0.08)
    assert work.at(1.0) == pytest.approx(0.02)
    falling = overhead._line([overhead.Outside(0.020, 1.0), deep], ar, 0.1)
    assert falling == RoundWork(pytest.approx(0.08), 0.0)
    credited = overhead._line([overhead.Outside(0.004, 1.0), overhead.Outside(0.002, 2.0)], ar,
                              0.1)  # both below ar's: a curve that priced the passes too high
    assert credited == RoundWork(0.0, 0.0)
    close = overhead._line([overhead.Outside(0.012, 2.4), deep], ar, 0.1)  # too close to fit
    assert close == RoundWork(pytest.approx(0.08), 0.0)


def test_the_static_rounds_decode_the_first_level_then_chains_without_a_dynamic_tree(
        runtime, prompts, monkeypatch) -> None:
    trees = []
    init = dynamic.DraftedTree.__init__
    monkeypatch.setattr(dynamic.DraftedTree, "__init__",
                        lambda self, *args: trees.append(1) or init(self, *args))
    runs = measuring_runs(CONFIG, policy())
    assert [runs[k][0].method for k in runs] == ["ar", "tree", "tree", "mcsd", "mcsd"]
    for name, depth in (("static", 1), ("static_deep", overhead.MEASURING_STATIC_DEPTH)):
        config, fixed = runs[name]
        assert config.mcsd_branching == (2,) and fixed.gamma == depth
        runtime.generate(prompts[0], config, fixed)
    assert not trees  # no dynamic tree built
    assert [runs[k][0].max_depth for k in ("tree", "tree_deep")] == [1, CONFIG.max_depth]
    runtime.generate(prompts[0], *runs["tree_deep"])
    assert trees


def test_every_prompt_is_decoded_by_every_run_in_a_turning_order(runtime, prompts, costs,
                                                                  monkeypatch) -> None:
    """Interleaved, so a drift of the host's speed falls on every run alike: after one warm-up
    each, prompt i is decoded by every run, starting at run i (mod the runs)."""
    order = []
    generate = type(runtime).generate

    def recorded(self, prompt, config, policy=None):
        order.append((config.method, config.max_depth, len(prompt)))
        return generate(self, prompt, config, policy)

    monkeypatch.setattr(type(runtime), "generate", recorded)
    runs = {"ar": (replace(CONFIG, method="ar"), None),
            "deep": (replace(CONFIG, method="tree"), policy()),
            "shallow": (replace(CONFIG, method="tree", max_depth=1), policy())}
    figures = outside_per_round(runtime, prompts * 2, runs, costs)
    assert set(figures) == set(runs) and figures["ar"].levels == 0 < figures["shallow"].levels
    keys = [(c.method, c.max_depth) for c, _ in runs.values()]
    length = [len(p) for p in prompts * 2]
    expected = [(*k, length[0]) for k in keys] + [
        (*keys[(i + j) % 3], length[i]) for i in range(4) for j in range(3)]
    assert order == expected


def test_the_cost_model_reads_the_overhead_and_the_tree_replay_charges_drafted_rounds(
        tmp_path: Path) -> None:
    raw = {"tree_sizes": [1, 3], "target": {"seconds": {"1": 0.1, "4": 0.12}},
           "draft": {"seconds": {"1": 0.01}},
           "round_overhead": {"tree": {"greedy": 0.05, "sampled": 0.2},
                              "static": {"greedy": 0.02, "sampled": 0.1}}}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(raw))
    model = CostModel.load(path)
    assert model.overhead(False) == RoundWork(0.05) and model.overhead(True) == RoundWork(0.2)
    assert model.overhead(False, static=True) == RoundWork(0.02)  # a base alone: an old table
    assert model.overhead(True, static=True) == RoundWork(0.1)
    plain = TreeCosts.from_model(model, 4, 2)
    assert (plain.round, plain.static_round) == (RoundWork(0.05), RoundWork(0.02))
    assert TreeCosts.from_model(model, 4, 2, sampled=True).static_round == RoundWork(0.1)
    per_level = {"tree": {"sampled": {"base": 0.03, "per_level": 0.04}}}
    path.write_text(json.dumps({**raw, "round_overhead": per_level}))
    assert CostModel.load(path).overhead(True) == RoundWork(0.03, 0.04)
    assert CostModel.load(path).overhead(True).at(2) == pytest.approx(0.11)
    path.write_text(json.dumps({**raw, "round_overhead": {"greedy": 0.05}}))
    assert CostModel.load(path).overhead(False, static=True) == RoundWork(0.05)  # one kind
    # timed: both
    del raw["round_overhead"]
    path.write_text(json.dumps(raw))
    assert CostModel.load(path).overhead(True) == RoundWork()  # a table from before the overhead
    for bad in ({"greedy": "nan"}, {"static": {"sampled": "inf"}}, {"tree": [0.1]},
                {"tree": {"greedy": {"per_level": 0.1}}},
                {"tree": {"greedy": {"base": 0.1, "per_level": "nan"}}}):
        path.write_text(json.dumps({**raw, "round_overhead": bad}))
        with pytest.raises(DataError, match=r"costs.json: not a cost model .*round_overhead"):
            CostModel.load(path)
