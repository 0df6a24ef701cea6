"""`skipkv bench ...`: benchmarks that print a table and write JSON.

    skipkv bench decode --model random:qwen2:0.5b --policies full,rkv --budget 256 --lengths 256,1024,4096
"""

from __future__ import annotations

import argparse

from skipkv.errors import SkipKVError


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SkipKVError(f"expected comma-separated integers, got {text!r}") from None


def cmd_decode(args: argparse.Namespace) -> int:
    from skipkv.bench.decode import DecodeBenchConfig, run_bench

    # Everything is checked here (policies, knobs, lengths, --out) before the model loads.
    cfg = DecodeBenchConfig(model=args.model, policies=tuple(p for p in args.policies.split(",") if p),
                            lengths=_ints(args.lengths), budget=args.budget, interval=args.interval,
                            window=args.window, batch_size=args.batch_size, dtype=args.dtype, span=args.span,
                            out=args.out)
    run_bench(cfg)
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
