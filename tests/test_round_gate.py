"""The round gate: the replay's accounting of gated rounds, `ar` as the policy to beat, the fit
and the tuning (`models.round_gate`), the gate's arithmetic as the runtime applies it, and the
decode loop behind a gate (greedy identity with `ar`, caches), falling back to `ar`, or
decoding the static shape that beat the tree."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch

import test_dynamic_tree as dt
from specstop.common.errors import SpecstopError
from specstop.decoder.drafter import ModelDrafter
from specstop.decoder.kv import KVModel
from specstop.decoder.loop import DecodeConfig, DecodeStats, generate
from specstop.decoder.lookup import LookupModel
from specstop.decoder.policy import ConfidenceTree, FixedDepth
from specstop.decoder.round_gate import GATE_FEATURES, RoundGate
from specstop.decoder.sampling import Sampling
from specstop.decoder.stop_model import load_stop_model
from specstop.features import RoundContext
from specstop.models import round_gate
from specstop.replay.tree_replay import TreeCosts, TreeReplay

from stop_models import write_stop_model
from test_dynamic_tree import models  # noqa: F401  (the tiny models fixture)
from test_lookup import MODERATE, repetitive_prompts
from test_loop_tiny import assert_cache_holds
from test_tree_replay import BRANCHING, COSTS, reference, superset_rows

ROUNDS = ["prompt_id", "round"]


def with_gate_features(rows: pd.DataFrame, seed: int) -> pd.DataFrame:
    """`root_target_prob` tells whether the round accepts anything (noise aside); the others
    are noise, constant within a round as the logged ones are."""
    rng = np.random.default_rng(seed)
    keys = rows.groupby(ROUNDS, sort=False).ngroup().to_numpy()
    accepts = (rows["label"] == 1).groupby(keys).any().to_numpy()
    per_round = rng.uniform(size=(len(accepts), len(GATE_FEATURES)))
    per_round[:, -1] = accepts + rng.normal(0, 0.02, len(accepts))
    return rows.assign(**{f: per_round[keys, i] for i, f in enumerate(GATE_FEATURES)})


def test_gated_rounds_emit_the_root_alone_at_ars_cost():
    rows = superset_rows(40, seed=5)
    replay = TreeReplay.from_rows(rows, BRANCHING)
    rule, p = COSTS.rule(BRANCHING, 0.2, 0.7, 3), rows["p"].to_numpy()
    gated = np.arange(replay.rounds) % 3 == 0
    result = replay.dynamic(p, rule, COSTS, gated)
    keys = rows[ROUNDS].drop_duplicates().itertuples(index=False)
    off = frozenset(tuple(k) for k, g in zip(keys, gated) if g)
    assert result.speedup == pytest.approx(reference(rows, rule, gated=off).speed(), rel=1e-12)
    everything = replay.dynamic(p, rule, COSTS, np.ones(replay.rounds, dtype=bool))
    assert (everything.speedup, everything.tokens_per_round, everything.verified,
            everything.draft_steps) == (1.0, 1.0, 0.0, 0.0)  # `ar`


def test_a_gate_that_knows_the_empty_rounds_pays_and_is_kept():
    train = with_gate_features(superset_rows(200, seed=6), seed=1)
    val = with_gate_features(superset_rows(120, seed=7), seed=2)
    gate = round_gate.fit(train)
    assert gate is not None and gate.coef[-1] > 0 and gate.threshold == 0.0
    replay = TreeReplay.from_rows(val, BRANCHING)
    rule = COSTS.rule(BRANCHING, 0.2, 0.7, 3)
    X = round_gate.round_features(val)
    choice = round_gate.choose(replay, val["p"].to_numpy(), rule, COSTS, gate, X)
    assert choice.kept and choice.fallback is None and 0 < choice.gated_share < 0.6
    assert choice.result.speedup > choice.ungated.speedup
    off = ~choice.gate.drafting(X)
    assert choice.result.speedup == replay.dynamic(val["p"].to_numpy(), rule, COSTS,
                                                   off).speedup
    accepts = round_gate.round_accepts(val)
    assert accepts[off].mean() < 0.5 < 0.7 < accepts.mean()  # mostly the empty rounds
    assert choice.as_dict()["round_gate"] == choice.gate.as_dict()


def test_where_nothing_pays_the_policy_is_ar():
    """Verification as dear as decoding each token: no tree beats `ar`, the gate closes."""
    val = with_gate_features(superset_rows(60, seed=8), seed=3)
    n = np.arange(64, dtype=float)
    dear = TreeCosts(verify=np.where(n == 0, 0.0, n), step=COSTS.step)
    replay = TreeReplay.from_rows(val, BRANCHING)
    rule = dear.rule(BRANCHING, 0.0, 1.0, 3)
    choice = round_gate.choose(replay, val["p"].to_numpy(), rule, dear, None,
                               round_gate.round_features(val))
    assert choice.ungated.speedup < 1.0
    assert choice.fallback == "ar" and choice.result.speedup == 1.0 and choice.gated_share == 1
    assert choice.as_dict() == {"round_gate": None, "fallback": "ar", "gated_speedup": 1.0,
                                "gated_share": 1.0}


def test_one_class_of_rounds_fits_no_gate():
    rows = with_gate_features(superset_rows(20, seed=9, ease=0.0), seed=4)
    assert round_gate.fit(rows) is None


def test_the_runtime_gate_decides_as_the_replay():
    rng = np.random.default_rng(0)
    X = rng.uniform(size=(50, len(GATE_FEATURES))).astype(np.float32).astype(np.float64)
    gate = RoundGate(tuple(rng.normal(size=len(GATE_FEATURES)).tolist()), 0.3, 0.5)
    gate = RoundGate(gate.coef, 0.3, float(np.median(gate.probability(X))))
    runtime = [gate.drafts(RoundContext(*row[:4].tolist(), torch.tensor(row[4:6])),
                           torch.tensor(row[6:])) for row in X]
    assert runtime == gate.drafting(X).tolist() and 0 < sum(runtime) < len(X)
    assert gate.probability(X)[gate.drafting(X)].min() > gate.threshold
    assert RoundGate.from_dict(gate.as_dict()) == gate
    closed = RoundGate.closed()
    assert closed.never and not closed.drafting(X).any()
    assert not closed.drafts(None, torch.ones(1))
    with pytest.raises(ValueError):
        RoundGate((1.0,), 0.0, 0.5)


# ---- the gate in the decode loop (tiny random Llamas, fp32, greedy) --------------------------


class Pattern:
    """A test gate: drafts on the calls marked True of a repeating pattern."""

    never = False

    def __init__(self, pattern: tuple[bool, ...]) -> None:
        self.pattern, self.calls = pattern, 0

    def drafts(self, context: RoundContext | None, root_prob: torch.Tensor) -> bool:
        self.calls += 1
        return self.pattern[(self.calls - 1) % len(self.pattern)]


class GatedTree(ConfidenceTree):
    def __init__(self, rule, gate, lookup_model: LookupModel | None = None) -> None:
        super().__init__(rule, lookup_model=lookup_model)
        self.round_gate = gate


EARLY = RoundGate((-1.0, 0, 0, 0, 0, 0, 0), 10.0, 0.5)  # drafts while under 10 tokens out


@pytest.mark.parametrize("kind", ["model", "feature"])
@pytest.mark.parametrize("gate", ["pattern", "early"])
def test_greedy_tree_behind_a_gate_equals_ar(models, kind, gate):
    stats = DecodeStats()
    for prompt in dt.prompts(3, seed=5):
        policy = GatedTree(dt.RULES["verify-all"],
                           Pattern((True, True, False, False)) if gate == "pattern" else EARLY)
        generation = generate(KVModel(models[0]), dt.drafter_for(models, kind), prompt, dt.TREE,
                              policy)
        assert generation.tokens == dt.ar_tokens(models, prompt)
        stats.add(generation.stats)
    rounds = stats.target_calls - 3
    assert 0 < stats.gated < rounds and stats.draft_steps > 0
    assert stats.accepted + rounds <= stats.new_tokens  # a gated round: the root alone


@pytest.mark.parametrize("lookup_model", [None, MODERATE], ids=["certain", "learned"])
def test_gated_rounds_with_a_lookup_branch_propose_the_chain_alone(models, lookup_model):
    """Greedy `tree` with a lookup branch behind a gate that never drafts runs no draft step:
    each round verifies the root and the prefix of the chain that pays.  A certain chain on a
    flat cost curve is verified whole, as `lookup` verifies it (the same tokens, target calls
    and verified tokens); behind a gate that drafts every other round, and with a learned
    chain, the output is still `ar`'s."""
    tree = DecodeConfig(method="tree", max_new_tokens=40, max_depth=6, lookup_branch=True)
    lookup = DecodeConfig(method="lookup", max_new_tokens=40, max_depth=6)
    ar = DecodeConfig(method="ar", max_new_tokens=40)
    closed_stats, ar_calls = DecodeStats(), 0
    for prompt in repetitive_prompts(6):
        reference = generate(KVModel(models[0]), None, prompt, ar)
        draft_lm = KVModel(models[1])
        closed = generate(KVModel(models[0]), ModelDrafter(draft_lm), prompt, tree,
                          GatedTree(dt.RULES["verify-all"], RoundGate.closed(), lookup_model))
        assert closed.tokens == reference.tokens and draft_lm.length == 0
        closed_stats.add(closed.stats)
        ar_calls += reference.stats.target_calls
        if lookup_model is None:
            alone = generate(KVModel(models[0]), None, prompt, lookup, FixedDepth(6)).stats
            assert (closed.stats.target_calls, closed.stats.verified_tokens) == \
                (alone.target_calls, alone.verified_tokens)
        mixed = generate(KVModel(models[0]), ModelDrafter(KVModel(models[1])), prompt, tree,
                         GatedTree(dt.RULES["pruned"], Pattern((True, False)), lookup_model))
        assert mixed.tokens == reference.tokens and 0 < mixed.stats.gated
    assert closed_stats.draft_steps == 0 and closed_stats.gated == closed_stats.target_calls - 6
    assert 0 < closed_stats.verified_tokens and closed_stats.target_calls < ar_calls


