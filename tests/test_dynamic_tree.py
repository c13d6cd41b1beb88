"""The `tree` method (a dynamic tree, `decoder/dynamic.py`) on tiny random Llamas (fp32): greedy
identity with `ar` for every kind of rule and both drafter kinds, pruning, caches, EOS, budget,
padding, the stats and the feature hook."""

from __future__ import annotations

import pytest
import torch

from specstop.decoder.costs import CostCurve
from specstop.decoder.drafter import FeatureDrafter, ModelDrafter
from specstop.decoder.kv import KVModel
from specstop.decoder.loop import DecodeConfig, DecodeStats, RoundRecord, generate
from specstop.decoder.policy import DEPTH, ConfidenceThreshold, ConfidenceTree
from specstop.decoder.tree_rule import TreeRule
from specstop.drafts.families import build_feature_head

from test_draft import RecordingFeatureDrafter, assert_roots_match_a_fresh_pass
from test_loop_tiny import assert_cache_holds

from conftest import perturbed_copy, tiny_llama

VOCAB = 97
# A pass costs 1e-4 target steps more per node: the tiny random drafts are near-uniform, so
# survival falls from ~1e-2 at level 1 to ~1e-4 at level 2 and ~1e-6 at level 3.
COST = tuple(CostCurve({1: 1.0, 2: 1.0 + 1e-4}).prices(64))  # the tree's every size
RULES = {
    "verify-all": TreeRule((3, 2, 2, 1), expand=0.0, rho=0.0, max_width=3, verify_cost=COST),
    "verify-none": TreeRule((2, 2, 1), expand=0.0, rho=1e6, max_width=2, verify_cost=COST),
    "root-only": TreeRule((3, 2), expand=1.0, rho=0.0, max_width=2, verify_cost=COST),
    "width-1": TreeRule((2, 2, 2, 2), expand=0.0, rho=0.0, max_width=1, verify_cost=COST),
    "pruned": TreeRule((3, 2, 2, 1), expand=0.0, rho=1.0, max_width=3, verify_cost=COST),
}
TREE = DecodeConfig(method="tree", max_new_tokens=24, max_depth=4)
AR = DecodeConfig(method="ar", max_new_tokens=24)


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0)
    torch.manual_seed(2)
    return target, perturbed_copy(target, 0.6, seed=1), build_feature_head(target, 1, None).eval()


def drafter_for(models, kind: str) -> ModelDrafter | FeatureDrafter:
    _, draft, head = models
    if kind == "feature":
        return FeatureDrafter(KVModel(head))
    return ModelDrafter(KVModel(draft))


def prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
            for _ in range(n)]


def tree_run(models, prompt, rule: str, config=TREE, kind: str = "model", **kw):
    return generate(KVModel(models[0]), drafter_for(models, kind), prompt, config,
                    ConfidenceTree(RULES[rule]), **kw)


def ar_tokens(models, prompt, config=AR, **kw) -> list[int]:
    return generate(KVModel(models[0]), None, prompt, config, **kw).tokens


@pytest.mark.parametrize("kind", ["model", "feature"])
@pytest.mark.parametrize("rule", list(RULES))
def test_greedy_tree_equals_ar(models, rule, kind):
    stats = DecodeStats()
    for prompt in prompts(2):
        generation = tree_run(models, prompt, rule, kind=kind)
        assert generation.tokens == ar_tokens(models, prompt)
        stats.add(generation.stats)
    rounds = stats.target_calls - 2  # the prefills
    assert 0 < stats.decision_seconds < stats.seconds
    assert stats.verified_tokens <= stats.drafted_tokens
    if rule == "verify-all":
        assert stats.verified_tokens == stats.drafted_tokens
    if rule == "verify-none":  # every round a one-token pass: target-only decoding
        assert stats.verified_tokens == stats.accepted == 0
        assert stats.target_calls == stats.new_tokens
    if rule == "root-only":  # the root alone is fed, its candidates are verified
        assert stats.draft_steps == rounds
        assert stats.drafted_tokens == stats.verified_tokens == 3 * rounds
    if rule == "width-1":  # one node fed per level
        assert stats.drafted_tokens == 2 * stats.draft_steps


