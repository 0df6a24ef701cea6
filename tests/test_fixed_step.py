"""The fixed-shape decode step (engine/step.py) against the HF-module step it replaces: two engines in lockstep on
the same requests, one per step kind, must give the same tokens and hold the same cache entries after every step
(bit for bit in fp32, to rounding in fp64, where the eager step takes torch's fused SDPA), across compression
(R-KV, SnapKV: the query buffer), H2O's accumulators, steering, ragged rows and slot reuse. The compiled step
compiles with fullgraph and does not recompile as the batch shrinks or the key extent grows."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS, assert_same_entries
from skipkv import SamplingParams, generate, make_policy
from skipkv.config import EngineConfig
from skipkv.engine import Engine
from skipkv.engine.step import FixedStep
from skipkv.models import load_model
from skipkv.steering.hook import ResidualAdd

POLICIES = {
    "full": {},
    "rkv": dict(budget=16, window=4, interval=8),
    "snapkv": dict(budget=16, window=4, interval=8, phase="decode"),
    "h2o": dict(budget=16, window=4, interval=8),
    "streaming_llm": dict(budget=16, sink=2, interval=8),
    "expected_attention": dict(budget=16, window=4, interval=8, phase="decode"),
}


@pytest.fixture(scope="module")
def pair32():
    """Two copies of one tiny fp32 model (an Engine holds its model while open)."""
    return [load_model("random:qwen2", dtype="fp32") for _ in range(2)]


@pytest.fixture(scope="module")
def pair64():
    return [load_model("random:qwen2", dtype="fp64") for _ in range(2)]


def engines(monkeypatch, bundles, policy, cfg, kinds=("hf", "eager")) -> list[Engine]:
    out = []
    for bundle, kind in zip(bundles, kinds):
        monkeypatch.setattr(bundle, "plan", bundle.plan.with_step(kind))
        out.append(Engine(bundle, policy, cfg))
    return out


def lockstep(a: Engine, b: Engine, prompts, lengths, atol: float) -> dict:
    """Drive both engines with the same requests; after every step compare tokens and cache entries."""
    for p, n in zip(prompts, lengths):
        for eng in (a, b):
            eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
    done: dict = {}
    steps = fixed = 0
    while a.has_unfinished():
        oa, ob = a.step(), b.step()
        assert oa.new_tokens == ob.new_tokens, f"step {steps}"
        rows = len(a.runner.running)
        assert_same_entries(a.runner.store, b.runner.store, rows, atol=atol)
        if atol == 0:
            for l in range(a.runner.store.num_layers):
                for s in range(rows):
                    m = int(a.runner.store.lengths[l, s])
                    assert torch.equal(a.runner.store.k[l][s, :, :m], b.runner.store.k[l][s, :, :m])
                    assert torch.equal(a.runner.store.v[l][s, :, :m], b.runner.store.v[l][s, :, :m])
        qa, qb = a.runner.queries, b.runner.queries
        if qa is not None:  # the buffered queries (R-KV and SnapKV score with them at decode compressions)
            assert torch.equal(qa.qpos[:rows], qb.qpos[:rows])
            torch.testing.assert_close(qb.q[:, :rows], qa.q[:, :rows], rtol=0, atol=atol)
        fixed += b.runner.fixed is not None and bool(rows)
        for r in oa.finished:
            done[r.request_id] = r
        steps += 1
    assert not b.has_unfinished() and fixed > 0
    return done


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_fixed_step_equals_the_hf_step_fp32_bits(monkeypatch, pair32, name):
    # 6 ragged requests through 3 slots: rows of different lengths, slots refilled as requests finish
    a, b = engines(monkeypatch, pair32, make_policy(name, **POLICIES[name]), EngineConfig(batch_size=3))
    try:
        lockstep(a, b, PROMPTS + PROMPTS[:2], [14, 6, 11, 4, 8, 16], atol=0)
    finally:
        a.close(), b.close()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("name", ["full", "rkv", "h2o"])
def test_fixed_step_equals_the_hf_step_packed_fused_fp32_bits(monkeypatch, name):
    """Packed fp32 linears with fused q/k/v and gate/up (models/packed.py): the fixed step calls the fused
    products, the HF step their parts; the same bits."""
    monkeypatch.setenv("SKIPKV_PACKED_LINEARS", "1")
    pair = [load_model("random:qwen2", dtype="fp32") for _ in range(2)]
    assert all(hasattr(b.model.model.layers[0].self_attn, "qkv_proj") for b in pair)
    a, b = engines(monkeypatch, pair, make_policy(name, **POLICIES[name]), EngineConfig(batch_size=3))
    try:
        lockstep(a, b, PROMPTS + PROMPTS[:2], [14, 6, 11, 4, 8, 16], atol=0)
    finally:
        a.close(), b.close()


def test_fixed_step_equals_the_hf_step_fp64(monkeypatch, pair64):
    a, b = engines(monkeypatch, pair64, make_policy("rkv", **POLICIES["rkv"]), EngineConfig(batch_size=4))
    try:
        lockstep(a, b, PROMPTS, [20, 33, 9, 26], atol=1e-12)
    finally:
        a.close(), b.close()


def test_fixed_step_applies_steering_as_the_hook_does(monkeypatch, pair32):
    """A ResidualAdd that fires at every step (scale 3 at layer 1): the HF step runs it as a forward pre-hook, the
    fixed step adds it itself; both give the same tokens and entries, and steering does change them."""
    a, b = engines(monkeypatch, pair32, make_policy("full"), EngineConfig(batch_size=3))
    try:
        torch.manual_seed(3)
        vec = torch.randn(pair32[0].model.config.hidden_size)
        for eng in (a, b):
            eng.runner.steering = ResidualAdd(eng.bundle.model, layer=1, vector=vec, coef=lambda state: 3.0)
        steered = lockstep(a, b, PROMPTS[:3], [10, 6, 12], atol=0)
    finally:
        for eng in (a, b):
            eng.runner.steering.remove()
            eng.close()
    monkeypatch.setattr(pair32[1], "plan", pair32[1].plan.with_step("eager"))
    alone = generate(pair32[1], PROMPTS[:3], [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (10, 6, 12)],
                     make_policy("full"), EngineConfig(batch_size=3))
    assert [r.token_ids for r in alone] != [steered[r.request_id].token_ids for r in alone]


@pytest.mark.slow  # ~30 s of compiling on an idle 2-core machine (two graphs), more under load
def test_compiled_step_fullgraph_without_recompiles(monkeypatch, pair32):
    """Compiled (fullgraph): the tokens of the HF step; once the two graphs exist (batch 1 and batch >= 2), a
    shrinking batch, a growing key extent and new requests in reused slots recompile nothing."""
    a, b = engines(monkeypatch, pair32, make_policy("rkv", **POLICIES["rkv"]), EngineConfig(batch_size=3),
                   kinds=("hf", "compiled"))
    try:
        assert b.runner.fixed is not None and b.runner.fixed.compiled
        lockstep(a, b, PROMPTS[:2], [6, 3], atol=1e-5)  # batch 2, then 1: both graphs
        with torch._dynamo.config.patch(error_on_recompile=True):
            lockstep(a, b, PROMPTS + PROMPTS[:1], [14, 9, 20, 4], atol=1e-5)
    finally:
        a.close(), b.close()


@pytest.mark.slow  # ~40 s of compiling
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_compiled_step_on_packed_fused_linears(monkeypatch):
    """The default on an AVX2-only x86 CPU in fp32 (kernels.decode_step): the compiled step over packed, fused
    linears (their products through the `skipkv::packed_linear` op) gives the HF step's tokens and entries."""
    monkeypatch.setenv("SKIPKV_PACKED_LINEARS", "1")
    pair = [load_model("random:qwen2", dtype="fp32") for _ in range(2)]
    a, b = engines(monkeypatch, pair, make_policy("rkv", **POLICIES["rkv"]), EngineConfig(batch_size=3),
                   kinds=("hf", "compiled"))
    try:
        assert b.runner.fixed is not None and b.runner.fixed.compiled
        lockstep(a, b, PROMPTS + PROMPTS[:1], [14, 9, 20, 4], atol=1e-5)
    finally:
        a.close(), b.close()


