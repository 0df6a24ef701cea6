"""`skipkv bench ...`: benchmarks that print a table and write JSON.

    skipkv bench decode --model random:qwen2:0.5b --policies full,rkv --budget 256 --lengths 256,1024,4096
    skipkv bench fidelity --model random:qwen2 --dataset niah --lengths 512 --policies snapkv,laprox --budget-ratio 0.2
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


def cmd_fidelity(args: argparse.Namespace) -> int:
    from skipkv.bench.fidelity import run_fidelity
    from skipkv.policies import POLICIES

    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if not POLICIES.get(p).compresses:  # one-line error for an unknown name, before loading a model
            raise SkipKVError(f"{p} keeps the full cache: it is the reference, not a policy to compare")
    if not 0 < args.budget_ratio <= 1:
        raise SkipKVError(f"budget ratio must be in (0, 1], got {args.budget_ratio}")
    if args.examples <= 0 or args.window <= 0:
        raise SkipKVError("--examples and --window must be positive")
    run_fidelity(args.model, args.dataset, _ints(args.lengths), policies, args.budget_ratio, args.examples,
                 args.window, args.dtype, args.out)
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
    f = bsub.add_parser("fidelity", help="per-layer cosine of the window's attention output: compressed vs full cache")
    f.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    f.add_argument("--dataset", default="niah")
    f.add_argument("--lengths", default="4096,8192")
    f.add_argument("--policies", default="snapkv,pyramidkv,laprox")
    f.add_argument("--budget-ratio", type=float, default=0.1, help="budget per layer as a fraction of the prompt")
    f.add_argument("--examples", type=int, default=1, help="examples per length (niah: the first depths)")
    f.add_argument("--window", type=int, default=32, help="observation queries compared (the last prompt tokens)")
    f.add_argument("--dtype", default="bf16")
    f.add_argument("--out", help="write the JSON report here (and a PNG plot beside it)")
    f.set_defaults(func=cmd_fidelity)
