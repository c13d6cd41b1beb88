"""The decode loop on a CUDA GPU (tiny random Llamas in fp32, as on the CPU): greedy identity
with `ar` for every exact method, eager and captured as CUDA graphs (`KVModel.capture`, mode
reduce-overhead), sampling with a CUDA generator, the caches after decoding, and the CUDA
synchronisations of a greedy `sd` round.  Skipped without a GPU; `make gpu-check`
(scripts/gpu_check.sh) runs them with `pytest -m cuda`."""

from __future__ import annotations

import warnings

import pytest
import torch

from specstop.decoder.drafter import ModelDrafter
from specstop.decoder.kv import KVModel
from specstop.decoder.loop import DecodeConfig, Generation, generate
from specstop.decoder.policy import ConfidenceTree
from specstop.decoder.sampling import Sampling
from specstop.drafts.families import build_feature_head

from test_compiled import CONFIGS
from test_compiled import decode as decode_captured
from test_dynamic_tree import RULES, ar_tokens, tree_run
from test_loop_tiny import EXACT, assert_cache_holds, prompts, run, with_method

from conftest import perturbed_copy, tiny_llama

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 97
TOKENS = 32
METHODS = {"sd": DecodeConfig(method="sd", max_depth=4, max_new_tokens=TOKENS),
           "mcsd": DecodeConfig(method="mcsd", max_depth=3, mcsd_branching=(2, 2),
                                max_new_tokens=TOKENS),
           "ti-mcsd": DecodeConfig(method="ti-mcsd", max_depth=3, ti_width=3,
                                   max_new_tokens=TOKENS),
           "tree": DecodeConfig(method="tree", max_depth=4, max_new_tokens=TOKENS)}
MAX_SYNCS_PER_ROUND = 200  # generous: the figure itself is printed


@pytest.fixture(scope="module")
def models():
    """(target, draft, feature head) on the GPU, fp32: the CPU tests' tiny models."""
    target = tiny_llama(0)
    draft = perturbed_copy(target, 0.6, seed=1)
    torch.manual_seed(2)
    head = build_feature_head(target, 1, None).eval()
    return target.cuda(), draft.cuda(), head.cuda()


def decode(models, prompt: torch.Tensor, method: str, sampling: Sampling = Sampling(),
           **kw) -> Generation:
    """`method` of METHODS with the draft model (`tree`: the verify-all confidence tree)."""
    target, draft, _ = models
    config = with_method(METHODS[method], sampling=sampling)
    policy = ConfidenceTree(RULES["verify-all"]) if method == "tree" else None
    return run(target, draft, prompt, config, policy, **kw)


@pytest.mark.parametrize("config", EXACT, ids=lambda c: f"{c.method}-{c.mcsd_branching}")
def test_greedy_static_methods_equal_ar(models, config):
    target, draft, _ = models
    config = with_method(config, max_new_tokens=TOKENS)
    for prompt in prompts(3):
        reference = run(target, None, prompt, with_method(config, method="ar")).tokens
        assert run(target, draft, prompt, config).tokens == reference


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.method}-{c.mcsd_branching}")
def test_cuda_graphs_equal_ar(models, config):
    """Both models captured as CUDA graphs: the tokens of eager `ar`, and the caches of a fresh
    prefill."""
    torch._dynamo.reset()
    for prompt in prompts(2):
        tokens, target_lm, draft_lm = decode_captured(models, prompt, config, True)
        assert tokens == decode_captured(models, prompt, with_method(config, method="ar"),
                                         False)[0]
    committed = torch.cat([prompt, torch.tensor(tokens)])
    for lm, model in [(target_lm, models[0]), (draft_lm, models[1])]:
        assert_cache_holds(lm, model, committed[: lm.length])


@pytest.mark.parametrize("kind", ["model", "feature"])
@pytest.mark.parametrize("rule", ["verify-all", "pruned", "width-1"])
def test_greedy_tree_equals_ar(models, rule, kind):
    for prompt in prompts(2):
        assert tree_run(models, prompt, rule, kind=kind).tokens == ar_tokens(models, prompt)


@pytest.mark.parametrize("method", METHODS)
def test_sampling_with_a_cuda_generator(models, method):
    sampling = Sampling(temperature=1.0, top_p=0.9)
    runs = [decode(models, prompts(1, seed=4)[0], method, sampling,
                   generator=torch.Generator("cuda").manual_seed(7)).tokens for _ in range(2)]
    assert len(runs[0]) == TOKENS and all(0 <= t < VOCAB for t in runs[0])
    assert runs[0] == runs[1]  # seeded: the same draws


@pytest.mark.parametrize("method", METHODS)
def test_caches_hold_exactly_the_committed_tokens(models, method):
    target, draft, _ = models
    prompt = prompts(1, seed=3)[0]
    target_lm, draft_lm = KVModel(target), KVModel(draft)
    config = METHODS[method]
    policy = ConfidenceTree(RULES["verify-all"]) if method == "tree" else None
    out = generate(target_lm, ModelDrafter(draft_lm), prompt, config, policy).tokens
    committed = torch.cat([prompt, torch.tensor(out)])
    for lm, model in [(target_lm, target), (draft_lm, draft)]:
        assert lm.length >= prompt.shape[0] + len(out) - 2
        assert_cache_holds(lm, model, committed[: lm.length])


def count_syncs(models, prompt: torch.Tensor) -> tuple[int, Generation]:
    """The synchronising CUDA calls of one greedy `sd` decode, and the decode."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            generation = decode(models, prompt, "sd")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchronizing" in str(w.message) for w in caught)
    return syncs, generation


def test_cuda_synchronisations_per_greedy_sd_round(models):
    prompt = prompts(1, seed=5)[0]
    decode(models, prompt, "sd")  # warm-up: lazy CUDA initialisation
    syncs, generation = count_syncs(models, prompt)
    rounds = len(generation.stats.accepted_per_round)
    print(f"\ncuda syncs per greedy sd round: {syncs / rounds:.1f} "
          f"({syncs} in {rounds} rounds and the prefill)")
    assert rounds > 0 and syncs / rounds <= MAX_SYNCS_PER_ROUND
