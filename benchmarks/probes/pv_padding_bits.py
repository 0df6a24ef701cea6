"""Whether padding the keys of a 16-bit probabilities x values product to kernels.key_bucket (zero probabilities
past K) leaves its bits unchanged on this machine, over many more shapes than the probe `kernels.pv_buckets` runs at
first use: batch x kv heads, query rows and key counts of decode steps (batch 1 and 64, one and eight query rows,
keys from 1 to ~9K).

    python benchmarks/probes/pv_padding_bits.py [--dtype bf16] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from skipkv.hardware import environment, set_threads
from skipkv.kernels import key_bucket

# (batch x kv heads, query rows per kv head, key counts)
SHAPES = ((2, 7, list(range(1, 2200, 3)) + list(range(2200, 9000, 97))), (128, 7, list(range(1, 700, 5))),
          (32, 1, list(range(1, 1500, 11))), (2, 56, list(range(1, 3000, 37))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    threads = set_threads(args.threads)
    gen = torch.Generator().manual_seed(1)
    differ, total = [], 0
    for bh, m, keys in SHAPES:
        values = torch.randn(bh, max(key_bucket(k) for k in keys), 64, generator=gen).to(dtype)
        for k in keys:
            probs = torch.softmax(torch.randn(bh, m, k, generator=gen) * 3, dim=-1).to(dtype)
            padded = key_bucket(k)
            wide = probs.new_zeros(bh, m, padded)
            wide[..., :k] = probs
            total += 1
            if not torch.equal(torch.bmm(probs, values[:, :k]), torch.bmm(wide, values[:, :padded])):
                differ.append([bh, m, k, padded])
    print(f"{args.dtype}: {total - len(differ)} of {total} shapes gave identical bits with padded keys"
          + (f"; differing (batch x heads, rows, keys, padded): {differ[:10]}" if differ else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"dtype": args.dtype, "threads": threads, "shapes": total, "differing": differ,
                       "environment": environment()}, f, indent=1)


if __name__ == "__main__":
    main()
