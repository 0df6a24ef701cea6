"""Kernel choices that follow the processor: decode attention, the p.V product and its key buckets, the linears'
weight layout, and how a decode step runs. Each is a function returning (choice, reason), cached where it is called
per layer, overridden by one environment variable, and recorded in every run's environment
(`hardware.kernel_record`); a loaded model's choices are resolved from them once, into its frozen plan (plan.py).

    python -m skipkv.hardware            # the machine, `--dtype auto`'s pick and every choice below, with reasons

Decode attention (`decode_sdpa`): where every key is visible to every query of a 16-bit decode step, torch's fused
SDPA is the call transformers itself makes, and on a CPU with AMX it is also the faster one (Sapphire Rapids, one
thread: 36 vs 83 us at 128 keys, 633 vs 936 us at 4K). On a CPU without AMX it is the slower one by far (2-core EPYC
with AVX512-BF16, bf16, 2 threads, per layer: 0.159 vs 0.081 ms at batch 1 and 128 keys, 4.78 vs 0.49 ms at 4K
keys, 2.20 vs 0.24 ms at batch 16), so there the engine's grouped fp32 attention runs instead. The two round
differently, so the choice is recorded (`SKIPKV_DECODE_SDPA=1|0` overrides it).

SDPA on CUDA (`cuda_sdpa_backends`): torch 2.11 on an H200 picks cuDNN's attention, which builds a cuDNN graph for
every new shape; a decode step's key count grows by one per step, so every layer of every step rebuilt one: 2.4 ms
of host time per call, 67 ms of a 97 ms decode step of a 7B model at batch 1, whose kernels kept the GPU busy for
6 ms (benchmarks/gpu_profile.py; transformers' own generate pays the same). The engine's forwards therefore run
with cuDNN excluded (flash, then memory-efficient, then math); `SKIPKV_CUDNN_SDPA=1` gives torch its own choice.

Probabilities x V in the grouped path (`decode_pv`): q.k and the softmax run in fp32 (the logits of a bf16 q.k would be
rounded to bf16); the probabilities are then rounded to the model's 16-bit dtype and multiplied with the 16-bit values
directly, as torch's fused CPU kernel does (its p.V gemm takes the probabilities in the input dtype). That skips
converting every cached value to fp32 in every layer and step. On a 2-core EPYC with AVX512-BF16, at batch 64 and 288
keys (R-KV 256 under a 1 GiB cap), the product alone took 0.25 instead of 0.56 ms per layer on random contiguous tensors
(benchmarks/probes/attention_batch64_probe.py); whole decode steps gained little (A/B step times,
benchmarks/probes/decode_pv_ab.py: 1.040x, 0.944x, 0.977x in three runs, within the machine's noise). The default
follows the fused kernel's numerics as much as its speed. fp32 and fp64 models are unaffected. `SKIPKV_DECODE_PV=fp32`
keeps the older all-fp32 product (runs begun with it resume only with it: eval/rundir.py compares the kernel of 16-bit
runs).

Key buckets for the 16-bit p.V (`pv_buckets`): oneDNN creates a primitive for every new shape of a 16-bit matmul and
caches it by shape. A decode step's p.V has a new key count at every step (the cache grows by one entry), and in every
layer where layers keep different counts (LaProx, PyramidKV, head-split stores). On a 2-core EPYC a new shape cost ~1 ms
at batch 1 and ~28 ms at batch 64, against 0.1 and 1 ms for a cached one (`python benchmarks/probes/bmm_shapes.py`). The
product therefore runs over key_bucket(K) keys of the store, zero probabilities past K: the padding adds exact zeros to
every sum, and a probe at first use checks that this machine's matmul gives the same bits with it on ~80 decode-step
shapes; where it does not, the padding is off. On the EPYC bf16 gave the same bits on all 1,163 shapes of
`python benchmarks/probes/pv_padding_bits.py`, fp16 not on 130 of them (a probe of 8 shapes had missed it), so the
padding is for bf16 only (what `auto` picks), whatever a probe says. Decode step on a 2,048-token prompt, fresh
processes, two rounds each: LaProx (10%) at batch 1 112.4 -> 76.4 ms (0.68x), full cache at batch 1 83.5 -> 72.1 ms
(0.86x), full cache at batch 16 0.98x (`python benchmarks/probes/pv_buckets_ab.py`). `SKIPKV_DECODE_PV_BUCKETS=0|1`
overrides the probe.

Linear weights (`packed_linears`): on a CPU in bf16, where oneDNN supports bf16, the model's linears multiply with
weights packed once (models/packed.py) instead of re-laid out at every call: bit-identical outputs, faster
(figures in models/packed.py). An fp32 model is packed too on an x86 CPU with AVX2 and without AVX512 when torch
runs at least two threads: there oneDNN's fp32 kernel on packed weights beat MKL's sgemm on the transposed layout at
every batch measured (2-core AMD EPYC, two threads: prefill 1.27x, decode 1.07x at batch 1, 2.07x at 16, 1.48x at
48; docs/benchmarks.md), and it is the kernel vLLM's CPU engine runs its fp32 linears on. With one thread it lost
at batch 1 (0.68x), so a one-thread run keeps the transposed layout. Its products agree with MKL's to fp32 rounding,
not bit for bit. An explicit `SKIPKV_TRANSPOSED_LINEARS=1` keeps the transposed layout (the test suite pins it so);
`SKIPKV_PACKED_LINEARS=1|0` overrides both (`=1` packs fp32 on any CPU with oneDNN).

Linear weights where the CPU has no bf16 matmul (`upcast_linears`): a bf16 model there (`--dtype bf16` on purpose,
e.g. a pinned grid resumed on such a processor; `auto` picks fp32) would have torch emulate every bf16 product. The
linears instead multiply in fp32 with weights upcast once (models/packed.py, UpcastLinear): each product of two
bf16 numbers is exact in fp32, sums run in fp32 and the output is rounded to bf16 once, which is what a native bf16
kernel computes too (fp32 accumulation; only the order of the sums differs, as between any two processors'
kernels). Activations, the KV cache and its bytes stay bf16; the weights take twice the memory. Measured on a
2-core EPYC without AVX512 (AVX2 only) by `benchmarks/probes/upcast_ab.py` (docs/benchmarks.md): prefill 4.64x, decode
1.17x at batch 1 and 1.99x at batch 8, greedy tokens identical. `SKIPKV_UPCAST_LINEARS=1|0` overrides.

Linear weights of an fp32 model (`transposed_linears`): on an x86 CPU with AVX2 and without AVX512 (where `auto`
picks fp32), every linear stores its weight once, transposed to (in, out), and multiplies `x @ W^T` (models/packed.py,
TransposedLinear): MKL's sgemm is faster on that layout. A 2-core AMD EPYC without AVX512, Qwen2.5-Coder-0.5B, one
thread, each variant in a process of its own, 4 rounds alternating (`benchmarks/probes/upcast_ab.py --variants
fp32,fp32-transposed --fresh`, docs/benchmarks.md): prefill 1.06x, decode 1.17x at batch 1, 1.28x at 4, 1.14x at
16, 1.12x at 48, faster in every round, greedy tokens identical. From 4 rows on the bits are those of `F.linear`;
with 1-3 rows MKL sums in another order, as it does with either layout between 3 rows and 4
(benchmarks/probes/layout_bits.py). Not measured on a CPU with AVX512, so off there. `SKIPKV_TRANSPOSED_LINEARS=1|0`
overrides.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from skipkv.errors import SkipKVError

_PROC_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2")


def _torch_check(name: str) -> bool | None:
    """One of torch's CPU capability checks (`torch.cpu._is_avx512_bf16_supported`, ...); None if this torch
    lacks it."""
    fn = getattr(torch.cpu, name, None)
    if fn is None:
        return None
    try:
        return bool(fn())
    except Exception:  # a private check that fails to run is the same as one that does not exist
        return None


def cpu_flags() -> set[str]:
    """The subset of /proc/cpuinfo flags that decide defaults (empty where /proc/cpuinfo does not exist)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split()) & set(_PROC_FLAGS)
    return set()


