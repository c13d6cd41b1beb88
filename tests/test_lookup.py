"""The prompt-lookup proposer (`decoder/lookup.py`): what it looks up, kept incrementally,
`lookup` rounds and greedy `tree` rounds with a lookup branch equal to `ar` on tiny random
Llamas (the sampled χ² and its negative control: test_losslessness_mc.py; the embedded model:
test_integration.py)."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from specstop.decoder.contracts import Proposal
from specstop.decoder.drafter import ModelDrafter
from specstop.decoder.kv import KVModel
from specstop.decoder.dynamic import propose_tree
from specstop.decoder.lookup import (LOOKUP_FEATURES, RECENT_WEIGHT, Lookup, LookupBranch,
                                     LookupModel, retrace, with_chain, with_lookup_branch)
from specstop.decoder.loop import DecodeConfig, DecodeStats, generate
from specstop.decoder.policy import ConfidenceTree, FixedDepth
from specstop.decoder.sampling import Sampling
from specstop.decoder.tree import Tree
from specstop.decoder.tree_rule import TreeRule
from specstop.features import RoundContext

from conftest import perturbed_copy, tiny_llama
from test_loop_tiny import assert_cache_holds

VOCAB = 97


def rescanned(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The reference: scan the whole text backwards for each suffix n-gram, longest first."""
    for n in range(min(max_ngram, len(tokens)), min_ngram - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


def test_the_most_recent_occurrence_of_the_longest_ngram_is_followed() -> None:
    text = [1, 2, 3, 1, 2, 4, 7, 2, 1, 2]
    assert Lookup(text).chain(3) == [4, 7, 2]  # (1, 2): the later of two, before (2,)'s [1, 2]
    assert Lookup(text, max_ngram=1).chain(3) == [1, 2]  # (2,) last at index 7
    assert Lookup(text).chain(1) == [4]


def test_shorter_ngrams_only_down_to_min_ngram() -> None:
    text = [5, 6, 9, 6]
    assert Lookup(text).chain(4) == [9, 6]  # (9, 6) never before; (6,) at index 1
    assert Lookup(text, min_ngram=2).chain(4) == []
    assert Lookup([5, 6, 7]).chain(4) == []  # nothing repeats
    assert Lookup([3, 3, 3]).chain(4) == [3]  # the overlapping occurrence ends at the text's end


def test_incremental_index_equals_a_full_rescan() -> None:
    rng = random.Random(0)
    for trial in range(200):
        max_ngram = rng.randint(1, 4)
        min_ngram = rng.randint(1, max_ngram)
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 5))]
        lookup = Lookup(tokens, max_ngram, min_ngram)
        for _ in range(10):
            more = [rng.randrange(4) for _ in range(rng.randint(1, 4))]
            lookup.extend(more)
            tokens += more
            k = rng.randint(1, 6)
            assert lookup.chain(k) == rescanned(tokens, k, max_ngram, min_ngram), (trial, tokens)


def test_match_features_equal_a_rescan_of_the_text() -> None:
    """What a match knows (the n-gram length, the gap to its end, the EMA of the next-token
    guesses that were right) equals a rescan of the whole text, token by token."""
    rng = random.Random(1)
    for trial in range(100):
        max_ngram = rng.randint(1, 3)
        tokens = [rng.randrange(3) for _ in range(rng.randint(0, 30))]
        lookup, recent = Lookup(tokens, max_ngram), 0.0
        for i, token in enumerate(tokens):
            guess = rescanned(tokens[:i], 1, max_ngram, 1)
            recent += RECENT_WEIGHT * (float(guess == [token]) - recent)
        match = lookup.match(4)
        assert match.recent == pytest.approx(recent, abs=1e-12), trial
        assert match.tokens == rescanned(tokens, 4, max_ngram, 1)
        if match.tokens:
            n, gap = match.ngram, match.gap
            assert tokens[-n:] == tokens[-n - gap : -gap] and match.tokens[0] == tokens[-gap]
            assert rescanned(tokens, 4, n, n) == match.tokens  # the longest that matched
        features = match.features()
        assert features.shape == (len(match.tokens), len(LOOKUP_FEATURES))
        assert features[:, 0].tolist() == list(range(1, len(match.tokens) + 1))


def test_a_lookup_model_is_refused_on_other_features() -> None:
    model = LookupModel((0.1, 0.2, 0.3, 0.4), -1.0)
    assert LookupModel.from_dict(model.as_dict()) == model
    with pytest.raises(ValueError, match="features"):
        LookupModel.from_dict({**model.as_dict(), "features": ["position", "ngram"]})
    with pytest.raises(ValueError, match="finite"):
        LookupModel((0.1, 0.2, float("nan"), 0.4), 0.0)


