"""Stage export's settle (`models.settle`): which modes are decoded and beside what (the close
static shape, the lookup branch, greedy the confidence tree with it), the measured fastest way
written into the winner's file, and nothing loaded where nothing is contested; the decodes
themselves on a tiny model, and a file naming the confidence tree decoding it."""

from __future__ import annotations

import pytest
import torch

from specstop.decoder.loop import DecodeConfig
from specstop.decoder.policy import ConfidenceTree, exported_lookup_branch
from specstop.decoder.sampling import Sampling
from specstop.drafts.loading import load_runtime
from specstop.decoder.stop_model import (CONFIDENCE_WAY, LOOKUP_WAY, STATIC_WAY, TREE_WAY,
                                         LearnedPolicy)
from specstop.decoder.tree_rule import TreeRule
from specstop.evaluation.intervals import Ratio
from specstop.models import settle
from specstop.models.settle import Contest

from stop_models import TREE_RULE, linear_module, metadata

STATIC = {"widths": [2, 1, 1], "depth": 1, "speedup": 1.52}
LOOKUP_MODEL = {"features": ["position", "ngram", "log_gap", "recent"],
                "weights": [0.1, 1.0, 0.7, 0.9], "bias": -1.0}
CONFIDENCE = {**TREE_RULE, "expand": 0.0, "rho": 0.0, "max_width": 3}  # feeds and verifies all


def stop_meta(**changes) -> dict:
    """A winner whose tree replayed at 1.5x `ar` greedy and sampled, no static shape chosen."""
    return metadata(**{"gated_speedup": 1.5, "sampling_tree_rule": TREE_RULE,
                       "sampling_tree_speedup": 1.5, "sampling_temperature": 0.7,
                       "static_tree": None, "sampling_static_tree": None, "fallback": None,
                       **changes})


def test_only_replays_within_the_margin_are_contested():
    shapes = {"greedy": STATIC, "sampling": {**STATIC, "speedup": 1.6}}
    assert settle.contested(stop_meta(), shapes, 0.05) == {True: Contest(STATIC, False)}
    assert set(settle.contested(stop_meta(), shapes, 0.07)) == {True, False}
    assert settle.contested(stop_meta(), shapes, 0.0) == {}  # the replay decides alone
    assert settle.contested(stop_meta(fallback="ar"), shapes, 0.05) == {}  # no tree drafts
    no_rule = stop_meta(sampling_tree_rule=None)
    assert set(settle.contested(no_rule, {**shapes, "greedy": None}, 1.0)) == set()
    behind = stop_meta(gated_speedup=None, tree_speedup=1.45)  # no gate: the tree's own speed
    assert settle.contested(behind, shapes, 0.05) == {True: Contest(STATIC, False)}
    assert settle.contested(behind, shapes, 0.04) == {}


def test_the_lookup_branch_is_contested_where_the_file_has_a_lookup_model():
    shapes = {"greedy": STATIC, "sampling": {**STATIC, "speedup": 1.6}}
    chain = stop_meta(lookup_model=LOOKUP_MODEL)
    assert settle.contested(chain, shapes, 0.05, lookup=True) == {
        True: Contest(STATIC, True), False: Contest(None, True)}
    assert settle.contested(chain, shapes, 0.05, lookup=False) == {True: Contest(STATIC, False)}
    assert settle.contested(stop_meta(), shapes, 0.0, lookup=True) == {}  # no lookup model
    # behind `fallback: ar` the chain is `lookup` with a learned cut, against `ar`
    assert settle.contested(stop_meta(lookup_model=LOOKUP_MODEL, fallback="ar",
                                      sampling_tree_rule=None), shapes, 0.05, lookup=True) \
        == {True: Contest(None, True)}


