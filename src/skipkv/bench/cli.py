"""`skipkv bench ...`: benchmarks that print a table and write JSON.

    skipkv bench decode --model random:qwen2:0.5b --policies full,rkv --budget 256 --lengths 256,1024,4096
"""

from __future__ import annotations

import argparse

from skipkv.errors import SkipKVError


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SkipKVError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) <= 1:
        raise SkipKVError(f"lengths must be integers > 1, got {text!r}")
    return vals


def cmd_decode(args: argparse.Namespace) -> int:
    from skipkv.bench.decode import run_bench
    from skipkv.policies import POLICIES

    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        POLICIES.get(p)  # one-line error for an unknown name, before loading a model
    run_bench(args.model, policies, _ints(args.lengths), args.budget, args.interval, args.window, args.batch_size,
              args.dtype, args.span, args.out)
    return 0


def register(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks (tables + JSON)")
    bsub = b.add_subparsers(dest="bench", required=True)
    d = bsub.add_parser("decode", help="per-step decode time and KV memory vs generated length")
    d.add_argument("--model", default="random:qwen2:0.5b")
    d.add_argument("--policies", default="full,rkv")
    d.add_argument("--lengths", default="256,1024,4096")
    d.add_argument("--budget", type=int, default=256)
    d.add_argument("--interval", type=int, default=128)
    d.add_argument("--window", type=int, default=8)
    d.add_argument("--batch-size", type=int, default=1)
    d.add_argument("--dtype", default="bf16")
    d.add_argument("--span", type=int, default=64, help="steps before each length whose median is reported")
    d.add_argument("--out", help="write the JSON report here")
    d.set_defaults(func=cmd_decode)
