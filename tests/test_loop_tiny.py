"""The decode loop on tiny random Llamas (fp32): greedy identity, caches, EOS, budget, hook."""

from __future__ import annotations

import pytest
import torch

from specstop.decoder.costs import CostCurve
from specstop.decoder.drafter import ModelDrafter
from specstop.decoder.kv import KVModel
from specstop.decoder.loop import DecodeConfig, RoundRecord, generate
from specstop.decoder.policy import ConfidenceThreshold, FixedDepth
from specstop.decoder.sampling import Sampling

from conftest import perturbed_copy, tiny_llama

VOCAB = 97
EXACT = [DecodeConfig(method="sd", max_depth=5),
         DecodeConfig(method="mcsd", max_depth=4, mcsd_branching=(2, 2)),
         DecodeConfig(method="mcsd", max_depth=3, mcsd_branching=(3, 2),
                      without_replacement=False),
         DecodeConfig(method="ti-mcsd", max_depth=4, ti_width=3)]


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0)
    return target, perturbed_copy(target, 0.6, seed=1)


def prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
            for _ in range(n)]


def run(target, draft, prompt, config, policy=None, eos_id=None, **kw):
    drafter = ModelDrafter(KVModel(draft)) if draft is not None else None
    return generate(KVModel(target), drafter, prompt, config, policy, eos_id, **kw)


def with_method(config: DecodeConfig, **changes) -> DecodeConfig:
    return DecodeConfig(**{**config.__dict__, **changes})


def test_ar_equals_transformers_greedy(models):
    target, _ = models
    for prompt in prompts(4):
        ours = run(target, None, prompt, DecodeConfig(method="ar", max_new_tokens=30)).tokens
        theirs = target.generate(prompt[None], max_new_tokens=30, min_new_tokens=30,
                                 do_sample=False)[0, prompt.shape[0]:].tolist()
        assert ours == theirs


@pytest.mark.parametrize("config", EXACT, ids=lambda c: f"{c.method}-{c.mcsd_branching}")
@pytest.mark.parametrize("policy", [FixedDepth(3), ConfidenceThreshold(0.3), None],
                         ids=["fixed3", "conf0.3", "maxdepth"])
def test_lossless_methods_equal_ar_greedy(models, config, policy):
    target, draft = models
    accepted = 0
    for prompt in prompts(6):
        config = with_method(config, max_new_tokens=40)
        reference = run(target, None, prompt, with_method(config, method="ar")).tokens
        generation = run(target, draft, prompt, config, policy)
        assert generation.tokens == reference
        accepted += generation.stats.accepted
    assert accepted > 0  # the draft agrees sometimes: multi-token rounds were exercised


def test_caches_hold_exactly_the_committed_tokens(models):
    """After decoding, each cache equals a fresh prefill of the committed prefix."""
    target, draft = models
    prompt = prompts(1, seed=3)[0]
    target_lm, draft_lm = KVModel(target), KVModel(draft)
    drafter = ModelDrafter(draft_lm)
    out = generate(target_lm, drafter, prompt, DecodeConfig(method="mcsd", max_new_tokens=37,
                                                            max_depth=4)).tokens
    committed = torch.cat([prompt, torch.tensor(out)])
    for lm, model in [(target_lm, target), (draft_lm, draft)]:
        assert lm.length >= prompt.shape[0] + len(out) - 2
        assert_cache_holds(lm, model, committed[: lm.length])


def assert_cache_holds(lm: KVModel, model: torch.nn.Module, tokens: torch.Tensor,
                       features: torch.Tensor | None = None, first_position: int = 0) -> None:
    """`lm`'s cache (keys and values of every layer) equals a fresh prefill of `model` with
    `tokens` [lm.length] at positions `first_position`.. (and their `features`)."""
    assert tokens.shape[0] == lm.length, (tokens.shape, lm.length)
    fresh = KVModel(model)
    fresh.extend(tokens, torch.arange(first_position, first_position + lm.length), None, features)
    assert len(lm.cache.layers) == len(fresh.cache.layers)
    for ours, ref in zip(lm.cache.layers, fresh.cache.layers):
        assert ours.keys.shape == ref.keys.shape
        torch.testing.assert_close(ours.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values, ref.values, atol=1e-5, rtol=1e-5)


def test_eos_stops_and_budget_is_exact(models):
    target, draft = models
    prompt = prompts(1, seed=5)[0]
    free = run(target, None, prompt, DecodeConfig(method="ar", max_new_tokens=40)).tokens
    eos = free[17]
    cut = free[: free.index(eos) + 1]
    for config in EXACT:
        for budget in (1, 7, 40):
            tokens = run(target, draft, prompt, with_method(config, max_new_tokens=budget),
                         eos_id=eos).tokens
            assert tokens == cut[:budget]


def test_draft_equal_to_target_accepts_everything_when_sampling(models):
    target, _ = models
    config = DecodeConfig(method="mcsd", max_new_tokens=40, max_depth=4,
                          sampling=Sampling(temperature=1.0, top_p=0.9))
    generator = torch.Generator().manual_seed(0)
    stats = run(target, target, prompts(1)[0], config, generator=generator).stats
    assert stats.acceptance_rate > 0.95
    assert stats.mean_accepted > 3.5


def test_padding_to_a_cheaper_width_keeps_the_output(models):
    target, draft = models
    costs = CostCurve({1: 1.0, 2: 0.9, 4: 1.5, 8: 0.5, 16: 2.0})
    prompt = prompts(1, seed=7)[0]
    for config in EXACT:
        config = with_method(config, max_new_tokens=30)
        assert run(target, draft, prompt, config, costs=costs).tokens == \
            run(target, None, prompt, with_method(config, method="ar")).tokens


def test_hook_sees_every_drafted_token_with_consistent_labels(models):
    target, draft = models
    records: list[RoundRecord] = []
    config = DecodeConfig(method="mcsd", max_new_tokens=30, max_depth=3, mcsd_branching=(2,))
    generation = run(target, draft, prompts(1, seed=2)[0], config, FixedDepth(3),
                     hook=records.append)
    assert len(records) == len(generation.stats.accepted_per_round)
    assert sum(r.tokens.shape[0] for r in records) == generation.stats.drafted_tokens
    for record, accepted in zip(records, generation.stats.accepted_per_round):
        assert int((record.labels == 1).sum()) == accepted
        # greedy: a tested token is accepted iff it is the target's argmax at its parent,
        # and then its target probability is the largest
        assert record.features.shape[0] == record.tokens.shape[0]
        assert torch.all((record.p_target > 0) & (record.q_draft > 0))
        for depth in range(1, int(record.depth.max()) + 1):
            assert int((record.labels[record.depth == depth] == 1).sum()) <= 1


def test_lossy_ti_mcsd_decodes_within_budget(models):
    target, draft = models
    config = DecodeConfig(method="ti-mcsd", lossy=True, max_new_tokens=25, max_depth=3)
    generation = run(target, draft, prompts(1)[0], config)
    assert len(generation.tokens) == 25
