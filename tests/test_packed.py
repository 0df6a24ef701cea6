"""Prepacked linears (models/packed.py): bit-identical to nn.Linear, chosen by hardware.packed_linears."""

from __future__ import annotations

import pytest
import torch

from skipkv import SamplingParams, generate, hardware, make_policy
from skipkv.errors import SkipKVError
from skipkv.models import load_model
from skipkv.models.packed import PackedLinear

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