def test_ngram_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="min_ngram"):
        Lookup([1], max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="lookup_ngram"):
        DecodeConfig(method="lookup", lookup_ngram=0)


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(0)


def repetitive_prompts(n: int) -> list[torch.Tensor]:
    """Random token runs repeated two or three times: text a lookup finds matches in."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (int(torch.randint(2, 8, (1,), generator=g)),),
                          generator=g).repeat(2 + i % 2) for i in range(n)]


@pytest.mark.parametrize("gamma,ngram", [(3, 2), (6, 1), (4, 3)])
def test_lookup_equals_ar_greedy(target: torch.nn.Module, gamma: int, ngram: int) -> None:
    ar = DecodeConfig(method="ar", max_new_tokens=40)
    config = DecodeConfig(method="lookup", max_new_tokens=40, max_depth=6, lookup_ngram=ngram)
    accepted = drafted = 0
    for prompt in repetitive_prompts(6):
        reference = generate(KVModel(target), None, prompt, ar).tokens
        out = generate(KVModel(target), None, prompt, config, FixedDepth(gamma))
        assert out.tokens == reference, prompt.tolist()
        accepted, drafted = accepted + out.stats.accepted, drafted + out.stats.drafted_tokens
        assert out.stats.draft_steps <= gamma * (out.stats.target_calls - 1)
    assert 0 < accepted < drafted  # rounds accept some proposals and reject others


def test_lookup_stops_at_eos_and_within_the_budget(target: torch.nn.Module) -> None:
    for prompt in repetitive_prompts(4):
        for eos_id, budget in [(None, 17), (int(prompt[1]), 30)]:
            ar = DecodeConfig(method="ar", max_new_tokens=budget)
            reference = generate(KVModel(target), None, prompt, ar, eos_id=eos_id).tokens
            config = DecodeConfig(method="lookup", max_new_tokens=budget, max_depth=5)
            out = generate(KVModel(target), None, prompt, config, eos_id=eos_id)
            assert out.tokens == reference and len(out.tokens) <= budget


def branch_of(chain_source: list[int], levels: int = 3) -> tuple[Tree, Proposal]:
    """A drafted tree root 10 -> (11 -> 13, 12 -> 14) with the lookup branch of a text that ends
    with the root and holds `chain_source` after an earlier 10."""
    lookup = Lookup([10, *chain_source, 5, 10])
    return with_lookup_branch(*drafted_tree(), lookup.chain(levels))


def drafted_tree() -> tuple[Tree, Proposal]:
    """Root 10 -> (11 -> 13, 12 -> 14), the root and level 1 fed."""
    tree = Tree.from_parents([-1, 0, 0, 1, 2])
    q = torch.softmax(torch.randn(3, 30, generator=torch.Generator().manual_seed(0)), dim=1)
    return tree, Proposal(tokens=torch.tensor([10, 11, 12, 13, 14]), depth=2, root_position=7,
                          q=q, features=(), fed=torch.tensor([0, 1, 2, -1, -1]), steps=2,
                          drafted=4)


def test_the_lookup_branch_goes_last_in_each_level() -> None:
    tree, proposal = branch_of([20, 21, 22, 23])
    assert tree.parent.tolist() == [-1, 0, 0, 0, 1, 2, 3, 6]
    assert proposal.tokens.tolist() == [10, 11, 12, 20, 13, 14, 21, 22]
    assert proposal.fed.tolist() == [0, 1, 2, -1, -1, -1, -1, -1]
    assert proposal.depth == 3 and proposal.q.shape == (7, 30)
    assert proposal.q[3].argmax() == 21 and proposal.q[6].argmax() == 22  # one-hot
    assert proposal.q[4:6].sum() == 0 and proposal.q[6].sum() == 1  # leaves of the draft
    assert proposal.point.tolist() == [False] * 3 + [True] + [False] * 2 + [True] * 2


def test_a_lookup_branch_below_a_drafted_node_goes_after_its_drafted_children() -> None:
    tree, proposal = with_lookup_branch(*drafted_tree(), [21, 22], below=1)  # below 11
    assert tree.parent.tolist() == [-1, 0, 0, 1, 1, 2, 4]
    assert proposal.tokens.tolist() == [10, 11, 12, 13, 21, 14, 22]
    assert proposal.point.tolist() == [False] * 4 + [True, False, True]
    assert proposal.fed.tolist() == [0, 1, 2, -1, -1, -1, -1]


def test_a_static_trees_chain_follows_the_nodes_it_retraces_and_keeps_their_features() -> None:
    """`with_chain`: [11, 21, 22] retraces 11, then goes below it after its drafted child; the
    drafted nodes keep their order and features; a chain the tree holds whole adds nothing."""
    tree, proposal = drafted_tree()
    proposal = replace(proposal, features=(torch.zeros(2, 3), torch.ones(2, 3)))
    merged, with_branch = with_chain(tree, proposal, [11, 21, 22])
    assert merged.parent.tolist() == [-1, 0, 0, 1, 1, 2, 4]
    assert with_branch.tokens.tolist() == [10, 11, 12, 13, 21, 14, 22]
    assert with_branch.point.tolist() == [False] * 4 + [True, False, True]
    assert with_branch.features == proposal.features
    assert retrace(merged.parent.tolist(), with_branch.tokens.tolist(), [11, 21, 22]) == [1, 4, 6]
    same_tree, same = with_chain(tree, proposal, [12, 14])
    assert same_tree is tree and same is proposal


def test_a_lookup_branch_joins_a_drafted_tree_only() -> None:
    DecodeConfig(method="tree", lookup_branch=True, sampling=Sampling(1.0))  # greedy or not
    DecodeConfig(method="mcsd", lookup_branch=True, lookup_tokens=10)  # collect's sampled rounds
    for method, lossy in (("lookup", False), ("ar", False), ("ti-mcsd", True)):
        with pytest.raises(ValueError, match="joins a drafted tree"):
            DecodeConfig(method=method, lookup_branch=True, lossy=lossy)


class FixedDraft:
    """A draft whose every step proposes 11 (most likely), then 12, whatever it is fed."""

    vocab_ids = None

    def step(self, tree: Tree, level: int, ids: torch.Tensor, root_position: int
             ) -> torch.Tensor:
        logits = torch.full((30,), -20.0)
        logits[11], logits[12] = 3.0, 2.0
        return logits.expand(ids.shape[0], -1)


def proposed_with(branch: LookupBranch, levels: int = 1, step: float = 0.1
                  ) -> tuple[list[int], list[int]]:
    """The tokens a greedy tree round verifies below root 10 with `branch` beside the draft's
    (two children of every node, `levels` deep; a pass over n tokens costs 1 + step (n - 1)),
    and their parents."""
    rule = TreeRule((2,) * levels, expand=0.0, rho=1.0, max_width=2,
                    verify_cost=(0.0, *(1.0 + step * i for i in range(20))))
    context = RoundContext(1, 0, 0.0, 0.0, torch.zeros(2))
    tree, proposal, _ = propose_tree(FixedDraft(), ConfidenceTree(rule), torch.tensor([10]),
                                     torch.full((30,), 1 / 30), 5, 3, context, Sampling(), True,
                                     None, branch)
    return proposal.tokens.tolist(), tree.parent.tolist()


def test_verify_set_keeps_the_prefix_of_the_chain_that_pays() -> None:
    """The chain's survivals compete with the drafted nodes' in `verify_set` (a node pays when
    its survival exceeds rho times the cost it adds, 0.1): all, a prefix or none of it is kept.
    The draft's survivals: 11 0.73, 12 0.27 at every node, their products below."""
    assert proposed_with(LookupBranch([20, 21, 22], np.array([0.9, 0.8, 0.5]))) == \
        ([10, 11, 12, 20, 21, 22], [-1, 0, 0, 0, 3, 4])
    assert proposed_with(LookupBranch([20, 21, 22], np.array([0.9, 0.05, 0.01])))[0] == \
        [10, 11, 12, 20]
    assert proposed_with(LookupBranch([20, 21], np.array([0.02, 0.01])))[0] == [10, 11, 12]


