"""The kernel plan (plan.py): resolved once at load, frozen, recorded as it ran; and every change skipkv makes to
a transformers model applied and removed in one place (models/patches.py)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from conftest import PROMPTS
from skipkv import SamplingParams, generate, hardware, kernels, make_policy
from skipkv.cli import main
from skipkv.config import EngineConfig
from skipkv.engine import Engine
from skipkv.engine.step import FixedStep
from skipkv.errors import SkipKVError
from skipkv.models import ModelBundle, load_model, packed
from skipkv.models.patches import apply_linears, linears_of, restore_linears
from skipkv.plan import Choice, KernelPlan


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kernel_plan_is_what_the_model_runs(monkeypatch, tmp_path, dtype):
    """The plan of a loaded model (and an eval run's config) names its own linears, decode attention, p.V and decode
    step: packed fp32 linears and the compiled step where those are forced, eager under enforce_eager; the engine
    built on that bundle runs the step the plan names."""
    monkeypatch.setenv(kernels.PACK_ENV, "1")
    monkeypatch.setenv(kernels.STEP_ENV, "compiled")
    monkeypatch.setenv(kernels.SDPA_ENV, "0")
    kernels._decode_attention.cache_clear()
    try:
        bundle = load_model("random:qwen2", dtype=dtype)
        plan = bundle.plan.record()
        assert plan["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[dtype] and plan["device"] == "cpu"
        assert plan["linears"]["reason"] == bundle.plan.linears.reason
        assert plan["decode_attention"]["kernel"] == "grouped"
        assert dtype != "fp32" or "prepacked" in plan["linears"]["reason"]  # bf16: prepacked or upcast, by the CPU
        assert plan["decode_pv"]["dtype"] == "model" and plan["decode_step"]["step"] == "compiled"
        assert bundle.plan.eager().record()["decode_step"]["step"] == "eager"
        eng = Engine(bundle, make_policy("full"), EngineConfig(enforce_eager=True))
        try:
            fixed = eng.runner.fixed
            assert isinstance(fixed, FixedStep) and not fixed.compiled and eng.plan.step.value == "eager"
        finally:
            eng.close()
        assert hardware.environment(bundle=bundle)["kernel_plan"] == plan
        assert "kernel_plan" not in hardware.environment()
    finally:
        kernels._decode_attention.cache_clear()
    out = tmp_path / "run"
    monkeypatch.setenv(kernels.STEP_ENV, "eager")
    assert main(["eval", "--model", "random:qwen2", "--dtype", dtype, "--dataset", "gsm8k", "--limit", "1",
                 "--max-tokens", "4", "--out", str(out)]) == 0
    recorded = json.loads((out / "config.json").read_text())["environment"]["kernel_plan"]
    assert recorded["decode_step"]["step"] == "eager" and recorded["linears"] == plan["linears"]


def test_the_plan_is_frozen_at_load(monkeypatch):
    """Switches changed after a model loads change nothing it runs: the engine's step and the attention's kernels
    come from the bundle's plan, not from the environment at each forward."""
    monkeypatch.setenv(kernels.STEP_ENV, "eager")
    monkeypatch.setenv(kernels.SDPA_ENV, "0")
    kernels._decode_attention.cache_clear()
    try:
        bundle = load_model("random:qwen2", dtype="bf16")
        assert bundle.plan.step.value == "eager" and not bundle.plan.sdpa
        want = generate(bundle, PROMPTS[:2], SamplingParams(max_new_tokens=6, ignore_eos=True))
        monkeypatch.setenv(kernels.STEP_ENV, "hf")
        monkeypatch.setenv(kernels.SDPA_ENV, "1")
        kernels._decode_attention.cache_clear()
        with Engine(bundle) as eng:
            assert isinstance(eng.runner.fixed, FixedStep) and eng.plan is bundle.plan
        got = generate(bundle, PROMPTS[:2], SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert KernelPlan.resolve(torch.bfloat16, "cpu").step.value == "hf"  # what a new load would get
    finally:
        kernels._decode_attention.cache_clear()


def test_the_attention_follows_the_plan_not_the_environment(monkeypatch):
    """A bf16 model loaded with the grouped decode attention and the HF step keeps both when the switches flip
    after it loads: no decode step calls torch's fused SDPA."""
    from skipkv import attention

    monkeypatch.setenv(kernels.STEP_ENV, "hf")
    monkeypatch.setenv(kernels.SDPA_ENV, "0")
    kernels._decode_attention.cache_clear()
    try:
        bundle = load_model("random:qwen2", dtype="bf16")
        monkeypatch.setenv(kernels.STEP_ENV, "eager")
        monkeypatch.setenv(kernels.SDPA_ENV, "1")
        kernels._decode_attention.cache_clear()
        fused = []
        real = attention.F.scaled_dot_product_attention

        def sdpa(query, *args, **kwargs):
            fused.append(query.shape[2])
            return real(query, *args, **kwargs)

        monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
        with Engine(bundle) as eng:
            assert eng.runner.fixed is None
            eng.add_request(PROMPTS[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
            while eng.has_unfinished():
                eng.step()
        assert fused and 1 not in fused  # the prefill's causal SDPA only
    finally:
        kernels._decode_attention.cache_clear()


def _changes(model) -> dict:
    """Every change skipkv may leave on a model: attention function, wrapped MLP forwards, layer pre-hooks."""
    layers = model.model.layers
    return {"attention": model.config._attn_implementation,
            "mlp_forwards": sum("forward" in vars(layer.mlp) for layer in layers),
            "pre_hooks": sum(len(layer._forward_pre_hooks) for layer in layers)}


def test_an_engine_removes_every_change_it_made():
    """Open, an Engine routes attention, unpads the MLPs and holds its steering hook; closed (or refused), the model
    is as it was. A model of its own: MLPs unpadded by a bare ModelRunner elsewhere stay as that runner left them."""
    from skipkv.steering.hook import ResidualAdd

    tiny = load_model("random:qwen2", dtype="fp64")
    before = _changes(tiny.model)
    assert before == {"attention": "sdpa", "mlp_forwards": 0, "pre_hooks": 0}
    vec = torch.zeros(tiny.model.config.hidden_size, dtype=torch.float64)
    eng = Engine(tiny, make_policy("full"), steering=lambda m: ResidualAdd(m, layer=1, vector=vec, coef=lambda s: 0.0))
    opened = _changes(tiny.model)
    assert opened == {"attention": "skipkv", "mlp_forwards": len(tiny.model.model.layers),
                      "pre_hooks": before["pre_hooks"] + 1}
    with pytest.raises(SkipKVError, match="another Engine is open"):
        Engine(tiny)
    assert _changes(tiny.model) == opened  # the refused second engine took nothing away
    eng.close()
    assert _changes(tiny.model) == before
    eng.close()  # idempotent
    with pytest.raises(SkipKVError):  # refused after the hook was made: nothing stays
        Engine(tiny, make_policy("snapkv", budget=8), EngineConfig(prefill_chunk=4),
               steering=lambda m: ResidualAdd(m, layer=1, vector=vec, coef=lambda s: 0.0))
    assert _changes(tiny.model) == before


@pytest.mark.parametrize("kind", ["packed", "transposed", "upcast"])
def test_restore_linears_gives_back_the_models_linears(monkeypatch, kind):
    """Linears replaced as a plan says (prepacked and fused, transposed, upcast) restored as nn.Linears: the same
    weights and biases as before, an output layer tied to the embedding (as the 0.5B's) tied again, the same
    logits."""
    for env in (kernels.PACK_ENV, kernels.TRANSPOSE_ENV, kernels.UPCAST_ENV):
        monkeypatch.setenv(env, "0")
    bundle = load_model("random:qwen2", dtype="bf16" if kind == "upcast" else "fp32")
    model = bundle.model
    assert bundle.plan.linears.value == "torch"
    model.lm_head.weight = model.model.embed_tokens.weight
    model.model.layers[0].self_attn.k_proj.bias = None  # a fused product of linears with and without a bias
    reference = copy.deepcopy(model)
    plan = apply_linears(model, dataclasses.replace(bundle.plan, linears=Choice(kind, "test")))
    assert plan.linears.value == kind == linears_of(model).value and "linears" in plan.linears.reason
    ids = torch.tensor([[5, 9, 2, 7, 11, 3]])
    with torch.no_grad():
        replaced = model(ids).logits
    assert restore_linears(model) > 0
    assert linears_of(model).value == "torch"
    assert not any(isinstance(m, (packed.PackedLinear, packed.TransposedLinear, packed.LinearPart))
                   for m in model.modules())
    want, got = dict(reference.named_parameters()), dict(model.named_parameters())
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(got[name], w), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        restored = model(ids).logits
        assert torch.equal(restored, reference(ids).logits)
    torch.testing.assert_close(restored, replaced, rtol=2e-2, atol=2e-2)  # other kernels: rounding only
    with pytest.raises(SkipKVError, match="linears must be one of"):
        apply_linears(model, dataclasses.replace(bundle.plan, linears=Choice("int8", "test")))


def test_a_model_loaded_elsewhere_gets_the_plan_of_its_linears(monkeypatch, tiny):
    """A bundle around a transformers model skipkv did not load (a press) plans for its linears as they are: torch's,
    so the eager step, not the compiled one (which is for fp32 on packed linears); a skipkv-loaded model handed
    back says what it holds, and keeps its compiled step."""
    monkeypatch.setenv(kernels.PACK_ENV, "1")
    monkeypatch.setenv(kernels.SDPA_ENV, "0")  # the fixed step runs where the decode attention is the grouped one
    monkeypatch.delenv(kernels.STEP_ENV, raising=False)
    monkeypatch.setattr(kernels, "cxx_compiler", lambda: "/usr/bin/g++")
    assert ModelBundle(tiny.model, tiny.tokenizer, "x", "qwen2").plan.linears.value == "torch"
    loaded = load_model("random:qwen2", dtype="fp32")
    assert loaded.plan.linears.value == "packed" and loaded.plan.step.value == "compiled"
    again = ModelBundle(loaded.model, loaded.tokenizer, "x", "qwen2")
    assert again.plan.linears.value == "packed" and again.plan.step == loaded.plan.step
    foreign = KernelPlan.resolve(torch.float32, "cpu", linears=linears_of(tiny.model))
    assert foreign.linears.value == "torch" and foreign.step.value == "eager"
