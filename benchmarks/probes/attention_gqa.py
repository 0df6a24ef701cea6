"""Micro-benchmark: one decode step's attention over 24 layers, torch SDPA (enable_gqa + mask) vs grouped matmul.

    python benchmarks/probes/attention_gqa.py

Qwen2.5-0.5B attention shape (2 kv heads x 7 query heads each, head dim 64), bf16, batch 1, one query.
This is why `skipkv.attention` runs masked forwards as a grouped matmul instead of SDPA; it computes it in
fp32 (grouped fp32), which keeps bf16 outputs token-for-token equal to transformers' own attention.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

B, H, G, D, LAYERS, REPS = 1, 2, 7, 64, 24, 200


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    s = torch.matmul(q.reshape(B, H, G, D), k.transpose(-1, -2)) * D**-0.5  # [B, H, G, K]
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), -1).to(v.dtype), v).view(B, H * G, 1, D)


def grouped_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    s = torch.matmul(q.reshape(B, H, G, D).float(), k.float().transpose(-1, -2)) * D**-0.5
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v.float()).view(B, H * G, 1, D).to(v.dtype)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.manual_seed(0)
    for K in (256, 1024, 4096):
        q = torch.randn(B, H * G, 1, D, dtype=torch.bfloat16)
        k = torch.randn(B, H, K, D, dtype=torch.bfloat16)
        v = torch.randn(B, H, K, D, dtype=torch.bfloat16)
        mask = torch.ones(B, 1, 1, K, dtype=torch.bool)
        row = []
        for f in (sdpa, grouped, grouped_fp32):
            for _ in range(5):
                f(q, k, v, mask)
            t0 = time.perf_counter()
            for _ in range(REPS):
                f(q, k, v, mask)
            row.append(1e3 * LAYERS * (time.perf_counter() - t0) / REPS)
        err = (sdpa(q, k, v, mask).float() - grouped(q, k, v, mask).float()).abs().max().item()
        print(f"K={K:5d}  sdpa {row[0]:6.2f} ms  grouped {row[1]:6.2f} ms  grouped fp32 {row[2]:6.2f} ms"
              f"  per {LAYERS} layers  (max |diff| {err:.4f})")


if __name__ == "__main__":
    main()
