"""How fast this machine streams weights: memory bandwidth, and the bf16 linears of the 0.5B model's shapes at 1 and
16 rows (oneDNN-prepacked as the engine runs them, and plain `F.linear`), in GB/s of weight read.

    python benchmarks/probes/linear_bandwidth.py --out docs/results/vllm_anchor/linear_bandwidth_epyc_zen5.json

Random weights of each shape, called back to back: a weight that fits in the caches (the MLP's 8.7 MB) is read
from them after the first call, so its rate is the kernel's, not DRAM's; the LM head (272 MB) and the 256 MB sum
stream from memory. A decode step reads every weight once (~988 MB for Qwen2.5-0.5B in bf16), so at batch 1
its floor is the model's bytes over the streaming rate.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from skipkv import hardware
from skipkv.models.packed import PackedLinear
from skipkv.outputs import write_atomic

SHAPES = {"mlp_gate_up": (4864, 896), "mlp_down": (896, 4864), "lm_head": (151936, 896)}


def bench(f, n: int) -> float:
    for _ in range(5):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    threads = hardware.set_threads(args.threads)
    rows: list[dict] = []
    a = torch.ones(256 << 18)  # 256 MiB of fp32
    dt = bench(lambda: a.sum(), 10)
    rows.append({"case": "sum of 256 MiB (streaming read)", "ms": dt * 1e3, "gb_per_s": (256 << 20) / dt / 1e9})
    for name, (out_f, in_f) in SHAPES.items():
        lin = torch.nn.Linear(in_f, out_f, bias=False).to(torch.bfloat16)
        packed = PackedLinear(lin, keep_dense=False)
        for m in (1, 16):
            x = torch.randn(m, in_f).to(torch.bfloat16)
            calls = (("packed", lambda p=packed, x=x: p(x)), ("F.linear", lambda w=lin.weight, x=x: F.linear(x, w)))
            for kind, f in calls:
                dt = bench(f, 30)
                rows.append({"case": f"{name} {out_f}x{in_f} {kind} M={m}", "ms": dt * 1e3,
                             "gb_per_s": out_f * in_f * 2 / dt / 1e9})
    for r in rows:
        print(f"{r['case']:<45} {r['ms']:8.3f} ms {r['gb_per_s']:7.1f} GB/s")
    write_atomic(Path(args.out), json.dumps({"threads": threads, "rows": rows,
                                             "environment": hardware.environment()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
