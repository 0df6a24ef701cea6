"""Prepacked and upcast linears (models/packed.py): what each computes, chosen by hardware.packed_linears and
hardware.upcast_linears."""

from __future__ import annotations

import pytest
import torch

from skipkv import SamplingParams, generate, hardware, make_policy
from skipkv.errors import SkipKVError
from skipkv.models import load_model
from skipkv.models.packed import PackedLinear, UpcastLinear

SUPPORTED = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
needs_bf16 = pytest.mark.skipif(not SUPPORTED, reason="oneDNN has no bf16 on this CPU")


@needs_bf16
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(1,), (3, 1), (2, 7)])
def test_packed_linear_is_bit_identical(bias, lead):
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 80, bias=bias).to(torch.bfloat16)
    x = torch.randn(*lead, 96, dtype=torch.bfloat16)
    packed = PackedLinear(lin, keep_dense=False)
    assert torch.equal(packed(x), lin(x))
    assert not hasattr(packed, "weight") and PackedLinear(lin, keep_dense=True).weight is lin.weight


@needs_bf16
def test_bf16_models_pack_and_generate_the_same_tokens(monkeypatch):
    monkeypatch.delenv(hardware.PACK_ENV, raising=False)
    packed = load_model("random:qwen2", dtype="bf16")
    assert "prepacked" in packed.packed_linears
    layer = packed.model.model.layers[0]
    assert isinstance(layer.mlp.gate_proj, PackedLinear) and isinstance(layer.self_attn.o_proj, PackedLinear)
    assert layer.self_attn.o_proj.weight.dtype == torch.bfloat16  # LaProx reads it
    monkeypatch.setenv(hardware.PACK_ENV, "0")
    dense = load_model("random:qwen2", dtype="bf16")
    assert isinstance(dense.model.model.layers[0].mlp.gate_proj, torch.nn.Linear)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = ["The quick brown fox", "A much longer prompt about nothing in particular, " * 3]
    for policy in (make_policy("full"), make_policy("laprox", budget=16, prefill_window=4)):
        a = [r.token_ids for r in generate(packed, prompts, sp, policy)]
        b = [r.token_ids for r in generate(dense, prompts, sp, policy)]
        assert a == b


def test_only_bf16_on_a_cpu_packs(monkeypatch):
    monkeypatch.delenv(hardware.PACK_ENV, raising=False)
    assert hardware.packed_linears(torch.float32, "cpu")[0] is False
    assert hardware.packed_linears(torch.float64, "cpu")[0] is False
    assert hardware.packed_linears(torch.bfloat16, "cuda")[0] is False
    assert "prepacked" not in load_model("random:qwen2", dtype="fp64").packed_linears
    monkeypatch.setenv(hardware.PACK_ENV, "0")
    assert hardware.packed_linears(torch.bfloat16, "cpu") == (False, "SKIPKV_PACKED_LINEARS=0 (overridden)")
    monkeypatch.setenv(hardware.PACK_ENV, "on")
    with pytest.raises(SkipKVError, match="SKIPKV_PACKED_LINEARS must be 0 or 1"):
        hardware.packed_linears(torch.bfloat16, "cpu")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(1,), (3, 1), (4,), (2, 7), (48, 1)])
