"""Stage export's settle (`models.settle`): which replays are close enough to decode, the
measured faster kind written into the winner's file, and nothing loaded where no replay is
close; the decodes themselves on a tiny model."""

from __future__ import annotations

import pytest
import torch

from specstop.decoder.loop import DecodeConfig
from specstop.drafts.loading import load_runtime
from specstop.decoder.stop_model import LearnedPolicy
from specstop.evaluation.intervals import Ratio
from specstop.models import settle

from stop_models import TREE_RULE, linear_module, metadata

STATIC = {"widths": [2, 1, 1], "depth": 1, "speedup": 1.52}


def stop_meta(**changes) -> dict:
    """A winner whose tree replayed at 1.5x `ar` greedy and sampled, no static shape chosen."""
    return metadata(**{"gated_speedup": 1.5, "sampling_tree_rule": TREE_RULE,
                       "sampling_tree_speedup": 1.5, "sampling_temperature": 0.7,
                       "static_tree": None, "sampling_static_tree": None, "fallback": None,
                       **changes})


def test_only_replays_within_the_margin_are_contested():
    shapes = {"greedy": STATIC, "sampling": {**STATIC, "speedup": 1.6}}
    assert settle.contested(stop_meta(), shapes, 0.05) == {True: STATIC}
    assert set(settle.contested(stop_meta(), shapes, 0.07)) == {True, False}
    assert settle.contested(stop_meta(), shapes, 0.0) == {}  # the replay decides alone
    assert settle.contested(stop_meta(fallback="ar"), shapes, 0.05) == {}  # no tree drafts
    no_rule = stop_meta(sampling_tree_rule=None)
    assert set(settle.contested(no_rule, {**shapes, "greedy": None}, 1.0)) == set()
    behind = stop_meta(gated_speedup=None, tree_speedup=1.45)  # no gate: the tree's own speed
    assert settle.contested(behind, shapes, 0.05) == {True: STATIC}
    assert settle.contested(behind, shapes, 0.04) == {}


def test_the_measured_faster_kind_is_what_the_file_decodes(monkeypatch):
    """Greedy the replay chose the tree and the static shape decodes faster; sampled the replay
    chose the static shape and the tree decodes faster: each is turned to the measured one."""
    meta = stop_meta(sampling_static_tree={**STATIC, "speedup": 1.51})
    shapes = {"greedy": STATIC, "sampling": {**STATIC, "speedup": 1.51}}
    measured = {True: Ratio(1.04, (1.01, 1.07)), False: Ratio(0.97, (0.94, 1.0))}
    calls = []
    monkeypatch.setattr(settle, "measured",
                        lambda run, module, tree, static, greedy: measured[greedy])

    def decoding():
        calls.append(1)
        return settle.Decoding(None, [torch.tensor([1, 2])] * 3, DecodeConfig(method="tree"))

    out = settle.settle(None, meta, shapes, 0.05, decoding)
    assert calls == [1]  # the models load once, for both modes
    assert out["static_tree"] == STATIC and out["sampling_static_tree"] is None
    assert out["settled"]["greedy"] == {
        "static_tree": STATIC, "tree_speedup": 1.5,
        "static_vs_tree": {"ratio": 1.04, "ci95": [1.01, 1.07]}, "prompts": 3,
        "decodes": "static tree", "replay_decodes": "tree"}
    assert (out["settled"]["sampling"]["decodes"], out["settled"]["sampling"]["replay_decodes"]) \
        == ("tree", "static tree")
    policy = LearnedPolicy(linear_module({"q_token": 8.0}, -2.0), out)
    assert set(policy.static_shapes) == {True}  # greedy decodes the shape, sampled the tree
    assert "decoded 1.040x the learned tree's speed on 3 val prompts" in policy.tree_summary(
        0.0, 1.0)


def test_where_no_replay_is_close_nothing_is_loaded():
    def decoding():
        raise AssertionError("the settle loaded the models with nothing to settle")

    meta = stop_meta()
    far = {"greedy": {**STATIC, "speedup": 2.0}, "sampling": None}
    assert settle.settle(None, meta, far, 0.05, decoding) is meta


@pytest.mark.parametrize("greedy", [True, False])
def test_the_settle_times_both_exact_decodings(tiny_model_dir, greedy):
    """On a tiny model: both kinds decode every prompt (greedy to the same text), and the ratio
    is the two throughputs' over the prompts."""
    runtime = load_runtime(str(tiny_model_dir), str(tiny_model_dir), "float32", "cpu")
    prompts = [runtime.encode(t, chat=False, special_tokens=False)
               for t in ("def add(a, b):", "The capital of France is", "1, 2, 3,")]
    config = DecodeConfig(method="tree", max_new_tokens=8, max_depth=3,
                          mcsd_branching=(2, 1, 1))
    run = settle.Decoding(runtime, prompts, config)
    module = linear_module({"q_token": 8.0}, -2.0)
    meta = stop_meta()
    static = {**STATIC, "depth": 2}
    key = "static_tree" if greedy else "sampling_static_tree"
    seen = []
    original = settle.bench_methods

    def spy(runtime, prompts, methods, seed, progress=None):
        results = original(runtime, prompts, methods, seed, progress)
        seen.append(results)
        return results

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settle, "bench_methods", spy)
        ratio = settle.measured(run, module, {**meta, key: None}, {**meta, key: static}, greedy)
    tree, shape = seen[0]
    assert (tree.method, shape.method) == ("tree", "static")
    assert len(tree.per_prompt) == len(shape.per_prompt) == 3
    assert all(s.drafted_levels > 0 for s in tree.per_prompt + shape.per_prompt)
    if greedy:
        assert shape.outputs == tree.outputs
    speed = [sum(s.new_tokens for s in r.per_prompt) / sum(s.seconds for s in r.per_prompt)
             for r in (shape, tree)]
    assert ratio.ratio == pytest.approx(speed[0] / speed[1])