def test_greedy_the_confidence_tree_joins_the_lookup_branch_where_the_tree_drafts():
    shapes = {"greedy": STATIC, "sampling": {**STATIC, "speedup": 1.6}}
    chain = stop_meta(lookup_model=LOOKUP_MODEL)
    assert settle.contested(chain, shapes, 0.05, True, CONFIDENCE) == {
        True: Contest(STATIC, True, CONFIDENCE), False: Contest(None, True)}
    assert settle.contested(chain, shapes, 0.05, False, CONFIDENCE) == {
        True: Contest(STATIC, False)}  # no branch: no confidence tree (its replay had one)
    assert settle.contested(stop_meta(lookup_model=LOOKUP_MODEL, fallback="ar",
                                      sampling_tree_rule=None), shapes, 0.05, True,
                            CONFIDENCE) == {True: Contest(None, True)}  # no tree drafts


def fake_measured(speeds: dict[bool, dict[str, float]], seen: list):
    """`settle.measured` returning each way's given speed over the first way's."""
    def measured(run, module, ways, greedy):
        seen.append((greedy, list(ways), {way: lookup for way, (_, lookup) in ways.items()}))
        first = speeds[greedy][next(iter(ways))]
        return {way: Ratio(speeds[greedy][way] / first, (0.9, 1.1)) for way in ways}
    return measured


def decoding(calls: list):
    def load():
        calls.append(1)
        return settle.Decoding(None, [torch.tensor([1, 2])] * 3, DecodeConfig(method="tree"), 10)
    return load


def test_the_measured_fastest_way_is_what_the_file_decodes(monkeypatch):
    """Greedy the replay chose the tree, the static shape decodes faster and the tree with the
    lookup branch fastest; sampled the replay chose the static shape and the tree decodes
    fastest: the file says so, each mode measured against the replay's choice."""
    meta = stop_meta(sampling_static_tree={**STATIC, "speedup": 1.51}, lookup_model=LOOKUP_MODEL)
    shapes = {"greedy": STATIC, "sampling": {**STATIC, "speedup": 1.51}}
    speeds = {True: {TREE_WAY: 1.0, STATIC_WAY: 1.04, LOOKUP_WAY: 1.08},
              False: {TREE_WAY: 1.03, STATIC_WAY: 1.0, LOOKUP_WAY: 1.01}}
    calls, seen = [], []
    monkeypatch.setattr(settle, "measured", fake_measured(speeds, seen))
    out = settle.settle(None, meta, shapes, 0.05, True, decoding(calls))
    assert calls == [1]  # the models load once, for both modes
    assert seen == [(True, [TREE_WAY, STATIC_WAY, LOOKUP_WAY],
                     {TREE_WAY: False, STATIC_WAY: False, LOOKUP_WAY: True}),
                    (False, [STATIC_WAY, TREE_WAY, LOOKUP_WAY],
                     {STATIC_WAY: False, TREE_WAY: False, LOOKUP_WAY: True})]
    assert out["static_tree"] == STATIC and out["sampling_static_tree"] is None
    assert out["lookup_branch"] is True and out["sampling_lookup_branch"] is False
    greedy = out["settled"]["greedy"]
    assert greedy["decodes"] == LOOKUP_WAY and greedy["replay_decodes"] == TREE_WAY
    assert greedy["vs_replay"][STATIC_WAY]["ratio"] == pytest.approx(1.04)
    assert greedy["vs_replay"][LOOKUP_WAY]["ratio"] == pytest.approx(1.08)
    assert (out["settled"]["sampling"]["decodes"], out["settled"]["sampling"]["replay_decodes"]) \
        == (TREE_WAY, STATIC_WAY)
    policy = LearnedPolicy(linear_module({"q_token": 8.0}, -2.0), out)
    assert set(policy.static_shapes) == {True}  # greedy without the chain: the shape
    assert exported_lookup_branch(policy, True) and not exported_lookup_branch(policy, False)
    assert "1.080x the speed of the replay's choice on 3 val prompts" in policy.tree_summary(
        0.0, 1.0, lookup_branch=True)
    assert "decoded 1.040x the learned tree's speed on 3 val prompts" in policy.tree_summary(
        0.0, 1.0)


