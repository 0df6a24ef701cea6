"""What a new key count costs the decode attention's batched matmuls on this CPU: per-call time of q.k and p.V at
the grouped path's shapes ([B*H, G, D] x [B*H, D, K] and [B*H, G, K] x [B*H, K, D]) for one fixed K, for a new K
at every call (what a decode step sees: the cache grows by one entry per step, and a policy that keeps different
counts per layer gives every layer its own K), and for the same new Ks again. Every call slices one preallocated
buffer, so all three read the same memory.

    python benchmarks/probes/bmm_shapes.py [--batch 1 64] [--keys 256] [--calls 200] [--threads 0] [--out FILE.json]

A large "new K" column with a small "same Ks again" one is a per-shape setup cached by shape (oneDNN creates a
primitive per shape for 16-bit matmuls); equal columns mean the product's cost does not depend on the shape's
history.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from skipkv.hardware import environment, set_threads

H, G, D = 2, 7, 64  # Qwen2.5-0.5B: 2 kv heads, 7 query heads each, head dim 64


def per_call_us(fn, ks: list[int]) -> float:
    t0 = time.perf_counter()
    for k in ks:
        fn(k)
    return (time.perf_counter() - t0) / len(ks) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--keys", type=int, default=256,
                    help="the new Ks are K+1 .. K+calls; the fixed one is their middle")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()
    threads = set_threads(args.threads)
    rows = []
    for batch in args.batch:
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(0)
            kmax = args.keys + args.calls + 1
            q = torch.randn(batch * H, G, D, generator=gen).to(dtype)
            keys = torch.randn(batch * H, kmax, D, generator=gen).to(dtype)
            vals = torch.randn(batch * H, kmax, D, generator=gen).to(dtype)
            probs = torch.rand(batch * H, G, kmax, generator=gen).to(dtype)
            products = {
                "q.k": lambda k, q=q, keys=keys: torch.bmm(q, keys[:, :k].transpose(1, 2)),
                "p.V": lambda k, probs=probs, vals=vals: torch.bmm(probs[:, :, :k], vals[:, :k]),
            }
            # a stretch of Ks no call has used yet (then the same stretch again), and the K in its middle, fixed,
            # so that all three read about as many keys
            fresh = list(range(args.keys + 1, args.keys + args.calls + 1))
            fixed = [fresh[len(fresh) // 2]] * args.calls
            for name, fn in products.items():
                per_call_us(fn, fixed[:10])  # warm-up: creates the fixed shape only
                row = {"batch": batch, "dtype": str(dtype).removeprefix("torch."), "product": name,
                       "fixed_k_us": per_call_us(fn, fixed), "new_k_us": per_call_us(fn, fresh),
                       "same_new_ks_again_us": per_call_us(fn, fresh)}
                rows.append(row)
                print(f"batch {batch:3d} {row['dtype']:8s} {name}: fixed K {row['fixed_k_us']:8.1f} us, "
                      f"new K {row['new_k_us']:8.1f} us, same Ks again {row['same_new_ks_again_us']:8.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"keys": args.keys, "calls": args.calls, "threads": threads, "rows": rows,
                       "environment": environment()}, f, indent=1)


if __name__ == "__main__":
    main()