def test_caches_hold_the_committed_tokens_after_gated_rounds(models):
    target, draft, _ = models
    prompt = dt.prompts(1, seed=3)[0]
    target_lm, draft_lm = KVModel(target), KVModel(draft)
    policy = GatedTree(dt.RULES["pruned"], Pattern((True, False, False, True, True)))
    generation = generate(target_lm, ModelDrafter(draft_lm), prompt,
                          DecodeConfig(method="tree", max_new_tokens=37, max_depth=4), policy)
    assert generation.stats.gated > 0
    committed = torch.cat([prompt, torch.tensor(generation.tokens)])
    for lm, model in [(target_lm, target), (draft_lm, draft)]:
        assert lm.length >= prompt.shape[0] + len(generation.tokens) - 2
        assert_cache_holds(lm, model, committed[: lm.length])


def test_a_stop_model_that_falls_back_decodes_plain_ar(models, tmp_path):
    policy = load_stop_model(write_stop_model(tmp_path / "ar.pt", fallback="ar",
                                              gated_speedup=1.0, tree_speedup=0.91))
    assert policy.round_gate.never
    draft_lm = KVModel(models[1])
    for prompt in dt.prompts(2, seed=4):
        generation = generate(KVModel(models[0]), ModelDrafter(draft_lm), prompt, dt.TREE, policy)
        stats = generation.stats
        assert generation.tokens == dt.ar_tokens(models, prompt)
        assert stats.draft_steps == stats.drafted_tokens == 0 and draft_lm.length == 0
        assert stats.gated == stats.target_calls - 1 and stats.target_calls == stats.new_tokens
        line = policy.tree_summary(stats.decision_seconds, stats.seconds, stats.gated,
                                   stats.target_calls - 1)
        assert line.startswith("stop model: logistic falls back to ar: no drafting policy beat "
                               "ar") and "0.910x ar" in line


