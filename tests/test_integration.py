"""Integration: the embedded SmolLM2-135M target, fp32, greedy; every lossless method equals ar."""

from __future__ import annotations

import pytest
import torch

from specstop.decoder.drafter import ModelDrafter
from specstop.decoder.kv import KVModel
from specstop.decoder.loop import DecodeConfig
from specstop.decoder.policy import ConfidenceThreshold, FixedDepth
from specstop.drafts.loading import load_runtime
from specstop.evaluation.side_by_side import humaneval_prompts

from conftest import ROOT, perturbed_copy

pytestmark = pytest.mark.integration

N_PROMPTS = 20
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def runtime(embedded_dir):
    rt = load_runtime("embedded", None, dtype="float32", device="cpu",
                      cache_dir=ROOT / "data/models/target")
    # A draft that agrees with the target often, not always (on 5 of these prompts 85 of the
    # 120 tokens `sd` emitted were accepted drafts), so rounds accept 0..γ tokens.  A cheaper
    # draft, the target's first 2, 6 or 10 layers, accepted next to none.
    rt.drafter = ModelDrafter(KVModel(perturbed_copy(rt.target.model, 0.1, seed=0)))
    return rt


def test_every_lossless_method_equals_ar_on_real_prompts(runtime):
    configs = [
        (DecodeConfig(method="sd", max_new_tokens=NEW_TOKENS, max_depth=4), FixedDepth(4)),
        (DecodeConfig(method="mcsd", max_new_tokens=NEW_TOKENS, max_depth=3,
                      mcsd_branching=(2, 2)), FixedDepth(3)),
        (DecodeConfig(method="ti-mcsd", max_new_tokens=NEW_TOKENS, max_depth=4, ti_width=3),
         ConfidenceThreshold(0.3)),
    ]
    accepted = {c.method: 0 for c, _ in configs}
    for text in humaneval_prompts(N_PROMPTS):
        prompt = runtime.encode(text)
        reference = runtime.generate(prompt, DecodeConfig(method="ar",
                                                          max_new_tokens=NEW_TOKENS)).tokens
        for config, policy in configs:
            generation = runtime.generate(prompt, config, policy)
            assert generation.tokens == reference, (config.method, text[:60])
            accepted[config.method] += generation.stats.accepted
    assert all(n > 0 for n in accepted.values()), accepted


def test_chat_template_and_decoding_make_text(runtime):
    prompt = runtime.encode("What is the capital of France?")
    assert runtime.tokenizer.decode(prompt).count("<|im_start|>") >= 2  # system + user turns
    generation = runtime.generate(prompt, DecodeConfig(method="sd", max_new_tokens=12,
                                                       max_depth=3))
    assert "Paris" in runtime.tokenizer.decode(generation.tokens)


def test_truncated_draft_loads_and_is_lossless(embedded_dir):
    rt = load_runtime("embedded", "layers:2", dtype="float32", device="cpu",
                      cache_dir=ROOT / "data/models/target")
    prompt = rt.encode("Say hello.")
    ar = rt.generate(prompt, DecodeConfig(method="ar", max_new_tokens=10)).tokens
    assert rt.generate(prompt, DecodeConfig(method="sd", max_new_tokens=10, max_depth=3)).tokens \
        == ar
    assert torch.equal(rt.draft.model.model.embed_tokens.weight,
                       rt.target.model.model.embed_tokens.weight)


def test_lookup_equals_ar_on_real_prompts(runtime):
    """The prompt-lookup proposer (no draft model) on HumanEval prompts, whose code repeats the
    prompt's names: some lookups are accepted, the output is `ar`'s."""
    config = DecodeConfig(method="lookup", max_new_tokens=NEW_TOKENS, max_depth=6)
    accepted = 0
    for text in humaneval_prompts(8):
        prompt = runtime.encode(text)
        reference = runtime.generate(prompt, DecodeConfig(method="ar",
                                                          max_new_tokens=NEW_TOKENS)).tokens
        generation = runtime.generate(prompt, config, FixedDepth(6))
        assert generation.tokens == reference, text[:60]
        accepted += generation.stats.accepted
    assert accepted > 0