@pytest.mark.parametrize("fastest", [CONFIDENCE_WAY, LOOKUP_WAY])
def test_where_the_confidence_tree_decodes_fastest_the_file_names_its_rule(monkeypatch, fastest):
    """Greedy, the confidence tree with the lookup branch is decoded beside the others: the
    file names its rule (and the branch) only where it was the fastest, and says so."""
    meta = stop_meta(sampling_tree_rule=None, lookup_model=LOOKUP_MODEL)
    speeds = {TREE_WAY: 1.0, STATIC_WAY: 1.02, LOOKUP_WAY: 1.05,
              CONFIDENCE_WAY: 1.07 if fastest == CONFIDENCE_WAY else 1.03}
    seen = []
    monkeypatch.setattr(settle, "measured", fake_measured({True: speeds}, seen))
    out = settle.settle(None, meta, {"greedy": STATIC}, 0.05, True, decoding([]), CONFIDENCE)
    assert seen == [(True, [TREE_WAY, STATIC_WAY, LOOKUP_WAY, CONFIDENCE_WAY],
                     {TREE_WAY: False, STATIC_WAY: False, LOOKUP_WAY: True,
                      CONFIDENCE_WAY: True})]
    assert out["settled"]["greedy"]["decodes"] == fastest and out["lookup_branch"] is True
    policy = LearnedPolicy(linear_module({"q_token": 8.0}, -2.0), out)
    line = policy.tree_summary(0.0, 1.0, lookup_branch=True)
    if fastest == CONFIDENCE_WAY:
        assert out["confidence_tree"] == CONFIDENCE
        assert policy.confidence_tree == TreeRule.from_dict(CONFIDENCE)
        assert "decodes the draft's confidence tree (expand 0, max width 3" in line
        assert "1.070x the speed of the replay's choice on 3 val prompts" in line
    else:
        assert out["confidence_tree"] is None and policy.confidence_tree is None
        assert "1.050x the speed of the replay's choice on 3 val prompts" in line
    # without the branch the file's own tree decodes: the confidence tree was measured with it
    assert policy.tree_summary(0.0, 1.0).startswith("stop model: logistic decodes the static")


def test_a_static_shape_the_replay_chose_by_far_stays_beside_the_lookup_branch(monkeypatch):
    """Not close to the tree, the replay's static shape is only measured against the lookup
    branch: it stays where the branch is slower, and the tree is never decoded."""
    far = {**STATIC, "speedup": 1.7}
    meta = stop_meta(static_tree=far, sampling_tree_rule=None, lookup_model=LOOKUP_MODEL)
    seen = []
    monkeypatch.setattr(settle, "measured", fake_measured(
        {True: {STATIC_WAY: 1.0, LOOKUP_WAY: 0.98}}, seen))
    out = settle.settle(None, meta, {"greedy": far}, 0.05, True, decoding([]))
    assert [ways for _, ways, _ in seen] == [[STATIC_WAY, LOOKUP_WAY]]
    assert out["static_tree"] == far and out["lookup_branch"] is False
    assert out["settled"]["greedy"]["decodes"] == STATIC_WAY
    summary = LearnedPolicy(linear_module({"q_token": 8.0}, -2.0), out).tree_summary(0.0, 1.0)
    assert "it beat the learned tree in the replay" in summary


def test_where_nothing_is_contested_nothing_is_loaded():
    def load():
        raise AssertionError("the settle loaded the models with nothing to settle")

    meta = stop_meta(lookup_model=LOOKUP_MODEL)
    far = {"greedy": {**STATIC, "speedup": 2.0}, "sampling": None}
    assert settle.settle(None, meta, far, 0.05, False, load) is meta
    assert settle.settle(None, stop_meta(), far, 0.05, True, load) is not None  # no lookup model