def test_an_entry_past_the_capacity_is_refused_not_written(pair32):
    """As KVStore.append: a step that would write past a slot's capacity raises before any index write."""
    eng = Engine(pair32[0], make_policy("full"), EngineConfig(batch_size=1))
    try:
        eng.add_request(PROMPTS[0], SamplingParams(max_new_tokens=3, ignore_eos=True))
        eng.step()
        store = eng.runner.store
        step = FixedStep(pair32[0].model, pair32[0].plan)
        with torch.inference_mode():  # the engine's tensors are inference tensors
            store.lengths[:, 0] = store.capacities[0]  # every entry taken
            before = store.k[0].clone()
            with pytest.raises(RuntimeError, match="KV slot overflow"):
                step(store, torch.tensor([5]), torch.tensor([store.capacities[0]]))
        assert torch.equal(store.k[0], before)
    finally:
        eng.close()


def test_supports_only_uniform_stores(pair32):
    eng = Engine(pair32[0], make_policy("adakv", budget=48), EngineConfig(batch_size=2))
    try:
        assert FixedStep.supports(pair32[0].model, eng.runner.store) == (False, "head-split store")
    finally:
        eng.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("command", [["generate", "--max-new-tokens", "2", "hi"], ["serve", "--port", "18997"]])
def test_generate_and_serve_take_device(command, capsys):
    """`--device` on generate and serve (as on eval and bench throughput): a device this machine lacks is one line."""
    from skipkv.cli import main

    try:
        code = main([command[0], "--model", "random:qwen2", "--device", "cuda", *command[1:]])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "device 'cuda' is not available" in err, err


