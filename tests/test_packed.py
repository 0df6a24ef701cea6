"""Prepacked, upcast and transposed linears (models/packed.py): what each computes, chosen by
kernels.packed_linears, kernels.upcast_linears and kernels.transposed_linears."""

from __future__ import annotations

import pytest
import torch

from skipkv import SamplingParams, generate, hardware, kernels, make_policy
from skipkv.errors import SkipKVError
from skipkv.models import load_model
from skipkv.models.packed import (
    FusedLinear,
    LinearPart,
    PackedLinear,
    TransposedLinear,
    UpcastLinear,
    fuse_projections,
    transpose_linears,
)
from skipkv.models.random import _TINY

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
    monkeypatch.delenv(kernels.PACK_ENV, raising=False)
    packed = load_model("random:qwen2", dtype="bf16")
    assert "prepacked" in packed.plan.linears.reason
    layer = packed.model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, FusedLinear) and isinstance(layer.mlp.gate_proj, LinearPart)
    assert isinstance(layer.self_attn.o_proj, PackedLinear)
    assert layer.self_attn.o_proj.weight.dtype == torch.bfloat16  # LaProx reads it
    monkeypatch.setenv(kernels.PACK_ENV, "0")
    dense = load_model("random:qwen2", dtype="bf16")
    assert isinstance(dense.model.model.layers[0].mlp.gate_proj, torch.nn.Linear)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = ["The quick brown fox", "A much longer prompt about nothing in particular, " * 3]
    for policy in (make_policy("full"), make_policy("laprox", budget=16, prefill_window=4)):
        a = [r.token_ids for r in generate(packed, prompts, sp, policy)]
        b = [r.token_ids for r in generate(dense, prompts, sp, policy)]
        assert a == b


def test_only_bf16_on_a_cpu_packs(monkeypatch):
    monkeypatch.delenv(kernels.PACK_ENV, raising=False)
    monkeypatch.setenv(kernels.TRANSPOSE_ENV, "1")  # an explicit transposed layout is kept (the suite's pin)
    assert kernels.packed_linears(torch.float32, "cpu")[0] is False
    assert kernels.packed_linears(torch.float64, "cpu")[0] is False
    assert kernels.packed_linears(torch.bfloat16, "cuda")[0] is False
    assert "prepacked" not in load_model("random:qwen2", dtype="fp64").plan.linears.reason
    monkeypatch.setenv(kernels.PACK_ENV, "0")
    assert kernels.packed_linears(torch.bfloat16, "cpu") == (False, "SKIPKV_PACKED_LINEARS=0 (overridden)")
    monkeypatch.setenv(kernels.PACK_ENV, "on")
    with pytest.raises(SkipKVError, match="SKIPKV_PACKED_LINEARS must be 0 or 1"):
        kernels.packed_linears(torch.bfloat16, "cpu")


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")


@needs_onednn
@pytest.mark.parametrize(("flags", "threads", "transpose_env", "packs"), [
    ({"avx2"}, 2, None, True),  # the AVX2-only EPYC: measured faster with two threads
    ({"avx2"}, 4, None, True),
    ({"avx2"}, 1, None, False),  # one thread: lost at batch 1
    ({"avx2", "avx512f"}, 2, None, False),  # not measured with AVX512
    (set(), 2, None, False),
    ({"avx2"}, 2, "1", False),  # an explicit transposed layout wins over the default
    ({"avx2"}, 2, "0", True),
])
def test_fp32_packs_by_processor_and_threads(monkeypatch, flags, threads, transpose_env, packs):
    monkeypatch.delenv(kernels.PACK_ENV, raising=False)
    if transpose_env is None:
        monkeypatch.delenv(kernels.TRANSPOSE_ENV, raising=False)
    else:
        monkeypatch.setenv(kernels.TRANSPOSE_ENV, transpose_env)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: set(flags))
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    got, why = kernels.packed_linears(torch.float32, "cpu")
    assert got is packs, why
    assert kernels.packed_linears(torch.float64, "cpu")[0] is False
    assert kernels.packed_linears(torch.float32, "cuda")[0] is False
    monkeypatch.setenv(kernels.PACK_ENV, "0")
    assert kernels.packed_linears(torch.float32, "cpu")[0] is False


