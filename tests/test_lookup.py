"""The prompt-lookup proposer (`decoder/lookup.py`): what it looks up, kept incrementally, and
`lookup` rounds equal to `ar` greedy on tiny random Llamas (the sampled χ² and its negative
control: test_losslessness_mc.py; the embedded model: test_integration.py)."""

from __future__ import annotations

import random

import pytest
import torch

from specstop.decoder.kv import KVModel
from specstop.decoder.lookup import Lookup
from specstop.decoder.loop import DecodeConfig, generate
from specstop.decoder.policy import FixedDepth

from conftest import tiny_llama

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