def test_the_verify_set_is_pruned_and_caches_hold_exactly_the_committed_tokens(models):
    """After decoding, each cache equals a fresh prefill of the committed prefix."""
    target, draft, _ = models
    prompt = prompts(1, seed=3)[0]
    target_lm, draft_lm = KVModel(target), KVModel(draft)
    config = DecodeConfig(method="tree", max_new_tokens=37, max_depth=4)
    generation = generate(target_lm, ModelDrafter(draft_lm), prompt, config,
                          ConfidenceTree(RULES["pruned"]))
    stats = generation.stats
    assert 0 < stats.verified_tokens < stats.drafted_tokens and stats.accepted > 0
    committed = torch.cat([prompt, torch.tensor(generation.tokens)])
    for lm, model in [(target_lm, target), (draft_lm, draft)]:
        assert lm.length >= prompt.shape[0] + len(generation.tokens) - 2
        assert_cache_holds(lm, model, committed[: lm.length])


def test_feature_head_cache_matches_a_fresh_pass(models):
    """The head's cached view at every round's root equals a fresh pass over the committed
    sequence with the target's own features."""
    target, _, head = models
    drafter = RecordingFeatureDrafter(KVModel(head))
    prompt = prompts(1, seed=4)[0]
    out = generate(KVModel(target), drafter, prompt, TREE, ConfidenceTree(RULES["pruned"]))
    assert_roots_match_a_fresh_pass(target, head, drafter, prompt, out.tokens)


def test_eos_stops_and_budget_is_exact(models):
    prompt = prompts(1, seed=5)[0]
    free = ar_tokens(models, prompt, DecodeConfig(method="ar", max_new_tokens=40))
    eos = free[17]
    cut = free[: free.index(eos) + 1]
    for rule in ("verify-all", "pruned"):
        for budget in (1, 7, 40):
            config = DecodeConfig(method="tree", max_new_tokens=budget, max_depth=4)
            assert tree_run(models, prompt, rule, config, eos_id=eos).tokens == cut[:budget]


def test_padding_to_a_cheaper_width_keeps_the_output(models):
    costs = CostCurve({1: 1.0, 2: 0.9, 4: 1.5, 8: 0.5, 16: 2.0})
    prompt = prompts(1, seed=7)[0]
    for rule in ("verify-all", "pruned"):
        assert tree_run(models, prompt, rule, costs=costs).tokens == ar_tokens(models, prompt)


def test_hook_sees_the_verified_nodes_with_consistent_labels(models):
    records: list[RoundRecord] = []
    generation = tree_run(models, prompts(1, seed=2)[0], "pruned", hook=records.append)
    stats = generation.stats
    assert 0 < len(records) <= len(stats.accepted_per_round)
    assert sum(r.tokens.shape[0] for r in records) == stats.verified_tokens
    assert sum(int((r.labels == 1).sum()) for r in records) == stats.accepted
    for record in records:
        n = record.tokens.shape[0]
        assert record.features.shape[0] == n and record.node.tolist() == list(range(1, n + 1))
        assert torch.equal(record.features[:, DEPTH].long(), record.depth)
        assert torch.all((record.p_target > 0) & (record.q_draft > 0))
        accepted = set(record.node[record.labels == 1].tolist()) | {0}
        tested = torch.tensor([int(p) in accepted for p in record.parent])
        assert torch.equal(record.labels >= 0, tested)  # tested iff the parent was accepted
        for depth in range(1, int(record.depth.max()) + 1):
            assert int((record.labels[record.depth == depth] == 1).sum()) <= 1


def test_tree_needs_a_drafter_and_a_tree_policy(models):
    prompt = prompts(1)[0]
    policy = ConfidenceTree(RULES["pruned"])
    with pytest.raises(ValueError, match="needs a drafter and a tree policy"):
        generate(KVModel(models[0]), None, prompt, TREE, policy)
    for wrong in (None, ConfidenceThreshold(0.3)):
        with pytest.raises(ValueError, match="needs a drafter and a tree policy"):
            generate(KVModel(models[0]), drafter_for(models, "model"), prompt, TREE, wrong)


def test_static_methods_count_verified_tokens_and_decisions(models):
    config = DecodeConfig(method="mcsd", max_new_tokens=10, max_depth=3)
    prompt = prompts(1)[0]
    fixed = generate(KVModel(models[0]), drafter_for(models, "model"), prompt, config).stats
    assert fixed.decision_seconds == 0  # the default FixedDepth decides from the depth alone
    stats = generate(KVModel(models[0]), drafter_for(models, "model"), prompt, config,
                     ConfidenceThreshold(0.0)).stats
    assert stats.verified_tokens == stats.drafted_tokens > 0 and stats.decision_seconds > 0
    total = DecodeStats()
    total.add(stats)
    total.add(stats)
    assert (total.verified_tokens, total.decision_seconds) == \
        (2 * stats.verified_tokens, 2 * stats.decision_seconds)