def test_upcast_linear_is_fp32_products_rounded_once(bias, lead):
    torch.manual_seed(0)
    lin = torch.nn.Linear(896, 320, bias=bias).to(torch.bfloat16)
    x = torch.randn(*lead, 896, dtype=torch.bfloat16)
    up = UpcastLinear(lin, keep_dense=False)
    ref = torch.nn.functional.linear(x.double(), lin.weight.double(),
                                     None if lin.bias is None else lin.bias.double()).float().to(torch.bfloat16)
    out = up(x)
    assert out.dtype == torch.bfloat16 and out.shape == (*lead, 320)
    formula = torch.nn.functional.linear(x.float(), lin.weight.float(),
                                         None if lin.bias is None else lin.bias.float()).to(torch.bfloat16)
    # The same fp32 sums in another order (the layout decides MKL's kernel): at most one bf16 step apart, and
    # almost always equal (on the AVX2 EPYC it was measured on, bit-equal from 4 rows on; see UpcastLinear).
    assert ((out.float() - formula.float()).abs() <= torch.finfo(torch.bfloat16).eps
            * formula.float().abs().clamp_min(1e-3)).all()
    assert (out == formula).float().mean() > 0.99
    # fp32 sums of exact products: at most one bf16 step from the fp64 reference, almost always on it
    step = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(1e-3)
    assert ((out.float() - ref.float()).abs() <= step).all()
    assert (out == ref).float().mean() > 0.99
    assert up.weight32_t.dtype == torch.float32 and up.weight32_t.shape == (896, 320)
    assert up.weight32_t.is_contiguous() and not hasattr(up, "weight")
    assert UpcastLinear(lin, keep_dense=True).weight is lin.weight


def test_bf16_models_upcast_on_request_and_compute_the_same_function(monkeypatch):
    monkeypatch.setenv(hardware.PACK_ENV, "0")
    monkeypatch.setenv(hardware.UPCAST_ENV, "0")
    dense = load_model("random:qwen2", dtype="bf16")
    assert isinstance(dense.model.model.layers[0].mlp.gate_proj, torch.nn.Linear)
    monkeypatch.setenv(hardware.UPCAST_ENV, "1")
    up = load_model("random:qwen2", dtype="bf16")
    assert "upcast to fp32" in up.packed_linears and up.dtype == torch.bfloat16
    layer = up.model.model.layers[0]
    assert isinstance(layer.mlp.gate_proj, UpcastLinear) and not hasattr(layer.mlp.gate_proj, "weight")
    assert layer.self_attn.o_proj.weight.dtype == torch.bfloat16  # LaProx reads it
    ids = torch.tensor([list(range(5, 69))])
    with torch.no_grad():
        a = up.model(ids).logits.float()
        b = dense.model(ids).logits.float()
    assert (a - b).abs().max() < 0.05 * b.abs().max()  # the same weights, bf16 rounding apart
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for policy in (make_policy("full"), make_policy("laprox", budget=16, prefill_window=4)):
        [r] = generate(up, ["The quick brown fox jumps over the lazy dog " * 2], sp, policy)
        assert len(r.token_ids) == 8


def test_only_bf16_on_a_cpu_without_onednn_bf16_upcasts(monkeypatch):
    monkeypatch.delenv(hardware.UPCAST_ENV, raising=False)
    monkeypatch.delenv(hardware.PACK_ENV, raising=False)
    assert hardware.upcast_linears(torch.float32, "cpu")[0] is False
    assert hardware.upcast_linears(torch.bfloat16, "cuda")[0] is False
    assert hardware.upcast_linears(torch.bfloat16, "cpu")[0] is (not SUPPORTED)
    assert "upcast" not in load_model("random:qwen2", dtype="fp32").packed_linears
    monkeypatch.setenv(hardware.UPCAST_ENV, "0")
    assert hardware.upcast_linears(torch.bfloat16, "cpu") == (False, "SKIPKV_UPCAST_LINEARS=0 (overridden)")
    monkeypatch.setenv(hardware.UPCAST_ENV, "1")
    assert hardware.upcast_linears(torch.bfloat16, "cpu") == (True, "SKIPKV_UPCAST_LINEARS=1 (overridden)")
    assert hardware.upcast_linears(torch.float32, "cpu")[0] is False
    assert hardware.environment()["upcast_linears_cpu_bf16"]["upcast"] is True
    monkeypatch.setenv(hardware.UPCAST_ENV, "yes")
    with pytest.raises(SkipKVError, match="SKIPKV_UPCAST_LINEARS must be 0 or 1"):
        hardware.upcast_linears(torch.bfloat16, "cpu")
