"""`--dtype auto` follows the processor: bf16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX), fp32
elsewhere, and every JSON that reports figures says what was chosen and why. The capability is faked both ways."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from skipkv import hardware, kernels
from skipkv.cli import main
from skipkv.errors import SkipKVError
from skipkv.models import load_model
from skipkv.plan import Choice, KernelPlan


def fake_cpu(monkeypatch, *, avx512_bf16: bool | None, amx: bool | None) -> None:
    """Make torch's CPU capability checks answer as given (None: this torch has no such check)."""
    monkeypatch.delenv(hardware.OVERRIDE_ENV, raising=False)
    for name, value in (("_is_avx512_bf16_supported", avx512_bf16), ("_is_amx_tile_supported", amx)):
        if value is None:
            monkeypatch.delattr(torch.cpu, name, raising=False)
        else:
            monkeypatch.setattr(torch.cpu, name, lambda value=value: value)


@pytest.mark.parametrize("avx512_bf16,amx,expected", [
    (True, False, "bf16"),   # e.g. an EPYC (Zen 4) with AVX512-BF16 and no AMX
    (False, True, "bf16"),   # AMX alone
    (True, True, "bf16"),    # Sapphire Rapids
    (False, False, "fp32"),  # AVX2-only or AVX512 without bf16: torch would emulate bf16
])
def test_choose_dtype_follows_the_capability(monkeypatch, avx512_bf16, amx, expected):
    fake_cpu(monkeypatch, avx512_bf16=avx512_bf16, amx=amx)
    choice = hardware.choose_dtype("cpu")
    assert choice.dtype == expected
    assert ("torch reports" in choice.reason) and (("neither" in choice.reason) == (expected == "fp32"))
    assert hardware.choose_dtype("cuda").dtype == "bf16"  # the GPU answer does not ask the CPU


@pytest.mark.parametrize("flags,expected", [("fpu avx2 avx512f avx512_bf16", "bf16"), ("fpu avx2 amx_bf16", "bf16"),
                                            ("fpu avx2 avx512f", "fp32")])
def test_proc_cpuinfo_when_torch_has_no_check(monkeypatch, tmp_path, flags, expected):
    fake_cpu(monkeypatch, avx512_bf16=None, amx=None)
    real_path = hardware.Path

    class FakeCpuinfo(type(real_path())):
        def read_text(self, *a, **k):
            if str(self) == "/proc/cpuinfo":
                return f"model name\t: Some CPU\nflags\t\t: {flags}\n"
            return super().read_text(*a, **k)

    monkeypatch.setattr(kernels, "Path", FakeCpuinfo)
    choice = hardware.choose_dtype("cpu")
    assert choice.dtype == expected and "/proc/cpuinfo" in choice.reason


def test_override_env(monkeypatch):
    fake_cpu(monkeypatch, avx512_bf16=True, amx=True)
    monkeypatch.setenv(hardware.OVERRIDE_ENV, "0")
    assert hardware.choose_dtype("cpu").dtype == "fp32" and "overridden" in hardware.choose_dtype().reason
    monkeypatch.setenv(hardware.OVERRIDE_ENV, "yes")
    with pytest.raises(SkipKVError, match="must be 0 or 1"):
        hardware.choose_dtype("cpu")


@pytest.mark.parametrize("native,expected,name", [(True, torch.bfloat16, "bf16"), (False, torch.float32, "fp32")])
def test_load_model_auto_is_the_default_and_is_recorded(monkeypatch, native, expected, name):
    fake_cpu(monkeypatch, avx512_bf16=native, amx=False)
    bundle = load_model("random:qwen2")
    assert bundle.dtype == expected
    assert bundle.dtype_choice is not None and bundle.dtype_choice.dtype == name
    assert load_model("random:qwen2", dtype="fp32").dtype_choice is None  # a requested dtype is not a choice