def _switch(name: str, value: str | None) -> str | None:
    """An on/off override's value, "0" or "1", or None when it is unset; anything else is a one-line error."""
    if value is not None and value not in ("0", "1"):
        raise SkipKVError(f"{name} must be 0 or 1, got {value!r}")
    return value


SDPA_ENV = "SKIPKV_DECODE_SDPA"
PACK_ENV = "SKIPKV_PACKED_LINEARS"
UPCAST_ENV = "SKIPKV_UPCAST_LINEARS"
TRANSPOSE_ENV = "SKIPKV_TRANSPOSED_LINEARS"
PV_ENV = "SKIPKV_DECODE_PV"
BUCKET_ENV = "SKIPKV_DECODE_PV_BUCKETS"
CUDNN_SDPA_ENV = "SKIPKV_CUDNN_SDPA"
STEP_ENV = "SKIPKV_DECODE_STEP"


def has_amx() -> tuple[bool, str]:
    """Whether this CPU has AMX tiles, and the evidence (torch's check first, /proc/cpuinfo otherwise)."""
    amx = _torch_check("_is_amx_tile_supported")
    if amx is not None:
        return amx, f"torch reports {'' if amx else 'no '}AMX"
    ok = "amx_tile" in cpu_flags()
    return ok, f"/proc/cpuinfo {'lists' if ok else 'does not list'} amx_tile"