def test_a_chain_that_retraces_drafted_nodes_goes_on_below_them() -> None:
    """Where the chain's first tokens are drafted nodes it follows them (kept with the larger
    of the two survivals) and the rest goes below the last, after its drafted siblings."""
    assert proposed_with(LookupBranch([12, 21], np.ones(2))) == ([10, 11, 12, 21], [-1, 0, 0, 2])
    # each node costs 0.5: 12 (0.27) alone does not pay, with the chain's 0.9 it does
    assert proposed_with(LookupBranch([20], np.array([0.01])), step=0.5)[0] == [10, 11]
    assert proposed_with(LookupBranch([12, 21], np.array([0.9, 0.8])), step=0.5) == \
        ([10, 11, 12, 21], [-1, 0, 0, 2])
    # two levels: 11 > 12 (0.20, raised to 1) > 30; 12 > 12 (0.07) does not pay
    assert proposed_with(LookupBranch([11, 12, 30], np.ones(3)), levels=2) == \
        ([10, 11, 12, 11, 12, 11, 30], [-1, 0, 0, 1, 1, 2, 4])


# Verify every drafted node below a root with up to two children (a pass of n tokens costs
# 1 + 1e-4 (n - 1) target steps).
RULE = TreeRule((2, 1, 1), expand=0.0, rho=0.0, max_width=2,
                verify_cost=(0.0, *(1.0 + 1e-4 * i for i in range(32))))