@pytest.mark.parametrize("native,expected", [(True, "bfloat16"), (False, "float32")])
def test_generate_json_says_what_ran(monkeypatch, capsys, native, expected):
    fake_cpu(monkeypatch, avx512_bf16=native, amx=False)
    assert main(["generate", "--model", "random:qwen2", "--policy", "full", "--max-new-tokens", "2", "--json",
                 "--threads", "1", "Hello"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["dtype"] == expected and row["torch_threads"] == 1
    assert ("neither" in row["dtype_reason"]) == (not native)
    torch.set_num_threads(2)  # what conftest set


@pytest.mark.parametrize("native,expected", [(True, "bf16"), (False, "fp32")])
def test_bench_throughput_json_records_the_choice(monkeypatch, tmp_path, native, expected):
    fake_cpu(monkeypatch, avx512_bf16=native, amx=False)
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", "random:qwen2", "--workload", "synthetic:8x4", "--requests", "2",
                 "--policies", "full", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["dtype"] == expected
    assert rep["machine"]["dtype_choice"]["dtype"] == expected
    assert rep["machine"]["machine"]["native_bf16"] is native
    assert rep["machine"]["machine"]["cpu"]


def test_threads_must_not_be_negative():
    assert main(["generate", "--model", "random:qwen2", "--threads", "-1", "Hi"]) == 2


@pytest.mark.parametrize("amx,expected", [(True, True), (False, False), (None, None)])
def test_decode_attention_follows_amx(monkeypatch, amx, expected):
    fake_cpu(monkeypatch, avx512_bf16=True, amx=amx)
    monkeypatch.delenv(kernels.SDPA_ENV, raising=False)
    kernels._decode_sdpa.cache_clear()
    if amx is None:  # no torch check: /proc/cpuinfo decides
        expected = "amx_tile" in kernels.cpu_flags()
    ok, why = kernels.decode_sdpa("cpu")
    assert ok is expected and ("AMX" in why or "amx" in why)
    assert kernels.decode_sdpa("cuda")[0] is True
    monkeypatch.setenv(kernels.SDPA_ENV, "0")
    assert kernels.decode_sdpa("cpu") == (False, "SKIPKV_DECODE_SDPA=0 (overridden)")
    monkeypatch.setenv(kernels.SDPA_ENV, "yes")
    with pytest.raises(SkipKVError, match="SKIPKV_DECODE_SDPA must be 0 or 1"):
        kernels.decode_sdpa("cpu")
    kernels._decode_sdpa.cache_clear()


def test_cuda_sdpa_excludes_cudnn_unless_asked(monkeypatch):
    from torch.nn.attention import SDPBackend

    monkeypatch.delenv(kernels.CUDNN_SDPA_ENV, raising=False)
    backends, why = kernels.cuda_sdpa_backends()
    assert SDPBackend.CUDNN_ATTENTION not in backends and SDPBackend.MATH in backends and "cuDNN" in why
    cuda = KernelPlan.resolve(torch.bfloat16, "cuda")
    assert cuda.record()["sdpa_cuda"]["reason"] == why
    with cuda.sdpa_context():  # enters without a GPU: it only sets torch's backend flags
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored on exit
    with KernelPlan.resolve(torch.bfloat16, "cpu").sdpa_context():
        assert torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setenv(kernels.CUDNN_SDPA_ENV, "1")
    assert kernels.cuda_sdpa_backends()[0] == ()  # torch's own choice
    monkeypatch.setenv(kernels.CUDNN_SDPA_ENV, "on")
    with pytest.raises(SkipKVError, match="SKIPKV_CUDNN_SDPA must be 0 or 1"):
        kernels.cuda_sdpa_backends()


@pytest.mark.parametrize("use_sdpa", ["1", "0"])
def test_bf16_decode_runs_the_chosen_kernel(monkeypatch, use_sdpa):
    """At batch 1 (every key visible) a bf16 decode step runs fused SDPA only where decode_sdpa says so; the two
    kernels agree to bf16 rounding (the real model's greedy tokens equal transformers' with either:
    tests/test_real_model.py, run on processors of both kinds)."""
    from skipkv import SamplingParams, generate, make_policy
    from skipkv.attention import F as attn_F

    monkeypatch.setenv(kernels.SDPA_ENV, use_sdpa)
    kernels._decode_attention.cache_clear()
    bundle = load_model("random:qwen2", dtype="bf16")  # the plan is resolved at load: after the switch
    calls = []
    real = attn_F.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        calls.append(q.shape[2])  # queries per row: 1 in a decode step
        out = real(q, k, v, *a, **kw)
        if q.shape[2] == 1:  # the grouped fp32 computation of the same step
            G = q.shape[1] // k.shape[1]
            logits = torch.matmul(q.float().reshape(q.shape[0], k.shape[1], G, q.shape[3]),
                                  k.float().transpose(-1, -2)) * kw.get("scale", q.shape[3] ** -0.5)
            ref = torch.matmul(torch.softmax(logits, -1), v.float()).reshape(out.shape)
            assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)
        return out

    monkeypatch.setattr(attn_F, "scaled_dot_product_attention", spy)
    generate(bundle, ["The quick brown fox"], SamplingParams(max_new_tokens=12, ignore_eos=True), make_policy("full"))
    assert (sum(1 for t in calls if t == 1) > 0) == (use_sdpa == "1")


def test_decode_pv_default_override_and_record(monkeypatch):
    monkeypatch.delenv(kernels.PV_ENV, raising=False)
    assert kernels.decode_pv()[0] == "model"
    assert hardware.environment()["decode_attention_cpu"]["pv"] == "model"
    monkeypatch.setenv(kernels.PV_ENV, "fp32")
    assert kernels.decode_pv() == ("fp32", "SKIPKV_DECODE_PV=fp32 (overridden)")
    assert hardware.environment()["decode_attention_cpu"]["pv"] == "fp32"
    monkeypatch.setenv(kernels.PV_ENV, "bf16")
    with pytest.raises(SkipKVError, match="SKIPKV_DECODE_PV must be fp32 or model"):
        kernels.decode_pv()
    assert kernels.attention_kernel({"kernel": "grouped_fp32"}) == ("grouped", "fp32")


@pytest.mark.parametrize("pv", ["model", "fp32"])
@pytest.mark.parametrize("head_split", [False, True])
def test_grouped_bf16_attention_multiplies_p_v_in_the_chosen_dtype(monkeypatch, pv, head_split):
    """A masked bf16 decode step (rows of different lengths) takes the grouped path; its output equals a naive
    per-head computation with q.k and softmax in fp32 and p.V either on probabilities rounded to bf16 (default)
    or on values converted to fp32. The two differ, so the test tells them apart."""
    from skipkv import SamplingParams, generate, make_policy
    from skipkv import attention as attn

    monkeypatch.setenv(kernels.SDPA_ENV, "0")
    monkeypatch.setenv(kernels.PV_ENV, pv)
    bundle = load_model("random:qwen2", dtype="bf16")
    seen = []
    real = attn._probs_times_values

    def spy(probs, value, plan, room=None):
        out = real(probs, value, plan, room)  # over key buckets where the probe allows: the bits must not change
        if value.dtype == torch.bfloat16:
            rounded = torch.matmul(probs.to(torch.bfloat16), value)
            exact = torch.matmul(probs, value.float()).to(torch.bfloat16)
            naive = torch.matmul(probs.double(), value.double())  # the product itself, to bf16 rounding
            assert torch.allclose(out.double(), naive, atol=2e-2, rtol=2e-2)
            seen.append((torch.equal(out, rounded if pv == "model" else exact), torch.equal(rounded, exact)))
        return out

    monkeypatch.setattr(attn, "_probs_times_values", spy)
    policy = make_policy("adakv", budget=8, window=2, prefill_window=4) if head_split else make_policy("full")
    generate(bundle, ["The quick brown fox", "Once upon a time, in a land far away, there lived a"],
             SamplingParams(max_new_tokens=6, ignore_eos=True), policy)
    assert seen and all(ok for ok, _ in seen)
    assert not all(same for _, same in seen)  # the two dtypes give different outputs on these steps


def test_key_bucket():
    buckets = [kernels.key_bucket(k) for k in range(1, 20000)]
    assert all(b >= k for k, b in enumerate(buckets, 1))
    assert all(b % 64 == 0 for b in buckets)
    assert all(b - k < 64 for k, b in enumerate(buckets[:1024], 1))  # multiples of 64 up to 1,024 keys
    assert all(b <= k * 1.125 for k, b in enumerate(buckets, 1) if k > 1024)
    assert buckets == sorted(buckets)
    assert len(set(buckets)) == 16 + 8 * 4 + 2  # up to 1,024; four octaves of 8; 16,385..19,999 in steps of 2,048
    assert [kernels.key_bucket(k) for k in (64, 65, 1025, 2049, 8193)] == [64, 128, 1152, 2304, 9216]


def test_pv_buckets_probe_override_and_record(monkeypatch):
    monkeypatch.delenv(kernels.BUCKET_ENV, raising=False)
    kernels._pv_buckets.cache_clear()
    ok, why = kernels.pv_buckets(torch.bfloat16)
    assert ok == kernels._padding_is_exact(torch.bfloat16) and "probe" in why
    assert hardware.environment()["decode_attention_cpu"]["pv_key_buckets_bf16"] == ok
    assert kernels.pv_buckets(torch.float16) == (False, "float16: key buckets are used for bf16 only")
    real_bmm, calls = torch.bmm, []

    def bmm_padded_off_by_one_ulp(a, b):  # the probe multiplies each shape unpadded, then padded
        calls.append(b.shape[1])
        out = real_bmm(a, b)
        return torch.nextafter(out, torch.full_like(out, float("inf"))) if len(calls) % 2 == 0 else out

    monkeypatch.setattr(hardware.torch, "bmm", bmm_padded_off_by_one_ulp)
    assert kernels._padding_is_exact(torch.bfloat16) is False
    monkeypatch.setattr(hardware.torch, "bmm", real_bmm)
    monkeypatch.setattr(kernels, "_padding_is_exact", lambda dtype: False)
    kernels._pv_buckets.cache_clear()
    assert kernels.pv_buckets(torch.bfloat16) == (False, "padded keys changed the bits in a probe of this machine's "
                                                          "matmul")
    monkeypatch.setenv(kernels.BUCKET_ENV, "1")
    assert kernels.pv_buckets(torch.bfloat16) == (True, "SKIPKV_DECODE_PV_BUCKETS=1 (overridden)")
    monkeypatch.setenv(kernels.BUCKET_ENV, "yes")
    with pytest.raises(SkipKVError, match="SKIPKV_DECODE_PV_BUCKETS must be 0 or 1"):
        kernels.pv_buckets(torch.bfloat16)
    kernels._pv_buckets.cache_clear()


@pytest.mark.parametrize("policy", ["full", "pyramidkv"])
def test_bf16_p_v_runs_over_key_buckets(monkeypatch, policy):
    """With key buckets on, every 16-bit p.V of a decode step multiplies over a bucketed key count of the store (a
    growing cache, and layers that keep different counts, reuse shapes); off, over the exact count. The tokens are
    the same (the bits are: test_grouped_bf16_attention_multiplies_p_v_in_the_chosen_dtype)."""
    from skipkv import SamplingParams, generate, make_policy
    from skipkv import attention as attn

    monkeypatch.setenv(kernels.SDPA_ENV, "0")
    monkeypatch.setenv(kernels.PV_ENV, "model")
    bundle = load_model("random:qwen2", dtype="bf16")
    real_matmul, real_pv = torch.matmul, attn._probs_times_values
    seen: list[tuple[int, int, int]] = []  # (keys, store capacity, keys the product ran over)

    def matmul(a, b, *args, **kw):
        if a.dtype == b.dtype == torch.bfloat16 and b.dim() == 4:  # probabilities x values [B, H, keys, D]
            seen[-1] = seen[-1][:2] + (b.shape[-2],)
        return real_matmul(a, b, *args, **kw)

    def pv(probs, value, plan, room=None):
        seen.append((value.shape[-2], room.shape[-2], -1))
        return real_pv(probs, value, plan, room)

    monkeypatch.setattr(attn.torch, "matmul", matmul)
    monkeypatch.setattr(attn, "_probs_times_values", pv)
    tokens = {}
    for on in ("1", "0"):
        monkeypatch.setattr(bundle, "plan", dataclasses.replace(bundle.plan, pv_buckets=Choice(on == "1", "test")))
        seen.clear()
        out = generate(bundle, ["The quick brown fox", "Once upon a time, in a land far away, there lived a " * 6],
                       SamplingParams(max_new_tokens=40, ignore_eos=True),
                       make_policy(policy, **({"budget": 24, "prefill_window": 4} if policy != "full" else {})))
        tokens[on] = [o.token_ids for o in out]
        assert seen
        if on == "1":
            assert all(ran == min(kernels.key_bucket(k), cap) for k, cap, ran in seen)
            assert any(ran > k for k, _, ran in seen)
        else:
            assert all(ran == k for k, _, ran in seen)
    assert tokens["1"] == tokens["0"]


class FakeLibc:
    def __init__(self, accept: bool | set[int] = True):
        self.calls: list[tuple[int, int]] = []
        self.accept = accept

    def mallopt(self, param, value):
        self.calls.append((param, getattr(value, "value", value)))
        ok = param in self.accept if isinstance(self.accept, set) else self.accept
        return 1 if ok else 0


@pytest.mark.parametrize("env, libc, mode", [(None, "glibc", "glibc-heap"), ("heap", "glibc", "glibc-heap"),
                                             ("system", "glibc", "system"), (None, None, "system"),
                                             (None, "refuses", "system")])
def test_tune_allocator_follows_the_platform_and_the_override(monkeypatch, env, libc, mode):
    fake = FakeLibc(accept=libc != "refuses")
    monkeypatch.setattr(hardware, "_glibc", lambda: None if libc is None else fake)
    monkeypatch.setattr(hardware, "_allocator", {"mode": "system", "reason": "not tuned"})
    if env is None:
        monkeypatch.delenv(hardware.MALLOC_ENV, raising=False)
    else:
        monkeypatch.setenv(hardware.MALLOC_ENV, env)
    got = hardware.tune_allocator()
    assert got["mode"] == mode and hardware.environment()["allocator"] == got
    if mode == "glibc-heap":  # no mmap-served chunks, no trimming, a 64 MiB top pad
        assert dict(fake.calls) == {-4: 0, -1: 2**31 - 1, -2: 64 << 20}
    elif env == "system" or libc is None:
        assert fake.calls == []
    monkeypatch.setenv(hardware.MALLOC_ENV, "mmap")
    monkeypatch.setattr(hardware, "_allocator", {"mode": "system", "reason": "not tuned"})
    with pytest.raises(SkipKVError, match="SKIPKV_MALLOC must be heap or system"):
        hardware.tune_allocator()


def test_a_partly_refused_tuning_is_recorded_as_it_is(monkeypatch):
    monkeypatch.setattr(hardware, "_glibc", lambda: FakeLibc(accept={-4}))  # only M_MMAP_MAX
    monkeypatch.setattr(hardware, "_allocator", {"mode": "system", "reason": "not tuned"})
    monkeypatch.delenv(hardware.MALLOC_ENV, raising=False)
    got = hardware.tune_allocator()
    assert got["mode"] == "glibc-partial" and "M_MMAP_MAX=0" in got["reason"] and "TRIM" not in got["reason"]


FAULTS = """
import resource, sys, torch
from skipkv.models import load_model
from skipkv.hardware import environment
load_model("random:qwen2")  # tunes the allocator unless SKIPKV_MALLOC=system
def faults_of(fn):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
def cycles():  # what a decode loop does: the same large blocks allocated, used and freed again and again
    for _ in range(4):
        x = torch.ones(64 << 18)  # 64 MiB
        del x
mode = environment()["allocator"]["mode"]  # first: the record's own allocations must not land between the cycles
cycles()  # the heap grows to what the cycle needs (where a freed block sits decides whether the next one fits it)
print(mode, faults_of(cycles))
"""


def _thp_always() -> bool:
    try:
        return "[always]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False


@pytest.mark.skipif(hardware._glibc() is None, reason="the tuning is glibc's")
@pytest.mark.skipif(_thp_always(), reason="transparent huge pages on for every mapping: few faults either way")
def test_a_freed_large_block_is_reused_without_page_faults():
    """What the tuning is for: 64 MiB tensors allocated again after a free touch memory the process already has.
    With glibc's defaults each is a fresh mmap, every 4 KiB page faulted in again (16,384 faults per tensor)."""
    import os
    import subprocess
    import sys

    def run(mode):
        env = {**os.environ, hardware.MALLOC_ENV: mode}
        out = subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True, check=True)
        name, faults = out.stdout.split()
        return name, int(faults)

    tuned, system = run("heap"), run("system")
    assert tuned[0] == "glibc-heap" and system[0] == "system"
    assert system[1] > 4 * 8000, system
    assert tuned[1] < system[1] / 10, (tuned, system)