@pytest.mark.parametrize("flags,threads,cxx,step", [
    ({"avx2"}, 2, "g++", "compiled"),  # fp32 packed on an AVX2-only x86 CPU: measured faster compiled
    ({"avx2"}, 2, "no-such-compiler", "eager"),  # torch.compile needs a C++ compiler
    ({"avx2"}, 1, "g++", "eager"),  # one thread: not packed, not measured
    ({"avx2", "avx512f"}, 2, "g++", "eager"),  # not measured with AVX512
])
def test_decode_step_is_compiled_where_measured_faster(monkeypatch, flags, threads, cxx, step):
    from skipkv import kernels

    for env in (kernels.STEP_ENV, kernels.PACK_ENV, kernels.TRANSPOSE_ENV, kernels.SDPA_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: set(flags))
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(kernels.shutil, "which", lambda name: f"/usr/bin/{name}" if name == "g++" else None)
    got, why = kernels.decode_step(torch.float32, "cpu")
    assert got == step, why
    assert kernels.decode_step(torch.float64, "cpu")[0] == "hf"
    assert kernels.decode_step(torch.float32, "cuda")[0] == "hf"
    monkeypatch.setenv(kernels.STEP_ENV, "eager")
    assert kernels.decode_step(torch.float32, "cpu")[0] == "eager"


def test_enforce_eager_keeps_the_step_uncompiled(monkeypatch, pair32):
    """EngineConfig.enforce_eager (`--enforce-eager`) turns a compiled choice into the eager fixed step, and leaves
    the other choices as they are."""
    monkeypatch.setattr(pair32[0], "plan", pair32[0].plan.with_step("compiled"))
    with Engine(pair32[0], make_policy("full"), EngineConfig(enforce_eager=True)) as eng:
        assert eng.runner.fixed is not None and not eng.runner.fixed.compiled
    with Engine(pair32[0], make_policy("full"), EngineConfig()) as eng:
        assert eng.runner.fixed is not None and eng.runner.fixed.compiled
    monkeypatch.setattr(pair32[0], "plan", pair32[0].plan.with_step("hf"))
    with Engine(pair32[0], make_policy("full"), EngineConfig(enforce_eager=True)) as eng:
        assert eng.runner.fixed is None
