"""The in-place KV cache (`decoder/kv.py`) on tiny random Llamas (fp32): after decoding, both
caches hold exactly the committed tokens; `retain` moves only the accepted positions; growth
keeps the contents; hidden states are asked for only where wanted, and equal transformers'."""

from __future__ import annotations

import pytest
import torch

from specstop.decoder.drafter import FeatureDrafter, ModelDrafter
from specstop.decoder.kv import InPlaceLayer, KVModel
from specstop.decoder.loop import DecodeConfig, generate
from specstop.decoder.policy import ConfidenceTree
from specstop.decoder.sampling import Sampling
from specstop.drafts.families import build_feature_head, fusion_layers

from test_dynamic_tree import RULES
from test_loop_tiny import assert_cache_holds, prompts

from conftest import perturbed_copy, tiny_llama

CONFIGS = {"sd": DecodeConfig(method="sd", max_depth=4),
           "mcsd": DecodeConfig(method="mcsd", max_depth=3, mcsd_branching=(2, 2)),
           "ti-mcsd": DecodeConfig(method="ti-mcsd", max_depth=3, ti_width=3),
           "tree": DecodeConfig(method="tree", max_depth=4)}
SAMPLINGS = {"greedy": Sampling(), "sampled": Sampling(temperature=1.0)}


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0, layers=4)
    torch.manual_seed(2)
    heads = {"feature": build_feature_head(target, 1, None).eval(),
             "fused": build_feature_head(target, 1, None, fuse=True).eval()}
    return target, perturbed_copy(target, 0.3, seed=1), heads


def drafter_for(models, kind: str) -> ModelDrafter | FeatureDrafter:
    _, draft, heads = models
    if kind == "model":
        return ModelDrafter(KVModel(draft))
    return FeatureDrafter(KVModel(heads[kind]))


@pytest.mark.parametrize("kind", ["model", "feature", "fused"])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("method", list(CONFIGS))
def test_caches_hold_exactly_the_committed_tokens(models, method, sampling, kind):
    target, draft, heads = models
    config = DecodeConfig(**{**CONFIGS[method].__dict__, "max_new_tokens": 40,
                             "sampling": SAMPLINGS[sampling]})
    policy = ConfidenceTree(RULES["verify-all"]) if method == "tree" else None
    prompt = prompts(1, seed=3)[0]
    target_lm, drafter = KVModel(target), drafter_for(models, kind)
    generation = generate(target_lm, drafter, prompt, config, policy,
                          generator=torch.Generator().manual_seed(0))
    committed = torch.cat([prompt, torch.tensor(generation.tokens)])
    assert target_lm.length >= committed.shape[0] - 1
    assert_cache_holds(target_lm, target, committed[:target_lm.length])
    draft_lm = drafter.lm
    if kind == "model":
        assert_cache_holds(draft_lm, draft, committed[:draft_lm.length])
    else:  # head position j reads token j and the target's feature of position j - 1
        head = heads[kind]
        features = target_features(target, head, committed)[:draft_lm.length]
        assert_cache_holds(draft_lm, head, committed[1:draft_lm.length + 1], features, 1)


def target_features(target, head, sequence: torch.Tensor) -> torch.Tensor:
    """[T, H]: the head's features of the target's uncached pass over `sequence` [T]."""
    with torch.inference_mode():
        states = target(input_ids=sequence[None], output_hidden_states=True).hidden_states
        return head.project(torch.cat([states[i][0] for i in head.target_layers], dim=-1))


def test_retain_moves_only_the_accepted_positions():
    layer = InPlaceLayer(capacity=16)
    keys, values = torch.randn(2, 3, 12, 4), torch.randn(2, 3, 12, 4)
    with torch.inference_mode():
        layer.update(keys, values)
        buffer = layer.key_buffer.data_ptr()
        layer.retain(5, torch.tensor([0, 2, 5]))
    kept = torch.tensor([0, 1, 2, 3, 4, 5, 7, 10])
    assert layer.get_seq_length() == 8 and layer.get_mask_sizes(3) == (11, 0)
    assert layer.key_buffer.data_ptr() == buffer  # in place: nothing reallocated
    assert torch.equal(layer.keys, keys[:, :, kept])
    assert torch.equal(layer.values, values[:, :, kept])


