"""Decode attention pieces at batch 64, 2 kv heads x 7 query heads, 288 cached keys, bf16 storage (R-KV budget 256
under the 1 GiB cap, docs/benchmarks.md): the fp32 conversions and matmuls of the engine's grouped path for a CPU
without AMX, against the same products in bf16. Random tensors; ms per layer, 2 threads.

    python benchmarks/probes/attention_batch64_probe.py
"""

from __future__ import annotations

import argparse
import time

import torch

B, H, G, D, K = 64, 2, 7, 64, 288


def timed(name: str, fn, n: int = 50) -> None:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    print(f"{name:34s} {(time.perf_counter() - t0) / n * 1e3:.3f} ms")


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    q = torch.randn(B, H, G, D, dtype=torch.bfloat16)
    k = torch.randn(B, H, K, D, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qf, kf, vf = q.float(), k.float(), v.float()
    p = torch.softmax(torch.matmul(qf, kf.transpose(-1, -2)), -1)

    def grouped_fp32():  # attention.py's grouped path: everything in fp32
        logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * D**-0.5
        return torch.matmul(torch.softmax(logits, -1), v.float()).to(v.dtype)

    def pv_bf16():  # q.k in fp32, probabilities x V in bf16 (as torch's CPU flash kernel does)
        logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * D**-0.5
        return torch.matmul(torch.softmax(logits, -1).to(v.dtype), v)

    def all_bf16():
        logits = torch.matmul(q, k.transpose(-1, -2)).float() * D**-0.5
        return torch.matmul(torch.softmax(logits, -1).to(v.dtype), v)

    timed("K to fp32", lambda: k.float())
    timed("q.k fp32 matmul", lambda: torch.matmul(qf, kf.transpose(-1, -2)))
    timed("softmax", lambda: torch.softmax(p, -1))
    timed("p.V fp32 matmul", lambda: torch.matmul(p, vf))
    timed("q.k bf16 matmul", lambda: torch.matmul(q, k.transpose(-1, -2)))
    timed("p.V bf16 matmul", lambda: torch.matmul(p.to(v.dtype), v))
    timed("whole: grouped fp32 path", grouped_fp32)
    timed("whole: p.V in bf16", pv_bf16)
    timed("whole: bf16 matmuls", all_bf16)


if __name__ == "__main__":
    main()
