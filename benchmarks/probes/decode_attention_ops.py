"""Where a batched decode step's attention core goes: one layer's store append + grouped attention
(`skipkv.attention.skipkv_attention`, the path a CPU without AMX takes) at batch B over ~K cached keys, rows of
different lengths (a mask), bf16, Qwen2.5-0.5B's shape (2 kv heads x 7 query heads, head dim 64), and its two
batched matmuls alone.

    python benchmarks/probes/decode_attention_ops.py --batch 16 --keys 150 --threads 1 \
        --out docs/results/vllm_anchor/decode_attention_ops_epyc_zen5.json
    python benchmarks/probes/decode_attention_ops.py --sdpa-check --threads 2 --out FILE.json

--sdpa-check instead times one layer's attention (no append) with every key visible to every row (batch 1, or rows
of equal length: where kernels.decode_sdpa chooses between torch's fused SDPA and the grouped matmul) at batch 1
and 16 over 128 to 4K keys, both ways through `skipkv_attention` (SKIPKV_DECODE_SDPA=1 / 0): whether this
processor's default (SDPA only with AMX) holds.

Prints microseconds per call (median of 5 repeats of 1,000 calls). The matmuls are tiny (2.2M multiply-adds for
q.k at batch 16 and 150 keys), so their time is the batched small-gemm's own cost, which a fused decode kernel
would not pay.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from skipkv import hardware, kernels
from skipkv.attention import StepContext, skipkv_attention
from skipkv.cache.store import KVStore
from skipkv.outputs import write_atomic

H, G, D = 2, 7, 64


class _Layer:
    layer_idx = 0


def per_call_us(f, calls: int = 1000, repeats: int = 5) -> float:
    for _ in range(100):
        f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def sdpa_check() -> dict[str, dict[str, float]]:
    """Per (batch, keys): microseconds per call of the engine's attention with SDPA forced on and off."""
    out: dict[str, dict[str, float]] = {}
    for B, K in ((1, 128), (1, 1024), (1, 4096), (16, 128), (16, 1024)):
        store = KVStore(1, B, H, D, K + 8, torch.bfloat16, torch.device("cpu"))
        store.lengths[0] = K - 1
        keys, values = store.k[0][:, :, :K], store.v[0][:, :, :K]
        keys.copy_(torch.randn(B, H, K, D))
        values.copy_(torch.randn(B, H, K, D))
        q = torch.randn(B, H * G, 1, D).to(torch.bfloat16)
        positions = torch.full((B, 1), K - 1)

        def call(q=q, keys=keys, values=values, store=store, positions=positions, B=B) -> None:
            ctx = StepContext(store, 0, torch.ones(B, dtype=torch.long), positions)
            skipkv_attention(_Layer(), q, keys, values, None, scaling=D**-0.5, skipkv_ctx=ctx)

        row = {}
        for label, value in (("sdpa", "1"), ("grouped", "0")):
            os.environ[kernels.SDPA_ENV] = value
            row[label] = per_call_us(call, calls=200)
        out[f"batch {B}, {K} keys"] = row
        print(f"batch {B:>2}, {K:>4} keys: fused SDPA {row['sdpa']:8.1f} us, grouped {row['grouped']:8.1f} us")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--keys", type=int, default=150)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sdpa-check", action="store_true", help="SDPA vs grouped where every key is visible")
    p.add_argument("--out")
    args = p.parse_args(argv)
    threads = hardware.set_threads(args.threads)
    if args.sdpa_check:
        default = kernels.decode_sdpa("cpu")
        rows_sdpa = sdpa_check()
        if args.out:
            write_atomic(Path(args.out), json.dumps({"threads": threads, "us_per_call": rows_sdpa,
                                                     "default": {"sdpa": default[0], "reason": default[1]},
                                                     "environment": hardware.environment()}, indent=2) + "\n")
        return 0
    B, K = args.batch, args.keys
    store = KVStore(1, B, H, D, K + B + 8, torch.bfloat16, torch.device("cpu"))
    base = torch.arange(B) + K - B // 2
    q = torch.randn(B, H * G, 1, D).to(torch.bfloat16)
    k = torch.randn(B, H, 1, D).to(torch.bfloat16)
    v = torch.randn(B, H, 1, D).to(torch.bfloat16)
    pos = base[:, None].to(torch.int32)

    def layer() -> None:
        store.lengths[0] = base  # every call sees the same lengths
        ctx = StepContext(store, 0, torch.ones(B, dtype=torch.long), pos)
        keys, values = store.append(0, 0, k, v, pos)
        skipkv_attention(_Layer(), q, keys, values, None, scaling=D**-0.5, skipkv_ctx=ctx)

    kf = torch.randn(B, H, K, D)
    kb, qf = kf.to(torch.bfloat16), torch.randn(B, H, G, D)
    pb = torch.softmax(torch.randn(B, H, G, K), -1).to(torch.bfloat16)
    rows = {
        "store append + grouped attention (one layer)": per_call_us(layer),
        "q.k: fp32 batched matmul [B,H,7,64]x[B,H,64,K]": per_call_us(lambda: torch.matmul(qf, kf.transpose(-1, -2))),
        "keys bf16 -> fp32": per_call_us(lambda: kb.float()),
        "p.V: bf16 batched matmul [B,H,7,K]x[B,H,K,64]": per_call_us(lambda: torch.matmul(pb, kb)),
    }
    for name, us in rows.items():
        print(f"{name:<55} {us:8.1f} us")
    if args.out:
        write_atomic(Path(args.out), json.dumps({"batch": B, "keys": K, "threads": threads, "us_per_call": rows,
                                                 "environment": hardware.environment()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