@needs_onednn
@pytest.mark.parametrize("bias", [(True, True, True), (False, False, False), (True, False, True)])
@pytest.mark.parametrize("lead", [(1,), (3, 1), (16,), (2, 7), (300,)])
def test_fused_linear_is_the_separate_products(bias, lead):
    """A FusedLinear's parts give each linear's own packed product, a missing bias as zero: bit for bit without a
    bias (oneDNN sums each output column alone), to the last bit with one (where the bias enters the sum can
    follow the output width); the shared product serves only the input it was computed for."""
    torch.manual_seed(0)
    lins = [torch.nn.Linear(96, n, bias=b) for n, b in zip((64, 32, 32), bias)]
    fused = FusedLinear(lins)
    parts = [LinearPart(fused, i) for i in range(3)]
    x, other = torch.randn(*lead, 96), torch.randn(*lead, 96)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        if not any(bias):
            return torch.equal(a, b)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        return True

    for lin, part in zip(lins, parts):
        assert same(part(x), PackedLinear(lin, keep_dense=False)(x))
    assert same(fused(x), torch.cat([PackedLinear(lin, keep_dense=False)(x) for lin in lins], dim=-1))
    # part 0 of x, then part 1 of another input: never x's product
    parts[0](x)
    assert same(parts[1](other), PackedLinear(lins[1], keep_dense=False)(other))
    assert len(list(parts[0].children())) == 0  # the fused weight is registered once, on the parent


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 511, 512, 513, 1300])
def test_fp32_products_over_many_rows_run_in_blocks_with_the_same_bits(monkeypatch, rows):
    from skipkv.models import packed as packed_mod

    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 80)
    layer = PackedLinear(lin, keep_dense=False)
    x = torch.randn(rows, 96)
    whole = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
    calls: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:  # counts the products and their rows
        def __call__(self, a, *args):
            calls.append(a.shape[0])
            return real(a, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", Spy())
    assert torch.equal(layer(x), whole)
    assert calls == ([packed_mod.FP32_ROW_BLOCK] * (rows // packed_mod.FP32_ROW_BLOCK)
                     + [rows % packed_mod.FP32_ROW_BLOCK] * (rows % packed_mod.FP32_ROW_BLOCK > 0) or [0])


@needs_onednn
def test_fused_projections_replace_the_layers_linears_and_keep_the_logits(monkeypatch):
    monkeypatch.setenv(kernels.PACK_ENV, "0")
    dense = load_model("random:qwen2", dtype="fp32")
    unfused = load_model("random:qwen2", dtype="fp32")
    for m in (unfused.model,):
        for parent_name, name in [(p, n) for p, mod in m.named_modules() for n, c in mod.named_children()
                                  if type(c) is torch.nn.Linear]:
            parent = m.get_submodule(parent_name)
            setattr(parent, name, PackedLinear(getattr(parent, name), keep_dense=True))
    monkeypatch.setenv(kernels.PACK_ENV, "1")
    packed = load_model("random:qwen2", dtype="fp32")
    layers = packed.model.model.layers
    assert "fused" in packed.plan.linears.reason and fuse_projections(packed.model) == 0  # nothing left to fuse
    assert all(isinstance(layer.self_attn.qkv_proj, FusedLinear) and isinstance(layer.mlp.gate_up_proj, FusedLinear)
               for layer in layers)
    assert layers[0].self_attn.qkv_proj.splits == [64, 32, 32]
    ids = torch.tensor([[3, 17, 99, 5, 42, 7], [8, 1, 2, 9, 4, 4]])
    with torch.no_grad():
        torch.testing.assert_close(packed.model(ids).logits, unfused.model(ids).logits, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(packed.model(ids).logits, dense.model(ids).logits, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_fp32_packs_when_asked_and_computes_the_same_linear(monkeypatch):
    """SKIPKV_PACKED_LINEARS=1 packs fp32 on any CPU: oneDNN's fp32 kernel sums in another order than MKL's, so
    its products agree to fp32 rounding, not bit for bit."""
    monkeypatch.setenv(kernels.PACK_ENV, "1")
    assert kernels.packed_linears(torch.float32, "cpu") == (True, "CPU, fp32, oneDNN (SKIPKV_PACKED_LINEARS=1)")
    assert kernels.packed_linears(torch.float64, "cpu")[0] is False
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 80)
    for lead in ((1,), (5,), (2, 7)):
        x = torch.randn(*lead, 96)
        torch.testing.assert_close(PackedLinear(lin, keep_dense=False)(x), lin(x), rtol=1e-5, atol=1e-5)
    bundle = load_model("random:qwen2", dtype="fp32")
    assert "prepacked" in bundle.plan.linears.reason
    assert isinstance(bundle.model.model.layers[0].mlp.down_proj, PackedLinear)
    assert bundle.model.model.layers[0].self_attn.o_proj.weight.dtype == torch.float32  # LaProx reads it
    monkeypatch.setenv(kernels.PACK_ENV, "0")
    dense = load_model("random:qwen2", dtype="fp32")
    ids = torch.tensor([[3, 17, 99, 5, 42, 7]])
    with torch.no_grad():
        torch.testing.assert_close(bundle.model(ids).logits, dense.model(ids).logits, rtol=1e-4, atol=1e-4)


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
    monkeypatch.setenv(kernels.PACK_ENV, "0")
    monkeypatch.setenv(kernels.UPCAST_ENV, "0")
    dense = load_model("random:qwen2", dtype="bf16")
    assert isinstance(dense.model.model.layers[0].mlp.gate_proj, torch.nn.Linear)
    monkeypatch.setenv(kernels.UPCAST_ENV, "1")
    up = load_model("random:qwen2", dtype="bf16")
    assert "upcast to fp32" in up.plan.linears.reason and up.dtype == torch.bfloat16
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
    monkeypatch.delenv(kernels.UPCAST_ENV, raising=False)
    monkeypatch.delenv(kernels.PACK_ENV, raising=False)
    assert kernels.upcast_linears(torch.float32, "cpu")[0] is False
    assert kernels.upcast_linears(torch.bfloat16, "cuda")[0] is False
    assert kernels.upcast_linears(torch.bfloat16, "cpu")[0] is (not SUPPORTED)
    assert "upcast" not in load_model("random:qwen2", dtype="fp32").plan.linears.reason
    monkeypatch.setenv(kernels.UPCAST_ENV, "0")
    assert kernels.upcast_linears(torch.bfloat16, "cpu") == (False, "SKIPKV_UPCAST_LINEARS=0 (overridden)")
    monkeypatch.setenv(kernels.UPCAST_ENV, "1")
    assert kernels.upcast_linears(torch.bfloat16, "cpu") == (True, "SKIPKV_UPCAST_LINEARS=1 (overridden)")
    assert kernels.upcast_linears(torch.float32, "cpu")[0] is False
    assert hardware.environment()["upcast_linears_cpu_bf16"]["upcast"] is True
    monkeypatch.setenv(kernels.UPCAST_ENV, "yes")
    with pytest.raises(SkipKVError, match="SKIPKV_UPCAST_LINEARS must be 0 or 1"):
        kernels.upcast_linears(torch.bfloat16, "cpu")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(1,), (3, 1), (4,), (2, 7), (48, 1)])
def test_transposed_linear_is_the_fp32_linear_with_one_copy(bias, lead):
    torch.manual_seed(0)
    lin = torch.nn.Linear(896, 320, bias=bias)
    x = torch.randn(*lead, 896)
    tr = TransposedLinear(lin, keep_dense=False)
    out = tr(x)
    assert out.dtype == torch.float32 and out.shape == (*lead, 320)
    ref = torch.nn.functional.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    # fp32 sums in MKL's order for this layout: within a few fp32 steps of the fp64 result
    assert ((out.double() - ref).abs() <= 64 * torch.finfo(torch.float32).eps * ref.abs().clamp_min(1)).all()
    assert torch.allclose(out, lin(x), rtol=1e-5, atol=1e-5)
    assert tr.weight32_t.shape == (896, 320) and tr.weight32_t.is_contiguous() and not hasattr(tr, "weight")
    dense = TransposedLinear(lin, keep_dense=True)
    # the (out, in) weight LaProx and the fidelity benchmark read: the same values, a view of the one copy
    assert torch.equal(dense.weight, lin.weight) and dense.weight.data_ptr() == dense.weight32_t.data_ptr()


def test_fp32_models_transpose_on_request_and_compute_the_same_function(monkeypatch):
    monkeypatch.setenv(kernels.PACK_ENV, "0")
    monkeypatch.setenv(kernels.TRANSPOSE_ENV, "0")
    plain = load_model("random:qwen2:sharp", dtype="fp32")
    assert isinstance(plain.model.model.layers[0].mlp.gate_proj, torch.nn.Linear)
    monkeypatch.setenv(kernels.TRANSPOSE_ENV, "1")
    tr = load_model("random:qwen2:sharp", dtype="fp32")
    assert "stored (in, out)" in tr.plan.linears.reason and tr.dtype == torch.float32
    layer = tr.model.model.layers[0]
    assert isinstance(layer.mlp.gate_proj, TransposedLinear) and not hasattr(layer.mlp.gate_proj, "weight")
    assert not isinstance(layer.mlp.gate_proj, UpcastLinear)
    assert torch.equal(layer.self_attn.o_proj.weight, plain.model.model.layers[0].self_attn.o_proj.weight)
    ids = torch.tensor([list(range(5, 69))])
    with torch.no_grad():
        a, b = tr.model(ids).logits, plain.model(ids).logits
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    # LaProx reads o_proj.weight (here the view): the same selections and tokens on the sharp model
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = ["The quick brown fox jumps over the lazy dog " * 3, "2 + 2 = 4, and 3 + 3 = 6; " * 4]
    for policy in (make_policy("full"), make_policy("laprox", budget=16, prefill_window=4)):
        ra, rb = generate(tr, prompts, sp, policy), generate(plain, prompts, sp, policy)
        assert [r.token_ids for r in ra] == [r.token_ids for r in rb]


def test_a_tied_output_layer_keeps_one_transposed_copy():
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**_TINY, tie_word_embeddings=True)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.tensor([[3, 17, 255, 4, 99, 500, 1, 2]])
    with torch.no_grad():
        before = model(ids).logits
    assert transpose_linears(model) == 15
    head, embed = model.lm_head, model.model.embed_tokens
    assert isinstance(head, TransposedLinear) and head.weight is embed.weight
    assert embed.weight.data_ptr() == head.weight32_t.data_ptr()  # one copy of the vocab x hidden matrix
    with torch.no_grad():
        after = model(ids).logits
    assert torch.allclose(after, before, rtol=1e-5, atol=1e-5)


