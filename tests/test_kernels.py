"""oneDNN-packed linear layers (decoder/kernels.py): same function, row-invariant results, plain
state dicts, bf16 packed where it is native (bitwise aten's result), and the decode loop's
greedy identity on packed tiny Llamas (fp32)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from specstop.decoder import kernels
from specstop.decoder.costs import VerifyCosts
from specstop.decoder.drafter import ModelDrafter
from specstop.decoder.kernels import PackedLinear, kernel_of, pack_linears
from specstop.decoder.load import cpu_has_bf16
from specstop.decoder.kv import KVModel
from specstop.decoder.loop import DecodeConfig, generate
from specstop.drafts.families import truncated_draft

from conftest import perturbed_copy, tiny_llama

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_the_linear(bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    for shape in [(1, 48), (5, 48), (1, 3, 48)]:
        x = torch.randn(shape)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.weight, linear.weight.detach())


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """What the greedy identity of a one-token step and a multi-token pass rests on."""
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(576, 1536, bias=False))
    x = torch.randn(1, 16, 576)
    whole = packed(x)
    for n in (1, 2, 3, 4, 5, 8):
        assert torch.equal(packed(x[:, :n]), whole[:, :n]), n


def test_packing_keeps_the_state_dict_and_what_is_built_from_it():
    target = tiny_llama(0, layers=3)
    packed = pack_linears(copy.deepcopy(target))
    assert kernel_of(packed) == "onednn" and kernel_of(target) == "aten"
    assert not any(type(m) is nn.Linear for m in packed.modules())
    plain, kept = target.state_dict(), packed.state_dict()
    assert plain.keys() == kept.keys()
    assert all(torch.equal(plain[k], kept[k]) for k in plain)
    ids = torch.arange(10)[None]
    torch.testing.assert_close(truncated_draft(packed, 2)(ids).logits,
                               truncated_draft(target, 2)(ids).logits)


@pytest.mark.parametrize("native", [
    pytest.param(True, marks=pytest.mark.skipif(
        not cpu_has_bf16(), reason="the CPU has no native bf16 (oneDNN packs bf16 weights "
        "only with AVX512 or AVX-NE-CONVERT)")),
    False])
def test_bf16_models_are_packed_only_where_bf16_is_native(monkeypatch, native):
    monkeypatch.setattr(kernels, "cpu_has_bf16", lambda: native)
    assert kernel_of(pack_linears(tiny_llama(0).to(torch.bfloat16))) == (
        "onednn" if native else "aten")
    assert kernel_of(pack_linears(tiny_llama(0).to(torch.float16))) == "aten"
    assert kernel_of(pack_linears(tiny_llama(0))) == "onednn"


def test_the_aten_kernel_packs_nothing_and_a_bad_kernel_is_refused():
    assert kernel_of(pack_linears(tiny_llama(0), "aten")) == "aten"
    with pytest.raises(ValueError, match="unknown CPU kernel 'mkl'"):
        pack_linears(tiny_llama(0), "mkl")


@pytest.mark.skipif(not cpu_has_bf16(), reason="the CPU has no native bf16")
def test_a_packed_bf16_linear_matches_aten_bitwise():
    """Packing bf16 weights changes the speed only: every row's result is aten's, bit for bit."""
    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    packed = PackedLinear(linear)
    for rows in (1, 4, 32):
        x = torch.randn(1, rows, 576, dtype=torch.bfloat16)
        assert torch.equal(packed(x), linear(x)), rows


@pytest.mark.parametrize("config", [DecodeConfig(method="sd", max_depth=5),
                                    DecodeConfig(method="mcsd", max_depth=4,
                                                 mcsd_branching=(2, 2)),
                                    DecodeConfig(method="ti-mcsd", max_depth=4, ti_width=3)],
                         ids=lambda c: c.method)
def test_packed_models_decode_greedy_exactly(config):
    target = pack_linears(tiny_llama(0))
    draft = pack_linears(perturbed_copy(tiny_llama(0), 0.6, seed=1))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = torch.randint(0, 97, (7,), generator=g)
        ar = generate(KVModel(target), None, prompt,
                      DecodeConfig(method="ar", max_new_tokens=40)).tokens
        ours = generate(KVModel(target), ModelDrafter(KVModel(draft)), prompt,
                        DecodeConfig(**{**config.__dict__, "max_new_tokens": 40}))
        assert ours.tokens == ar
        assert ours.stats.accepted > 0


def test_a_verify_table_records_its_kernel(tmp_path):
    table = VerifyCosts("target", "float32", "cpu", 200, {1: 0.05, 4: 0.06}, "onednn")
    table.save(tmp_path / "verify.json")
    assert VerifyCosts.load(tmp_path / "verify.json") == table
    older = {k: v for k, v in json.loads((tmp_path / "verify.json").read_text()).items()
             if k != "kernel"}
    (tmp_path / "old.json").write_text(json.dumps(older))
    assert VerifyCosts.load(tmp_path / "old.json").kernel == "aten"