# a lookup model on (position, ngram, log_gap, recent) between the two: the first tokens of a
# recent, repeating text likely, the later ones less
MODERATE = LookupModel((-0.8, 0.5, -0.2, 2.0), 0.5)


def greedy_runs(target: torch.nn.Module, lookup_model: LookupModel | None, branch: bool,
                rho: float = 0.0) -> tuple[list[list[int]], DecodeStats]:
    """Greedy tree decodes of the repetitive prompts (their tokens, summed stats)."""
    draft = perturbed_copy(target, 0.6, seed=1)
    config = DecodeConfig(method="tree", max_new_tokens=40, max_depth=6, lookup_branch=branch)
    rule = TreeRule(RULE.branching, RULE.expand, rho, RULE.max_width, RULE.verify_cost)
    stats, outputs = DecodeStats(), []
    for prompt in repetitive_prompts(6):
        out = generate(KVModel(target), ModelDrafter(KVModel(draft)), prompt, config,
                       ConfidenceTree(rule, lookup_model=lookup_model))
        outputs.append(out.tokens)
        stats.add(out.stats)
    return outputs, stats


@pytest.mark.parametrize("lookup_model", [None, MODERATE], ids=["certain", "learned"])
def test_greedy_tree_with_a_lookup_branch_equals_ar(target: torch.nn.Module,
                                                    lookup_model: LookupModel | None) -> None:
    references = [generate(KVModel(target), None, prompt,
                           DecodeConfig(method="ar", max_new_tokens=40)).tokens
                  for prompt in repetitive_prompts(6)]
    without, stats_without = greedy_runs(target, None, branch=False, rho=0.5)
    with_branch, stats = greedy_runs(target, lookup_model, branch=True, rho=0.5)
    assert without == references and with_branch == references
    assert stats.accepted > stats_without.accepted  # the branch is taken
    assert stats.target_calls < stats_without.target_calls


def test_caches_hold_the_committed_tokens_after_lookup_branches(target: torch.nn.Module) -> None:
    """After greedy tree rounds whose accepted paths run from drafted nodes into the chain,
    both caches hold exactly the committed tokens (the draft catches up on the chain's)."""
    draft = perturbed_copy(target, 0.6, seed=1)
    config = DecodeConfig(method="tree", max_new_tokens=40, max_depth=6, lookup_branch=True)
    rule = TreeRule(RULE.branching, RULE.expand, 0.5, RULE.max_width, RULE.verify_cost)
    for prompt in repetitive_prompts(3):
        target_lm, draft_lm = KVModel(target), KVModel(draft)
        out = generate(target_lm, ModelDrafter(draft_lm), prompt, config, ConfidenceTree(rule))
        committed = torch.cat([prompt, torch.tensor(out.tokens)])
        assert target_lm.length >= committed.shape[0] - 1  # the last root is not in yet
        for lm, model in [(target_lm, target), (draft_lm, draft)]:  # the draft may lag
            assert_cache_holds(lm, model, committed[: lm.length])


def test_a_chain_the_model_gives_no_chance_is_never_verified(target: torch.nn.Module) -> None:
    """A lookup model that gives every chain token ~0 survival decodes as no branch does, one
    that gives ~1 as a certain chain: the survival is what decides."""
    never, always = LookupModel((0.0,) * 4, -40.0), LookupModel((0.0,) * 4, 40.0)
    for model, reference in ((never, False), (always, None)):
        tokens, stats = greedy_runs(target, model, branch=True, rho=0.5)
        expected_tokens, expected = greedy_runs(target, None, branch=reference is None, rho=0.5)
        assert tokens == expected_tokens
        assert (stats.verified_tokens, stats.accepted, stats.target_calls) == \
            (expected.verified_tokens, expected.accepted, expected.target_calls)
