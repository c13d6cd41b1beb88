"""Captured forwards (`KVModel.capture`, issue 17) on the CPU.  Dynamo traces the models as it
does on CUDA; most tests run the traced graphs as they are (the eager backend, seconds), one
compiles them with Inductor as `models.compile: on` does on a CPU.  Greedy identity with `ar`
for every exact method and both drafters, the caches after decoding against a fresh prefill,
and a handful of compiled shapes rather than one per cached length."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import specstop.decoder.kv as kv
from specstop.common.errors import SpecstopError
from specstop.decoder.drafter import FeatureDrafter, ModelDrafter
from specstop.decoder.kv import KVModel
from specstop.decoder.loop import DecodeConfig, generate
from specstop.decoder.policy import ConfidenceTree, FixedDepth
from specstop.drafts.families import build_feature_head
from specstop.drafts.loading import load_runtime

from test_dynamic_tree import RULES, TREE
from test_loop_tiny import EXACT, assert_cache_holds, prompts, with_method

from conftest import perturbed_copy, tiny_llama

TOKENS = 24


@pytest.fixture(scope="module")
def models():
    """(target, draft, feature head): the CPU tests' tiny models."""
    target = tiny_llama(0)
    torch.manual_seed(2)
    return target, perturbed_copy(target, 0.6, seed=1), build_feature_head(target, 1, None).eval()


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> None:
    """`capture` runs Dynamo's graphs without compiling them."""
    monkeypatch.setattr(kv, "capture", lambda model: torch.compile(model, backend="eager",
                                                                   dynamic=False))
    torch._dynamo.reset()


def decode(models, prompt: torch.Tensor, config: DecodeConfig, captured: bool,
           kind: str = "model") -> tuple[list[int], KVModel, KVModel | None]:
    """(tokens, target's KVModel, draft's) of one decode, both models captured or neither;
    `tree` under the verify-all confidence tree."""
    target, draft, head = models
    target_lm = KVModel(target)
    drafter = None
    if config.method != "ar":
        drafter = FeatureDrafter(KVModel(head)) if kind == "feature" \
            else ModelDrafter(KVModel(draft))
    if captured:
        for lm in [target_lm] + ([drafter.lm] if drafter else []):
            lm.capture()
    policy = ConfidenceTree(RULES["verify-all"]) if config.method == "tree" else FixedDepth(3)
    tokens = generate(target_lm, drafter, prompt, config, policy).tokens
    return tokens, target_lm, drafter.lm if drafter else None


CONFIGS = [with_method(c, max_new_tokens=TOKENS) for c in EXACT] + \
    [with_method(TREE, max_new_tokens=TOKENS)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.method}-{c.mcsd_branching}")
def test_captured_greedy_methods_equal_ar(models, traced, config: DecodeConfig) -> None:
    ar = with_method(config, method="ar")
    for prompt in prompts(2):
        assert decode(models, prompt, config, True)[0] == decode(models, prompt, ar, False)[0]


def test_captured_feature_drafter_tree_equals_ar(models, traced) -> None:
    config = with_method(TREE, max_new_tokens=TOKENS)
    ar = with_method(config, method="ar")
    for prompt in prompts(2):
        tokens = decode(models, prompt, config, True, kind="feature")[0]
        assert tokens == decode(models, prompt, ar, False)[0]


@pytest.mark.parametrize("method", ["sd", "tree"])
def test_captured_caches_hold_exactly_the_committed_tokens(models, traced, method: str) -> None:
    """After decoding, both caches (read as views of their first `length` positions) equal a
    fresh prefill of what they committed."""
    config = next(c for c in CONFIGS if c.method == method)
    prompt = prompts(1, seed=3)[0]
    tokens, target_lm, draft_lm = decode(models, prompt, config, True)
    committed = torch.cat([prompt, torch.tensor(tokens)])
    for lm, model in [(target_lm, models[0]), (draft_lm, models[1])]:
        assert lm.length >= prompt.shape[0] + len(tokens) - 2
        assert_cache_holds(lm, model, committed[: lm.length])


def test_a_handful_of_shapes_is_compiled(models, traced) -> None:
    """Calls are padded to powers of two over a cache grown by `CAPACITY_STEP`s: decoding 3
    prompts of 24 tokens with `sd` and `mcsd` compiles a few graphs per model, not one per
    cached length (~150 calls)."""
    counters.clear()
    for config in CONFIGS[:2]:
        for prompt in prompts(3):
            decode(models, prompt, config, True)
    graphs = counters["stats"]["unique_graphs"]
    print(f"\n{graphs} graphs compiled")
    assert 0 < graphs <= 12


def test_inductor_capture_equals_ar(models) -> None:
    """The capture `models.compile: on` gives on a CPU (Inductor's C++ kernels)."""
    torch._dynamo.reset()
    config = with_method(EXACT[0], max_new_tokens=12)
    prompt = prompts(1, seed=5)[0]
    ar = with_method(config, method="ar")
    assert decode(models, prompt, config, True)[0] == decode(models, prompt, ar, False)[0]


@pytest.mark.parametrize("setting,captured", [("on", True), ("auto", False), ("off", False)])
def test_the_compile_setting_captures_both_models(tiny_model_dir, setting: str,
                                                  captured: bool) -> None:
    """`models.compile`: on captures target and draft, auto only on CUDA (this is a CPU); the
    kernel a cost table must match says so."""
    runtime = load_runtime(str(tiny_model_dir), "layers:1", "float32", "cpu", cpu_kernel="aten",
                           compile=setting)
    for lm in (runtime.target, runtime.draft):
        assert (lm.captured is not None) == captured
        assert lm.kernel == ("aten+compiled" if captured else "aten")


def test_compiling_with_the_prepacked_cpu_kernel_is_refused_before_loading() -> None:
    """Inductor cannot lower oneDNN's prepacked linear: one line, before any model is read."""
    with pytest.raises(SpecstopError, match="models.compile: on needs models.cpu_kernel: aten"):
        load_runtime("/nonexistent/model", None, "float32", "cpu", compile="on")