def test_a_stop_model_naming_a_static_shape_decodes_it_where_it_beat_the_tree(models, tmp_path):
    """Sampled, the file's `sampling_static_tree` is decoded as `mcsd` decodes that shape (the
    same draws, tokens and rounds); greedy, the learned tree still runs."""
    shape = {"widths": [2, 1, 1], "depth": 2, "speedup": 1.3}
    policy = load_stop_model(write_stop_model(tmp_path / "static.pt", sampling_static_tree=shape,
                                              sampling_tree_speedup=1.2))
    plain = load_stop_model(write_stop_model(tmp_path / "plain.pt"))
    hot = replace(dt.TREE, sampling=Sampling(0.8))
    static = replace(hot, method="mcsd", mcsd_branching=(2, 1, 1), max_depth=2)
    for prompt in dt.prompts(2, seed=6):
        runs = [generate(KVModel(models[0]), ModelDrafter(KVModel(models[1])), prompt, config,
                         rule, generator=torch.Generator().manual_seed(3))
                for config, rule in [(hot, policy), (static, FixedDepth(2)), (dt.TREE, policy),
                                     (dt.TREE, plain)]]
        fallback, mcsd, greedy, learned = (run.stats for run in runs)
        assert runs[0].tokens == runs[1].tokens
        assert (fallback.target_calls, fallback.draft_steps, fallback.drafted_tokens) == \
            (mcsd.target_calls, mcsd.draft_steps, mcsd.drafted_tokens)
        assert runs[2].tokens == runs[3].tokens == dt.ar_tokens(models, prompt)
        assert (greedy.drafted_tokens, greedy.decision_seconds > 0) == \
            (learned.drafted_tokens, True)  # the tree, deciding
    line = policy.tree_summary(0.0, 1.0, greedy=False)
    assert line.startswith("stop model: logistic decodes the static tree [2, 1, 1] to depth 2")
    assert "1.300x ar against 1.200x" in line
    assert policy.tree_summary(0.1, 1.0).startswith("stop model: logistic, tree rule")
    assert "tree rule (expand 0.3, max width 2, rho 0.8), with the lookup branch;" in \
        policy.tree_summary(0.0, 1.0, greedy=False, lookup_branch=True)  # no static shape then
    with pytest.raises(SpecstopError, match="incomplete metadata"):
        load_stop_model(write_stop_model(tmp_path / "bad.pt",
                                         static_tree={"widths": [0], "depth": 2}))


def test_a_stop_model_carries_its_gate(tmp_path):
    policy = load_stop_model(write_stop_model(tmp_path / "gated.pt",
                                              round_gate=EARLY.as_dict()))
    assert policy.round_gate == EARLY
    assert "round gate: 2 of 5 rounds not drafted" in policy.tree_summary(0.0, 1.0, 2, 5)
    assert load_stop_model(write_stop_model(tmp_path / "plain.pt")).round_gate is None
    with pytest.raises(SpecstopError, match="incomplete metadata"):
        load_stop_model(write_stop_model(tmp_path / "bad.pt", fallback="sd"))
