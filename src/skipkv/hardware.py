"""The processor this runs on, the defaults that follow from it, and the one environment record every JSON carries.

    python -m skipkv.hardware            # prints what this machine reports and what `--dtype auto` picks here

Machines of one kind differ from session to session (AMD or Intel, with or without AVX512-BF16 or AMX), and the
fastest dtype differs with them, so `auto` is decided here, at run time, and every benchmark and eval records the
choice and the reason next to its figures:

- CUDA: bf16.
- CPU with native bf16 matmul (AVX512-BF16 or AMX, as torch's own CPU capability checks report): bf16. Measured on a
  2-core EPYC with AVX512-BF16: full-cache decode at batch 16 ran 2.7x faster in bf16 than fp32 (86.3 vs 31.5 tokens/s,
  2 threads), and bf16 halves the bytes of every KV entry.
- Any other CPU: fp32. Without native bf16 torch emulates it: on a 2-core EPYC without it a 0.5B decode step at batch
  16 took 1,856 ms in bf16 against 580 ms in fp32.

`SKIPKV_CPU_BF16=1|0` overrides the capability check (the test suite pins it to 1 so its dtype does not depend on
the processor CI happens to get); the record says when it was overridden.

Kernel choices (decode attention, p.V, linear layouts, the decode step) follow the processor too: they are in
`skipkv.kernels`.

Threads: torch's own default (one per available core) is what is fastest when the engine runs alone; `--threads N`
changes it, and the record keeps what ran.

Memory allocator (`tune_allocator`, called by `load_model` for a CPU model): glibc serves every allocation above its
mmap threshold (at most 32 MiB) with a fresh mmap and unmaps it on free, so each prefill activation, MLP intermediate
or logits block is page-faulted in and zeroed by the kernel again at every use. On the 2-core VM this was measured
on, the two pre-registered sweep processes had spent 27-31% of their CPU time in the kernel (`utime`/`stime` in
/proc/PID/stat). On Linux with glibc the process now keeps freed memory in its heap for reuse instead (mallopt: no
mmap-served chunks, no heap trimming). 32 prompts of 300 tokens, R-KV, alternating fresh processes, median of two
each: system CPU 9.2 -> 2.0 s, prefill 28.1 -> 25.4 s (1.11x), decode 1.03x, greedy tokens identical
(`python benchmarks/probes/allocator_ab.py --rounds 2`; docs/results/allocator/). The page-fault cost varies with the
host's state, so the gain does too. The cost: the process keeps its peak heap until it exits, as a caching allocator
does (peak RSS 3,272 vs 3,219 MiB in that run). `SKIPKV_MALLOC=system` leaves glibc's defaults; every environment
record says which ran (`allocator`).
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from skipkv import kernels
from skipkv.errors import SkipKVError

OVERRIDE_ENV = "SKIPKV_CPU_BF16"
MALLOC_ENV = "SKIPKV_MALLOC"
DTYPE_HELP = "auto (default: bf16 on CUDA and on CPUs with AVX512-BF16 or AMX, fp32 elsewhere), bf16, fp32, fp16"


@dataclass(frozen=True)
class DtypeChoice:
    """What `--dtype auto` resolved to on this machine, and why."""

    dtype: str  # "bf16" or "fp32"
    reason: str


def native_bf16() -> tuple[bool, str]:
    """Whether this CPU multiplies bf16 natively, and the evidence (torch's checks first, /proc/cpuinfo otherwise)."""
    forced = kernels._switch(OVERRIDE_ENV, os.environ.get(OVERRIDE_ENV))
    if forced is not None:
        return forced == "1", f"{OVERRIDE_ENV}={forced} (overridden)"
    avx512_bf16, amx = kernels._torch_check("_is_avx512_bf16_supported"), kernels._torch_check("_is_amx_tile_supported")
    if avx512_bf16 is not None or amx is not None:
        found = [n for n, ok in (("AVX512-BF16", avx512_bf16), ("AMX", amx)) if ok]
        return bool(found), (f"torch reports {' and '.join(found)}" if found
                             else "torch reports neither AVX512-BF16 nor AMX")
    flags = kernels.cpu_flags()
    found = sorted(flags & {"avx512_bf16", "amx_bf16"})
    return bool(found), (f"/proc/cpuinfo lists {', '.join(found)}" if found
                         else "/proc/cpuinfo lists neither avx512_bf16 nor amx_bf16")


def choose_dtype(device: str | torch.device | None = "cpu") -> DtypeChoice:
    """The throughput dtype for `device` on this machine (see the module docstring for the measurements behind it)."""
    if device is not None and str(device).startswith("cuda"):
        return DtypeChoice("bf16", "CUDA device")
    ok, why = native_bf16()
    if ok:
        return DtypeChoice("bf16", f"CPU with native bf16 matmul ({why})")
    return DtypeChoice("fp32", f"CPU without native bf16 matmul ({why}); torch would emulate bf16")


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_TOP_PAD = 64 << 20  # each heap growth asks the kernel for 64 MiB more than needed: fewer brk calls
_allocator: dict[str, Any] = {"mode": "system", "reason": "not tuned (no CPU model loaded in this process)"}


def _glibc():
    """The C library as a ctypes handle when it is glibc (mallopt is glibc's), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def tune_allocator() -> dict[str, Any]:
    """Keep freed memory in the heap for reuse (module docstring), once per process; returns what is in force, as
    `environment()["allocator"]` records it. `SKIPKV_MALLOC=system` (or a non-glibc platform) leaves malloc alone."""
    global _allocator
    if _allocator["mode"] == "glibc-heap":
        return dict(_allocator)
    forced = os.environ.get(MALLOC_ENV)
    if forced not in (None, "", "heap", "system"):
        raise SkipKVError(f"{MALLOC_ENV} must be heap or system, got {forced!r}")
    if forced == "system":
        _allocator = {"mode": "system", "reason": f"{MALLOC_ENV}=system"}
        return dict(_allocator)
    libc = _glibc()
    if libc is None:
        _allocator = {"mode": "system", "reason": f"not glibc on Linux ({platform.system()}, "
                                                  f"{platform.libc_ver()[0] or 'unknown libc'}): left alone"}
        return dict(_allocator)
    import ctypes

    accepted = {name: libc.mallopt(param, value) == 1
                for name, param, value in (("M_MMAP_MAX=0", _M_MMAP_MAX, 0),
                                           ("M_TRIM_THRESHOLD=2^31-1", _M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1)),
                                           ("M_TOP_PAD=64 MiB", _M_TOP_PAD, _TOP_PAD))}
    if all(accepted.values()):
        _allocator = {"mode": "glibc-heap",
                      "reason": f"glibc: freed memory kept in the heap (mallopt {', '.join(accepted)})"}
    elif not any(accepted.values()):
        _allocator = {"mode": "system", "reason": "glibc refused mallopt: left alone"}
    else:  # what is in force is recorded as it is
        _allocator = {"mode": "glibc-partial", "reason": "glibc accepted only mallopt "
                      + ", ".join(k for k, ok in accepted.items() if ok)}
    return dict(_allocator)


def release_free_memory() -> bool:
    """Give the pages of freed heap blocks back to the kernel (glibc's malloc_trim(0)); True if it ran. The heap
    is otherwise never trimmed here (tune_allocator), which is right for the steady state but not after a model's
    weights are replaced at load (models/packed.py): the old copies are freed between new ones of other shapes,
    and the holes they leave are too fragmented to take the next copies, so without this a 0.5B fp32 model held
    ~1.4 GB more than its weights (measured with mallinfo2 and /proc/self/statm)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def resolve_auto(dtype: str, device: str | torch.device | None = "cpu") -> tuple[str, DtypeChoice | None]:
    """`dtype` itself, or for "auto" this machine's choice; the choice is returned too, to be recorded."""
    if dtype != "auto":
        return dtype, None
    choice = choose_dtype(device)
    return choice.dtype, choice


MAX_THREADS = 1024


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (None or 0 keeps torch's default, one per available core); returns what is set."""
    if threads is not None:
        from skipkv.config import bounded

        bounded(threads, "--threads", 0, MAX_THREADS, "more threads than any machine's cores only oversubscribe it")
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def processor() -> str:
    """The processor's model name (/proc/cpuinfo), or what `platform` knows."""
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What a figure depends on: processor, its bf16 capability, cores, threads, memory, GPU."""
    ok, why = native_bf16()
    info: dict[str, Any] = {
        "host": platform.node(), "platform": platform.platform(), "cpu": processor(),
        "cpu_flags": sorted(kernels.cpu_flags()), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": ok, "native_bf16_evidence": why,
        "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    with contextlib.suppress(ValueError, OSError, AttributeError):
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return info


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for pkg in ("skipkv", "torch", "transformers", "tokenizers", "math-verify", "numpy"):
        try:
            found[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            found[pkg] = None
    if found["skipkv"] is None:  # running from a source tree that is not installed
        from skipkv.version import __version__

        found["skipkv"] = __version__
    found["python"] = platform.python_version()
    return found


def kernel_record() -> dict[str, Any]:
    """The kernel choices (skipkv.kernels) for the environment record every eval and benchmark JSON carries: what a
    CPU run in bf16 (and fp32, for the linears' layout) gets here, and why. A loaded model's own plan, as it runs,
    is plan.py's (recorded as `kernel_plan`)."""
    env: dict[str, Any] = {}
    sdpa, why = kernels.decode_sdpa("cpu")
    pv, pv_why = kernels.decode_pv()
    buckets, buckets_why = kernels.pv_buckets(torch.bfloat16)
    env["decode_attention_cpu"] = {"kernel": "sdpa" if sdpa else "grouped", "reason": why,
                                   "pv": pv, "pv_reason": pv_why,
                                   "pv_key_buckets_bf16": buckets, "pv_key_buckets_reason": buckets_why}
    for key, field, decide, dtype in (
            ("packed_linears_cpu_bf16", "packed", kernels.packed_linears, torch.bfloat16),
            ("upcast_linears_cpu_bf16", "upcast", kernels.upcast_linears, torch.bfloat16),
            ("transposed_linears_cpu_fp32", "transposed", kernels.transposed_linears, torch.float32),
            ("packed_linears_cpu_fp32", "packed", kernels.packed_linears, torch.float32),
            ("decode_step_cpu_bf16", "step", kernels.decode_step, torch.bfloat16),
            ("decode_step_cpu_fp32", "step", kernels.decode_step, torch.float32)):
        value, why = decide(dtype, "cpu")
        env[key] = {field: value, "reason": why}
    if torch.cuda.is_available():
        backends, why = kernels.cuda_sdpa_backends()
        env["sdpa_cuda"] = {"backends": [b.name for b in backends] or "torch's choice", "reason": why}
    return env


def environment(dtype_choice: DtypeChoice | None = None, bundle: Any = None) -> dict[str, Any]:
    """The record every eval and benchmark JSON carries: revision, versions, machine, how the dtype was chosen, the
    kernel choices here, and with `bundle` (a loaded model) the plan its forwards run (plan.py: `kernel_plan`)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    env: dict[str, Any] = {"git_revision": _git("rev-parse", "HEAD"),
                           "git_dirty": bool(status) if status is not None else None,
                           "versions": versions(), "machine": machine(),
                           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if dtype_choice is not None:
        env["dtype_choice"] = asdict(dtype_choice)
    env.update(kernel_record())
    if bundle is not None:
        env["kernel_plan"] = bundle.plan.record()
    env["allocator"] = dict(_allocator)
    return env


if __name__ == "__main__":
    import json

    print(json.dumps({"machine": machine(), "auto_dtype": asdict(choose_dtype("cpu")), **kernel_record()}, indent=2))
