"""`skipkv bench ...`: benchmarks that print a table and write JSON.

    skipkv bench decode --model random:qwen2:0.5b --policies full,rkv --budget 256 --lengths 256,1024,4096
    skipkv bench serve --url http://127.0.0.1:8000 --concurrency 1,4,16 --requests 16 --dataset gsm8k
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


def cmd_serve(args: argparse.Namespace) -> int:
    from skipkv.bench.serve import run_bench
    from skipkv.eval.datasets import dataset_names

    try:
        levels = [int(x) for x in args.concurrency.split(",") if x]
    except ValueError:
        raise SkipKVError(f"--concurrency expects comma-separated integers, got {args.concurrency!r}") from None
    if not levels or min(levels) < 1 or args.requests < 1 or args.max_tokens < 1:
        raise SkipKVError("--concurrency levels, --requests and --max-tokens must be positive")
    if args.dataset not in dataset_names():
        raise SkipKVError(f"unknown dataset {args.dataset!r}; choose one of: {', '.join(dataset_names())}")
    run_bench(args.url, levels, args.requests, args.dataset, args.max_tokens, args.api_key, args.ignore_eos, args.out)
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
    s = bsub.add_parser("serve", help="load-test an OpenAI-compatible server (requests/s, tokens/s, TTFT, ITL)")
    s.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (without /v1)")
    s.add_argument("--concurrency", default="1,4,16", help="concurrent streaming clients, one level each")
    s.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    s.add_argument("--dataset", default="gsm8k", help="whose questions to send (as chat messages)")
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--ignore-eos", action="store_true", help="ask for exactly --max-tokens tokens per request")
    s.add_argument("--api-key", help="the server's API key, if it has one")
    s.add_argument("--out", help="write the JSON report here")
    s.set_defaults(func=cmd_serve)
