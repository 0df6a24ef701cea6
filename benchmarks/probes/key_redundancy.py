"""R-KV's key redundancy on one layer's keys: the row-blocked `key_redundancy` against the whole [n, n] matrix
at once (the previous implementation, kept here as the baseline), same keys, alternating rounds; median
seconds and the largest difference.

    OMP_NUM_THREADS=1 python benchmarks/probes/key_redundancy.py --n 8192 --heads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from skipkv.scoring import key_redundancy


def whole_matrix(keys: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = k @ k.transpose(-1, -2)
    n = sim.shape[-1]
    sim = sim * (1 - torch.eye(n, dtype=sim.dtype))
    cols = torch.arange(n)
    last_similar = torch.where(sim > threshold, cols, torch.zeros_like(cols)).amax(dim=-1)
    sim = sim.scatter(-1, last_similar[..., None], 0.0)
    return torch.softmax(sim.mean(dim=-2), dim=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    keys = torch.randn(1, args.heads, args.n, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    times: dict[str, list[float]] = {"blocked": [], "whole": []}
    for _ in range(args.rounds):
        for name, fn in (("blocked", key_redundancy), ("whole", whole_matrix)):
            t0 = time.perf_counter()
            fn(keys)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    diff = float((key_redundancy(keys) - whole_matrix(keys)).abs().max())
    print(json.dumps({"n": args.n, "heads": args.heads, "median_seconds": med, "speedup": med["whole"] / med["blocked"],
                      "max_abs_difference": diff, "threads": torch.get_num_threads()}, indent=2))


if __name__ == "__main__":
    main()
