"""`skipkv bench ...`: benchmarks that print a table and write JSON.

    skipkv bench decode --model random:qwen2:0.5b --policies full,rkv --budget 256 --lengths 256,1024,4096
    skipkv bench fidelity --model random:qwen2 --dataset niah --lengths 512 --policies snapkv,laprox --budget-ratio 0.2
    skipkv bench throughput --model random:qwen2:0.5b --workload synthetic:128x512 --requests 32 \
        --kv-memory 48MiB --policies full,rkv --budget 64 --interval 32 --out docs/bench_throughput_quick.json
    skipkv bench serve --url http://127.0.0.1:8000 --concurrency 1,4,16 --requests 16 --dataset gsm8k
    skipkv bench serve --url http://127.0.0.1:8000 --soak 10 --out soak.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from skipkv.config import (
    BATCH_WHY,
    MAX_BATCH,
    MAX_SEED,
    MAX_TOKENS,
    SEED_WHY,
    TOKENS_WHY,
    bounded,
    short,
)
from skipkv.errors import SkipKVError
from skipkv.hardware import DTYPE_HELP, set_threads

MAX_REQUESTS = 1 << 20
REQUESTS_WHY = "every request is built before the first is sent"


def _ints(text: str, name: str = "list", hi: int = MAX_TOKENS, why: str = TOKENS_WHY) -> tuple[int, ...]:
    """Comma-separated integers, each in 1..hi; at most 64 of them."""
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SkipKVError(f"{name}: expected comma-separated integers, got {short(text)}") from None
    if len(vals) > 64:
        raise SkipKVError(f"{name}: at most 64 values (each is a separate run), got {len(vals)}")
    for v in vals:
        bounded(v, name, 1, hi, why)
    return vals


def cmd_decode(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    from skipkv.bench.decode import DecodeBenchConfig, run_bench

    # Everything is checked here (policies, knobs, lengths, --out) before the model loads.
    sep = ";" if ";" in args.policies else ","  # specs with knobs (name:k=v,k=v) are separated by ";"
    cfg = DecodeBenchConfig(model=args.model, policies=tuple(p.strip() for p in args.policies.split(sep) if p.strip()),
                            lengths=_ints(args.lengths, "--lengths"), budget=args.budget, interval=args.interval,
                            window=args.window, batch_size=args.batch_size, dtype=args.dtype, span=args.span,
                            prompt_tokens=args.prompt_tokens, out=args.out, progress=not args.no_progress)
    run_bench(cfg)
    return 0


def cmd_fidelity(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    from skipkv.bench.fidelity import run_fidelity
    from skipkv.policies import parse_policy_spec

    policies = [p for p in args.policies.split(";" if ";" in args.policies else ",") if p]
    for p in policies:  # one-line errors for an unknown name or knob, before loading a model
        if not parse_policy_spec(p, budget=1 << 20)[1].compresses:
            raise SkipKVError(f"{p} keeps the full cache: it is the reference, not a policy to compare")
    if not 0 < args.budget_ratio <= 1:
        raise SkipKVError(f"budget ratio must be in (0, 1], got {args.budget_ratio}")
    bounded(args.examples, "--examples", 1, 10_000, "examples are held in memory")
    bounded(args.window, "--window", 1, MAX_TOKENS, TOKENS_WHY)
    bounded(args.steps, "--steps", 1, MAX_TOKENS, TOKENS_WHY)
    lengths = list(_ints(args.lengths, "--lengths"))
    run_fidelity(args.model, args.dataset, lengths, policies, args.budget_ratio, args.examples, args.window,
                 args.dtype, args.out, queries=args.queries, steps=args.steps)
    return 0


def _batches(text: str) -> list[int]:
    vals = list(_ints(text, "--batch-sweep", MAX_BATCH, BATCH_WHY))
    if not vals:
        raise SkipKVError(f"--batch-sweep: give batch sizes, got {short(text)}")
    return vals


def cmd_throughput(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    from skipkv.bench.throughput import run_bench
    from skipkv.policies import POLICIES

    policies = [p for p in args.policies.split(",") if p]
    if not policies:
        raise SkipKVError("--policies: give at least one policy")
    for p in policies:
        POLICIES.get(p)  # one-line error for an unknown name, before loading a model
    bounded(args.requests, "--requests", 1, MAX_REQUESTS, REQUESTS_WHY)
    bounded(args.repeats, "--repeats", 1, 100, "each repeat runs the whole benchmark again")
    bounded(args.seed, "--seed", 0, MAX_SEED, SEED_WHY)
    for name in ("max_new_tokens", "prefill_chunk", "prefill_budget", "budget", "interval", "window"):
        if getattr(args, name) is not None:
            bounded(getattr(args, name), f"--{name.replace('_', '-')}", 0, MAX_TOKENS, TOKENS_WHY)
    if args.batch_size is not None:
        bounded(args.batch_size, "--batch-size", 1, MAX_BATCH, BATCH_WHY)
    if args.max_seconds is not None and (args.max_seconds <= 0 or args.hf_reference):
        raise SkipKVError("--max-seconds must be positive and cannot be combined with --hf-reference")
    knobs = {"budget": args.budget, "interval": args.interval, "window": args.window}
    run_bench(args.model, args.workload, args.requests, policies, args.kv_memory, knobs, batch_size=args.batch_size,
              batch_sweep=_batches(args.batch_sweep) if args.batch_sweep else None, hf_reference=args.hf_reference,
              max_new_tokens=args.max_new_tokens, prefill_chunk=args.prefill_chunk,
              prefill_budget=args.prefill_budget, dtype=args.dtype, device=args.device, seed=args.seed,
              out=args.out, plot_path=args.plot, max_seconds=args.max_seconds, repeats=args.repeats)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from skipkv.bench.serve import run_bench
    from skipkv.eval.datasets import dataset_names

    bounded(args.seed, "--seed", 0, MAX_SEED, SEED_WHY)
    if args.out is not None:
        from skipkv.outputs import check_file

        check_file(args.out, "--out")  # before the first request: an unusable --out fails now, not after the run
    if args.scenario is not None:
        from skipkv.bench.scenarios import run_scenario

        run_scenario(args.scenario, args.url, args.api_key, args.out, args.pid, args.log)
        return 0
    if args.soak is not None:
        from skipkv.bench.soak import run_soak

        if not 0 < args.soak <= 24 * 60:
            raise SkipKVError(f"--soak must be in (0, 1440] minutes, got {short(args.soak)}")
        run_soak(args.url, args.soak, args.api_key, args.out, args.seed)
        return 0

    levels = list(_ints(args.concurrency, "--concurrency", 4096, "each level opens that many connections"))
    if not levels:
        raise SkipKVError("--concurrency: give at least one level")
    bounded(args.requests, "--requests", 1, MAX_REQUESTS, REQUESTS_WHY)
    bounded(args.max_tokens, "--max-tokens", 1, MAX_TOKENS, TOKENS_WHY)
    if args.dataset not in dataset_names():
        raise SkipKVError(f"unknown dataset {args.dataset!r}; choose one of: {', '.join(dataset_names())}")
    run_bench(args.url, levels, args.requests, args.dataset, args.max_tokens, args.api_key, args.ignore_eos, args.out)
    return 0


def register(sub):
    """Add `bench` and its benchmarks to `sub`; returns the `bench` subparsers (skipkv/report/bench_tools.py adds
    the analysis tools to them)."""
    from skipkv.engine.cli import kv_memory_arg

    b = sub.add_parser("bench", help="benchmarks (tables + JSON) and the tools that read finished runs")
    bsub = b.add_subparsers(dest="bench", required=True)
    d = bsub.add_parser("decode", help="per-step decode time and KV memory vs generated length")
    d.add_argument("--model", default="random:qwen2:0.5b")
    d.add_argument("--policies", default="full,rkv")
    d.add_argument("--lengths", default="256,1024,4096")
    d.add_argument("--budget", type=int, default=256)
    d.add_argument("--interval", type=int, default=128)
    d.add_argument("--window", type=int, default=8)
    d.add_argument("--batch-size", type=int, default=1)
    d.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    d.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's, one per core)")
    d.add_argument("--span", type=int, default=64, help="steps before each length whose median is reported")
    d.add_argument("--prompt-tokens", type=int, default=0,
                   help="prompt length in tokens (0: a short question; longer: the question repeated)")
    d.add_argument("--out", help="write the JSON report here")
    d.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    d.set_defaults(func=cmd_decode)
    f = bsub.add_parser("fidelity", help="per-layer cosine of the attention output of queries the policies did not "
                        "score: compressed vs full cache")
    f.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    f.add_argument("--dataset", default="niah")
    f.add_argument("--lengths", default="4096,8192")
    f.add_argument("--policies", default="snapkv,pyramidkv,laprox",
                   help="comma-separated, or ';'-separated specs with knobs: 'snapkv;laprox:kernel=7,normalize=sum'")
    f.add_argument("--budget-ratio", type=float, default=0.1, help="budget per layer as a fraction of the prompt")
    f.add_argument("--examples", type=int, default=1, help="examples per length (niah: the first depths)")
    f.add_argument("--queries", default="decode",  # checked by run_fidelity (bench.fidelity.QUERY_MODES)
                   help="queries compared: decode (the full cache's greedy answer, default), heldout (the last "
                   "--steps prompt tokens, held out from compression) or window (the scoring window itself)")
    f.add_argument("--steps", type=int, default=32, help="decode steps or held-out prompt tokens compared")
    f.add_argument("--window", type=int, default=32,
                   help="queries captured from the prefill (and compared with --queries window)")
    f.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    f.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's, one per core)")
    f.add_argument("--out", help="write the JSON report here (and a PNG plot beside it)")
    f.set_defaults(func=cmd_fidelity)
    t = bsub.add_parser("throughput", help="tokens/s of each policy under one KV memory cap (+ batch sweep)")
    t.add_argument("--model", default="random:qwen2:0.5b")
    t.add_argument("--workload", default="synthetic:128x512", help="synthetic:PROMPTxOUTPUT or gsm8k")
    t.add_argument("--requests", type=int, default=32, help="requests, all submitted at once")
    t.add_argument("--policies", default="full,rkv")
    t.add_argument("--kv-memory", type=kv_memory_arg, default=0, help="KV memory cap, e.g. 2GiB (0 = none)")
    t.add_argument("--budget", type=int, help="policy budget (compressing policies; default: the policy's)")
    t.add_argument("--interval", type=int)
    t.add_argument("--window", type=int)
    t.add_argument("--batch-size", type=int, help="cap on running requests (default: --requests; memory decides)")
    t.add_argument("--batch-sweep", help="e.g. 1,2,4,8: tokens/s per batch size without a memory cap")
    t.add_argument("--hf-reference", action="store_true", help="also time transformers' generate (full cache)")
    t.add_argument("--max-tokens", "--max-new-tokens", dest="max_new_tokens", type=int,
                   help="override the workload's output length")
    t.add_argument("--prefill-chunk", type=int, default=0, help="prompt tokens per request per step (0 = whole)")
    t.add_argument("--prefill-budget", type=int, default=0, help="prompt tokens per step at most (0 = no limit)")
    t.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    t.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's, one per core)")
    t.add_argument("--device", help="cpu, cuda (default: the loader's)")
    t.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts")
    t.add_argument("--out", help="write the JSON report here (checked writable before running)")
    t.add_argument("--plot", help="PNG path (default: --out with .png)")
    t.add_argument("--repeats", type=int, default=1,
                   help="batch sweep: runs per batch, engine and transformers alternating (medians reported)")
    t.add_argument("--max-seconds", type=float, help="cut each engine run after this long (rates over the window)")
    t.set_defaults(func=cmd_throughput)
    s = bsub.add_parser("serve", help="load-test an OpenAI-compatible server (requests/s, tokens/s, TTFT, ITL)")
    s.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (without /v1)")
    s.add_argument("--concurrency", default="1,4,16", help="concurrent streaming clients, one level each")
    s.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    s.add_argument("--dataset", default="gsm8k", help="whose questions to send (as chat messages)")
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--ignore-eos", action="store_true", help="ask for exactly --max-tokens tokens per request")
    s.add_argument("--api-key", help="the server's API key, if it has one")
    s.add_argument("--out", help="write the JSON report here")
    s.add_argument("--soak", type=float, metavar="MINUTES",
                   help="instead: MINUTES of mixed normal and hostile clients (disconnecting, oversized, malformed, "
                        "slow) against a server on this machine; requests by outcome, latency, RSS, KV at the end")
    s.add_argument("--seed", type=int, default=0, help="--soak: the clients' random choices")
    s.add_argument("--scenario", help="instead: one measured situation against a server on this machine: "
                                      "long-prompt, flood or sigterm (skipkv/bench/scenarios.py)")
    s.add_argument("--pid", type=int, default=0, help="--scenario sigterm: the server's process id")
    s.add_argument("--log", help="--scenario sigterm: the server's log file (tracebacks are counted)")
    s.set_defaults(func=cmd_serve)
    ap = bsub.add_parser("profile-step", help="where one decode step's time goes (torch.profiler, per module class; "
                                              "skipkv/bench/profile_step.py)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's, one per core)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together (the same prompt)")
    ap.add_argument("--policy", default="full", help="policy spec, e.g. rkv:budget=256,interval=32")
    ap.add_argument("--prompt-tokens", type=int, help="N random prompt tokens instead of the GSM8K question")
    ap.add_argument("--warmup", type=int, default=16, help="steps before timing (prefill included)")
    ap.add_argument("--top", type=int, default=0, help="also print the N aten ops with the most self CPU time")
    ap.add_argument("--out", help="write the JSON report here")
    ap.set_defaults(func=cmd_profile_step)
    ap = bsub.add_parser("shared-prefill", help="a grid's cells one by one against one shared prefill per example: "
                                                "wall time, the same records (skipkv/bench/shared_prefill.py)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--length", type=int, default=4096, help="NIAH prompt length in tokens")
    ap.add_argument("--examples", type=int, default=2, help="examples (needle depths) per cell")
    ap.add_argument("--out", type=Path, required=True, help="a folder this tool owns (replaced on every run)")
    ap.set_defaults(func=cmd_shared_prefill)
    return bsub


def cmd_profile_step(args: argparse.Namespace) -> int:
    from skipkv.bench.profile_step import run

    return run(args)


def cmd_shared_prefill(args: argparse.Namespace) -> int:
    from skipkv.bench.shared_prefill import run

    return run(args)