@pytest.mark.parametrize("greedy", [True, False])
def test_the_settle_times_every_exact_decoding(tiny_model_dir, greedy):
    """On a tiny model: every way decodes every prompt (greedy to the same text), and each
    ratio is its throughput over the first way's over the prompts."""
    runtime = load_runtime(str(tiny_model_dir), str(tiny_model_dir), "float32", "cpu")
    prompts = [runtime.encode(t, chat=False, special_tokens=False)
               for t in ("def add(a, b): return a + b\ndef add(a, b):",
                         "The capital of France is", "1, 2, 3, 1, 2, 3, 1, 2,")]
    config = DecodeConfig(method="tree", max_new_tokens=8, max_depth=3,
                          mcsd_branching=(2, 1, 1))
    run = settle.Decoding(runtime, prompts, config, 5)
    module = linear_module({"q_token": 8.0}, -2.0)
    meta = stop_meta(lookup_model=LOOKUP_MODEL)
    static = {**STATIC, "depth": 2}
    key = "static_tree" if greedy else "sampling_static_tree"
    seen = []
    original = settle.bench_methods

    def spy(runtime, prompts, methods, seed, progress=None, scored=True):
        assert not scored  # the settle times, it does not score
        results = original(runtime, prompts, methods, seed, progress, scored=scored)
        seen.append(results)
        return results

    ways = {TREE_WAY: ({**meta, key: None}, False), STATIC_WAY: ({**meta, key: static}, False),
            LOOKUP_WAY: ({**meta, key: None}, True)}
    if greedy:
        ways[CONFIDENCE_WAY] = ({**meta, key: None, "lookup_branch": True,
                                 "confidence_tree": CONFIDENCE}, True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settle, "bench_methods", spy)
        ratios = settle.measured(run, module, ways, greedy)
    tree, shape, chain = seen[0][:3]
    assert [r.method for r in seen[0]] == list(ways) == list(ratios)
    assert all(len(r.per_prompt) == 3 for r in seen[0])
    assert all(s.drafted_levels > 0 for s in tree.per_prompt + shape.per_prompt)
    if greedy:
        assert all(r.outputs == tree.outputs for r in seen[0])
    speed = [sum(s.new_tokens for s in r.per_prompt) / sum(s.seconds for s in r.per_prompt)
             for r in seen[0]]
    assert ratios[TREE_WAY].ratio == 1.0
    assert ratios[STATIC_WAY].ratio == pytest.approx(speed[1] / speed[0])
    assert ratios[LOOKUP_WAY].ratio == pytest.approx(speed[2] / speed[0])
    if greedy:
        assert ratios[CONFIDENCE_WAY].ratio == pytest.approx(speed[3] / speed[0])


@pytest.mark.parametrize("greedy", [True, False])
def test_a_file_naming_the_confidence_tree_decodes_it_greedy_with_the_lookup_branch(
        tiny_model_dir, greedy):
    """On a tiny model: the file's model stops every tree at once (P ~ 0), its confidence
    tree's rule does not; greedy with the branch the file decodes as `ConfidenceTree` with the
    file's lookup model, round for round, and sampled (or without the branch) its own tree."""
    runtime = load_runtime(str(tiny_model_dir), str(tiny_model_dir), "float32", "cpu")
    prompt = runtime.encode("1, 2, 3, 1, 2, 3, 1, 2,", chat=False, special_tokens=False)
    base = DecodeConfig(method="tree", max_new_tokens=12, max_depth=4, mcsd_branching=(2, 1, 1),
                        lookup_branch=True, sampling=Sampling(0.0 if greedy else 1.0))
    meta = stop_meta(lookup_model=LOOKUP_MODEL, lookup_branch=True, confidence_tree=CONFIDENCE,
                     sampling_lookup_branch=True)
    never = linear_module({}, -30.0)
    file = runtime.generate(prompt, base, LearnedPolicy(never, meta), seed=3)
    own = runtime.generate(prompt, base, LearnedPolicy(never, {**meta, "confidence_tree": None}),
                           seed=3)
    confidence = runtime.generate(prompt, base, ConfidenceTree(
        TreeRule.from_dict(CONFIDENCE), lookup_model=LearnedPolicy(never, meta).lookup_model),
        seed=3)
    stats = [(g.tokens, g.stats.target_calls, g.stats.drafted_tokens, g.stats.verified_tokens)
             for g in (file, own, confidence)]
    assert stats[0] == (stats[2] if greedy else stats[1])
    assert stats[1][2] != stats[2][2]  # the two trees draft differently: the test can tell