def test_only_fp32_on_an_avx2_cpu_without_avx512_transposes(monkeypatch):
    monkeypatch.delenv(kernels.TRANSPOSE_ENV, raising=False)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2"})
    # one thread: with two or more, fp32 is packed there instead (test_fp32_packs_by_processor_and_threads)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert kernels.transposed_linears(torch.float32, "cpu")[0] is True
    assert kernels.transposed_linears(torch.float64, "cpu")[0] is False
    assert kernels.transposed_linears(torch.bfloat16, "cpu")[0] is False
    assert kernels.transposed_linears(torch.float32, "cuda")[0] is False
    assert "stored (in, out)" in load_model("random:qwen2", dtype="fp32").plan.linears.reason
    assert "stored (in, out)" not in load_model("random:qwen2", dtype="fp64").plan.linears.reason
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "avx512f"})
    assert kernels.transposed_linears(torch.float32, "cpu") == (
        False, "CPU with AVX512: the transposed layout was measured on AVX2-only CPUs only")
    assert "stored (in, out)" not in load_model("random:qwen2", dtype="fp32").plan.linears.reason
    monkeypatch.setattr(kernels, "cpu_flags", lambda: set())
    assert kernels.transposed_linears(torch.float32, "cpu")[0] is False
    monkeypatch.setenv(kernels.TRANSPOSE_ENV, "1")
    assert kernels.transposed_linears(torch.float32, "cpu") == (True, "SKIPKV_TRANSPOSED_LINEARS=1 (overridden)")
    assert kernels.transposed_linears(torch.float64, "cpu")[0] is False
    assert hardware.environment()["transposed_linears_cpu_fp32"]["transposed"] is True
    monkeypatch.setenv(kernels.TRANSPOSE_ENV, "0")
    assert kernels.transposed_linears(torch.float32, "cpu") == (False, "SKIPKV_TRANSPOSED_LINEARS=0 (overridden)")
    monkeypatch.setenv(kernels.TRANSPOSE_ENV, "true")
    with pytest.raises(SkipKVError, match="SKIPKV_TRANSPOSED_LINEARS must be 0 or 1"):
        kernels.transposed_linears(torch.float32, "cpu")


def test_replacing_linears_frees_each_old_weight_before_the_next_copy(monkeypatch):
    import weakref

    from skipkv.models import packed

    model = load_model("random:qwen2", dtype="fp64").model  # fp64: nothing replaced at load
    old = [weakref.ref(m.weight) for m in model.modules() if type(m) is torch.nn.Linear]
    alive_at_release = []
    monkeypatch.setattr(packed, "release_free_memory", lambda: alive_at_release.append(sum(r() is not None
                                                                                         for r in old)))
    assert transpose_linears(model) == len(old) == 15
    # after the k-th replacement only the 15 - k weights not yet replaced are alive: the pages of each old one
    # can go back to the kernel before the next copy is made
    assert alive_at_release == list(range(len(old) - 1, -1, -1))
    assert hardware.release_free_memory() is (hardware._glibc() is not None)