def test_kvmodel_retain_keeps_the_accepted_nodes():
    """After a flat tree (siblings at one position) and `retain`, the cache holds the prefix,
    then each kept node as it is cached alone after the prefix; leading nodes 0, 1, .. stay."""
    model = tiny_llama(0)
    ids = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(0))
    prefix, siblings = ids[:5], ids[5:]
    alone = [cache_states(model, torch.cat([prefix, node[None]])) for node in siblings]
    for nodes in ([0, 1, 3], [1, 3], [0, 1, 2, 3], [2], []):
        lm = KVModel(model)
        lm.extend(prefix, torch.arange(5), None)
        lm.extend(siblings, torch.full((4,), 5), torch.eye(4, dtype=torch.bool))
        lm.retain(5, torch.tensor(nodes, dtype=torch.long))
        assert lm.length == 5 + len(nodes)
        for i, layer in enumerate(lm.cache.layers):
            for ours, kind in ((layer.keys, 0), (layer.values, 1)):
                expected = torch.cat([alone[0][i][kind][:, :, :5]]
                                     + [alone[n][i][kind][:, :, 5:] for n in nodes], dim=2)
                torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def cache_states(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of every layer after a fresh prefill of `ids`."""
    lm = KVModel(model)
    lm.extend(ids, torch.arange(ids.shape[0]), None)
    return [(layer.keys, layer.values) for layer in lm.cache.layers]


def test_growth_past_the_capacity_keeps_the_contents():
    layer = InPlaceLayer(capacity=3)
    keys, values = torch.randn(1, 2, 20, 4), torch.randn(1, 2, 20, 4)
    with torch.inference_mode():
        for start, end in [(0, 2), (2, 3), (3, 7), (7, 8), (8, 20)]:
            out_keys, out_values = layer.update(keys[:, :, start:end], values[:, :, start:end])
            assert torch.equal(out_keys, keys[:, :, :end])
            assert torch.equal(out_values, values[:, :, :end])
            assert layer.capacity >= end
        layer.reserve(64)
    assert layer.capacity == 64 and torch.equal(layer.keys, keys)


def test_reserve_allocates_once_and_reset_keeps_the_buffers():
    lm = KVModel(tiny_llama(0))
    lm.reserve(50)
    lm.extend(torch.arange(10), torch.arange(10), None)
    buffers = [layer.key_buffer.data_ptr() for layer in lm.cache.layers]
    lm.extend(torch.arange(40), torch.arange(10, 50), None)
    lm.reset()
    lm.extend(torch.arange(30), torch.arange(30), None)
    assert [layer.key_buffer.data_ptr() for layer in lm.cache.layers] == buffers
    assert lm.length == 30 and all(layer.keys.shape[2] == 30 for layer in lm.cache.layers)


@pytest.mark.parametrize("layers", [(0, 1, -1), fusion_layers(4), (-1,), (2, 2)])
def test_hidden_states_of_the_requested_layers_equal_transformers(layers):
    """A prompt and then a tree step: each equals the uncached pass with every hidden state."""
    model = tiny_llama(0, layers=4)
    ids = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(0))
    lm = KVModel(model)
    _, prompt_hidden = lm.extend_with_hidden(ids[:6], torch.arange(6), None, layers=layers)
    chain = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    _, step_hidden = lm.extend_with_hidden(ids[6:], torch.arange(6, 9), chain, layers=layers)
    with torch.inference_mode():
        states = model(input_ids=ids[None], output_hidden_states=True).hidden_states
    expected = torch.cat([states[i][0] for i in layers], dim=-1)
    torch.testing.assert_close(torch.cat([prompt_hidden, step_hidden]), expected,
                               atol=1e-5, rtol=1e-5)


def test_hidden_states_are_asked_for_only_where_wanted():
    model = tiny_llama(0)
    asked = []
    model.register_forward_pre_hook(
        lambda _, args, kwargs: asked.append(kwargs["output_hidden_states"]), with_kwargs=True)
    lm = KVModel(model)
    lm.extend(torch.arange(4), torch.arange(4), None)
    _, hidden = lm.extend_with_hidden(torch.arange(2), torch.arange(4, 6), None, layers=())
    _, last = lm.extend_with_hidden(torch.arange(2), torch.arange(6, 8), None, layers=(0, -1))
    assert asked == [False, False, [0, -1]]
    assert hidden.shape == (2, 0) and last.shape == (2, 2 * model.config.hidden_size)