@functools.lru_cache(maxsize=8)
def _decode_sdpa(device_type: str, forced: str | None) -> tuple[bool, str]:
    if _switch(SDPA_ENV, forced) is not None:
        return forced == "1", f"{SDPA_ENV}={forced} (overridden)"
    if device_type != "cpu":
        return True, f"{device_type} device"
    ok, why = has_amx()
    return ok, f"CPU {'with' if ok else 'without'} AMX ({why}): {'fused SDPA' if ok else 'grouped fp32'} is faster"


@functools.lru_cache(maxsize=4)
def _cuda_sdpa_backends(forced: str | None) -> tuple[tuple, str]:
    from torch.nn.attention import SDPBackend

    if _switch(CUDNN_SDPA_ENV, forced) == "1":
        return (), f"{CUDNN_SDPA_ENV}=1: torch's own choice, cuDNN included"
    return ((SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
            "cuDNN excluded: it builds a new graph for every new key count (~2.4 ms of host time per call on an H200, "
            "67 of a 97 ms 7B decode step)")


def cuda_sdpa_backends() -> tuple[tuple, str]:
    """The SDPA backends the engine's forwards may use on CUDA (() = torch's own choice), and why (module
    docstring). Cached: read once per forward."""
    return _cuda_sdpa_backends(os.environ.get(CUDNN_SDPA_ENV))


def decode_sdpa(device: torch.device | str = "cpu") -> tuple[bool, str]:
    """Whether a 16-bit decode step whose queries see every key runs torch's fused SDPA (True) or the engine's
    grouped fp32 attention (False) on this machine, and why (module docstring). Cached: called per layer."""
    return _decode_sdpa(torch.device(device).type, os.environ.get(SDPA_ENV))


@functools.lru_cache(maxsize=8)
def _decode_pv(forced: str | None) -> tuple[str, str]:
    if forced is None:
        return "model", "probabilities rounded to the model's dtype for p.V, as torch's fused CPU kernel does"
    if forced not in ("fp32", "model"):
        raise SkipKVError(f"{PV_ENV} must be fp32 or model, got {forced!r}")
    return forced, f"{PV_ENV}={forced} (overridden)"


def decode_pv() -> tuple[str, str]:
    """The dtype of the grouped attention's probabilities x V product for a 16-bit model: "model" (the default:
    probabilities rounded to the model's dtype) or "fp32" (values converted to fp32), and why (module docstring).
    Cached: called per layer."""
    return _decode_pv(os.environ.get(PV_ENV))


@functools.lru_cache(maxsize=16)
def _decode_attention(dtype: torch.dtype, device_type: str, forced: str | None) -> tuple[str, str]:
    if dtype == torch.float64:
        return "sdpa", "fp64: torch's fused SDPA, the exactness tests' reference"
    if dtype == torch.float32:
        return "grouped", "fp32: the grouped matmuls, faster from ~1K keys on (613 vs 1,424 us at 4K)"
    sdpa, why = _decode_sdpa(device_type, forced)
    return ("sdpa" if sdpa else "grouped"), why


def decode_attention(dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[str, str]:
    """What a forward in `dtype` on `device` runs where every key is visible to each of its queries: "sdpa"
    (torch's fused SDPA) or "grouped" (attention.py's grouped matmuls), and why: fp64 SDPA, fp32 grouped, a 16-bit
    dtype as `decode_sdpa` says. Cached: called per layer."""
    return _decode_attention(dtype, torch.device(device).type, os.environ.get(SDPA_ENV))


def decode_step(dtype: torch.dtype, device: torch.device | str = "cpu", packed: bool | None = None) -> tuple[str, str]:
    """How decode steps over a uniform store run (engine/step.py): "compiled" (the fixed-shape step through
    torch.compile), "eager" (the fixed-shape step, uncompiled) or "hf" (the HF modules with the skipkv attention
    backend), and why. `packed`: whether the model's linears are oneDNN-packed (default: `packed_linears`, what
    load_model applies here). `SKIPKV_DECODE_STEP=compiled|eager|hf|graph` overrides ("graph": engine/graphs.py,
    the fixed step replayed, CUDA graphs on CUDA; never chosen by default until measured on a GPU).
    `EngineConfig.enforce_eager` is applied by the plan (plan.KernelPlan.eager)."""
    forced = os.environ.get(STEP_ENV)
    if forced is not None:
        if forced not in ("compiled", "eager", "hf", "graph"):
            raise SkipKVError(f"{STEP_ENV} must be compiled, eager, graph or hf, got {forced!r}")
        return forced, f"{STEP_ENV}={forced} (overridden)"
    device = torch.device(device)
    if device.type != "cpu" or dtype == torch.float64 or decode_sdpa(device)[0]:
        # There the HF step calls torch's fused SDPA where every key is visible; the fixed step's grouped product
        # would round otherwise (and fp64 is the exactness tests' reference).
        return "hf", "the HF modules' step: fused SDPA decode attention here, or fp64"
    # On a CPU whose decode attention is the grouped one, the fixed-shape step runs the same products and gives the
    # same bits (tests/test_fixed_step.py; bf16 checked too), 3-6% faster at batch 1 and 16 (docs/benchmarks.md).
    # Compiled (torch.compile, one graph per decoder layer) it removes most small ops and Python around the linears:
    # on an AVX2-only EPYC (Zen 3), fp32 on packed linears, 16 x 128 went from 44.8 to 47.3 tokens/s and 1 x 96 from
    # 7.9 to 9.1 (medians of 3 and 4 alternating pairs, docs/benchmarks.md), after ~22 s of compiling per process
    # (both batch graphs; vLLM compiles at start-up too). Elsewhere it gained at most the noise: eager there.
    # `EngineConfig.enforce_eager` (`--enforce-eager`) keeps the eager step, as vLLM's flag of that name.
    if packed is None:
        packed = packed_linears(dtype, device)[0]
    if dtype == torch.float32 and packed:
        if cxx_compiler() is None:
            return "eager", "fp32 on packed linears, but no C++ compiler for torch.compile (g++, or $CXX)"
        return "compiled", ("fp32 on packed linears (AVX2-only x86): the compiled fixed-shape step, measured faster "
                            "(--enforce-eager keeps it eager)")
    return "eager", "CPU with grouped decode attention: the fixed-shape step, the same bits, faster"


def cxx_compiler() -> str | None:
    """The C++ compiler torch.compile's CPU code generation would call ($CXX, else g++), if it is installed."""
    return shutil.which(os.environ.get("CXX") or "g++")


def key_bucket(keys: int) -> int:
    """`keys` rounded up to its bucket: a multiple of 64 up to 1,024 keys, then of 1/16 of the power of two at or
    above it (at most 1/8 more keys), so that a cache growing by one entry per step, or layers and heads that keep
    different counts, reuse a few product shapes instead of making a new one at every call (`pv_buckets`)."""
    step = max(64, 1 << max(0, (keys - 1).bit_length() - 4))
    return -(-keys // step) * step


# (batch x kv heads, query rows per kv head, keys): decode-step shapes, ~80 of them (~0.2 s once per process)
_PROBE_SHAPES = tuple((2, 7, k) for k in range(1, 1200, 17)) + (
    (2, 7, 1500), (2, 7, 2100), (2, 7, 3000), (2, 7, 4500), (2, 56, 999), (64, 7, 257), (64, 7, 300), (16, 1, 700))


def _padding_is_exact(dtype: torch.dtype) -> bool:
    """Whether a `dtype` batched matmul of probabilities x values gives the same bits when the keys are padded to
    key_bucket with zero probabilities, on ~80 CPU shapes of the decode step's kind (0.1-0.3 s, once per process)."""
    gen = torch.Generator().manual_seed(0)
    for bh, m, k in _PROBE_SHAPES:
        padded = key_bucket(k)
        values = torch.randn(bh, padded, 64, generator=gen).to(dtype)
        probs = torch.softmax(torch.randn(bh, m, k, generator=gen) * 3, dim=-1).to(dtype)
        wide = probs.new_zeros(bh, m, padded)
        wide[..., :k] = probs
        if not torch.equal(torch.bmm(probs, values[:, :k]), torch.bmm(wide, values)):
            return False
    return True


@functools.lru_cache(maxsize=8)
def _pv_buckets(dtype: torch.dtype, forced: str | None) -> tuple[bool, str]:
    if _switch(BUCKET_ENV, forced) is not None:
        return forced == "1", f"{BUCKET_ENV}={forced} (overridden)"
    if dtype != torch.bfloat16:
        return False, f"{str(dtype).removeprefix('torch.')}: key buckets are used for bf16 only"
    if _padding_is_exact(dtype):
        return True, "padded keys gave identical bits in a probe of this machine's matmul"
    return False, "padded keys changed the bits in a probe of this machine's matmul"


def pv_buckets(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the grouped attention's 16-bit p.V on a CPU runs over key_bucket(K) keys (zero probabilities past K)
    instead of K, and why (module docstring): on by a probe that the padding leaves the bits unchanged on this
    machine. Never on another device (attention._probs_times_values). Cached: called per layer."""
    return _pv_buckets(dtype, os.environ.get(BUCKET_ENV))


def attention_kernel(record: dict[str, Any] | None) -> tuple[str, str]:
    """(kernel, p.V dtype) from an environment record's `decode_attention_cpu`; records written before `pv` existed
    ran p.V in fp32 ("grouped_fp32")."""
    record = record or {}
    kernel = record.get("kernel", "<absent>")
    return ("grouped" if kernel == "grouped_fp32" else kernel), record.get("pv", "fp32")


def linear_kernel(environment: dict[str, Any] | None) -> str | None:
    """What a bf16 CPU model's linears ran on, from an environment record (environment()): "packed" (oneDNN's
    bf16 kernel on prepacked weights), "upcast" (fp32 products of upcast weights) or "torch" (torch's own bf16
    linear); None for a record written before the upcast path existed (not comparable)."""
    environment = environment or {}
    packed, upcast = environment.get("packed_linears_cpu_bf16"), environment.get("upcast_linears_cpu_bf16")
    if packed is None or upcast is None:
        return None
    return "packed" if packed.get("packed") else "upcast" if upcast.get("upcast") else "torch"


def packed_linears(dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[bool, str]:
    """Whether a model in `dtype` on `device` runs its linears with oneDNN-prepacked weights, and why."""
    forced = _switch(PACK_ENV, os.environ.get(PACK_ENV))
    if forced is not None:
        if forced == "0" or torch.device(device).type != "cpu":
            return False, f"{PACK_ENV}={forced} (overridden)" + ("" if forced == "0" else ", but not on a CPU")
    if torch.device(device).type != "cpu":
        return False, f"{torch.device(device).type} device"
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        if forced == "1":
            return True, f"CPU, fp32, oneDNN ({PACK_ENV}=1)"
        if _switch(TRANSPOSE_ENV, os.environ.get(TRANSPOSE_ENV)) == "1":
            return False, f"fp32: {TRANSPOSE_ENV}=1 keeps the transposed layout"
        flags, threads = cpu_flags(), torch.get_num_threads()
        if "avx2" in flags and "avx512f" not in flags and threads >= 2:
            return True, (f"x86 CPU with AVX2, without AVX512, {threads} threads: oneDNN's fp32 product on packed "
                          "weights is faster than MKL's (module docstring)")
        isa = "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
        return False, (f"fp32: packed only on AVX2-only x86 CPUs with two or more threads (here {isa}, "
                       f"{threads} thread{'s' * (threads != 1)})")
    if dtype != torch.bfloat16:
        return False, f"{str(dtype).removeprefix('torch.')}: packing is used for bf16 only"
    ok = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if not ok:
        return False, "oneDNN without bf16 support on this CPU"
    return True, "CPU, bf16, oneDNN with bf16" + (f" ({PACK_ENV}=1)" if forced else "")


def upcast_linears(dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[bool, str]:
    """Whether a model in `dtype` on `device` runs its linears in fp32 on weights upcast once (models/packed.py,
    UpcastLinear), and why: bf16 on a CPU whose oneDNN has no bf16 matmul, where torch would emulate it."""
    forced = _switch(UPCAST_ENV, os.environ.get(UPCAST_ENV))
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        kind = f"{torch.device(device).type}, {str(dtype).removeprefix('torch.')}"
        return False, f"{kind}: upcasting is for bf16 on a CPU"
    if forced is not None:
        return forced == "1", f"{UPCAST_ENV}={forced} (overridden)"
    if packed_linears(dtype, device)[0]:
        return False, "oneDNN multiplies bf16 on this CPU (prepacked instead)"
    if torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False, "oneDNN multiplies bf16 on this CPU"
    return True, "CPU without a bf16 matmul in oneDNN: fp32 products of the upcast weights, rounded to bf16"


def transposed_linears(dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[bool, str]:
    """Whether an fp32 model on a CPU stores its linear weights transposed, (in, out), and multiplies `x @ W^T`
    (models/packed.py, TransposedLinear), and why (module docstring): on an x86 CPU with AVX2 and without AVX512,
    where MKL's sgemm was measured faster on that layout; not measured on a CPU with AVX512, so off there."""
    forced = _switch(TRANSPOSE_ENV, os.environ.get(TRANSPOSE_ENV))
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        kind = f"{torch.device(device).type}, {str(dtype).removeprefix('torch.')}"
        return False, f"{kind}: the transposed layout is for fp32 on a CPU"
    if forced is not None:
        return forced == "1", f"{TRANSPOSE_ENV}={forced} (overridden)"
    flags = cpu_flags()
    if "avx2" in flags and "avx512f" not in flags:
        return True, "x86 CPU with AVX2, without AVX512: MKL's sgemm is faster on (in, out) weights"
    return False, ("CPU with AVX512: the transposed layout was measured on AVX2-only CPUs only" if "avx512f" in flags
                   else "not an AVX2 CPU: the transposed layout was measured on AVX2-only x86 CPUs only")