@pytest.mark.parametrize("env, check", [
    (hardware.OVERRIDE_ENV, lambda: hardware.native_bf16()),
    (kernels.SDPA_ENV, lambda: kernels.decode_sdpa("cpu")),
    (kernels.BUCKET_ENV, lambda: kernels.pv_buckets(torch.bfloat16)),
    (kernels.PACK_ENV, lambda: kernels.packed_linears(torch.bfloat16)),
    (kernels.UPCAST_ENV, lambda: kernels.upcast_linears(torch.bfloat16)),
    (kernels.TRANSPOSE_ENV, lambda: kernels.transposed_linears(torch.float32)),
])
def test_every_on_off_override_rejects_other_values(monkeypatch, env, check):
    """Each 0/1 switch names itself in a one-line error for any other value, and takes 0 and 1."""
    monkeypatch.setenv(env, "on")
    with pytest.raises(SkipKVError, match=f"^{env} must be 0 or 1, got 'on'$"):
        check()
    for value in ("0", "1"):
        monkeypatch.setenv(env, value)
        ok, why = check()
        assert isinstance(ok, bool) and why


def test_decode_attention_by_dtype(monkeypatch):
    """One decision for both of attention.py's paths: fp64 SDPA, fp32 grouped, 16-bit as decode_sdpa."""
    kernels._decode_attention.cache_clear()
    try:
        for forced, kind in (("1", "sdpa"), ("0", "grouped")):
            monkeypatch.setenv(kernels.SDPA_ENV, forced)
            assert kernels.decode_attention(torch.float64)[0] == "sdpa"
            assert kernels.decode_attention(torch.float32)[0] == "grouped"
            assert kernels.decode_attention(torch.bfloat16)[0] == kind
    finally:
        kernels._decode_attention.cache_clear()
