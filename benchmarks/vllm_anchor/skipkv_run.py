"""Run a workload file (workload.py) through skipkv's engine and print one JSON line of rates.

    python benchmarks/vllm_anchor/skipkv_run.py /tmp/w.json [--policy full|rkv --budget 256 --interval 32]
        [--kv-memory 1GiB] [--window-s 300] [--dtype auto] [--threads 0] [--no-unpad-prefill]

Model loading and a short warm-up are outside the timed part, as on the vLLM side. With --window-s the run
is cut after that many seconds and the rates cover the window.
"""

from __future__ import annotations

import argparse
import json
import time

from skipkv.bench.throughput import Workload, run_engine
from skipkv.config import EngineConfig, SamplingParams, parse_bytes
from skipkv.hardware import environment, set_threads
from skipkv.models import load_model
from skipkv.policies import make_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    ap.add_argument("--policy", default="full")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--interval", type=int, default=32)
    ap.add_argument("--kv-memory", default="0")
    ap.add_argument("--batch-size", type=int, help="cap on running requests (default: all of them)")
    ap.add_argument("--window-s", type=float)
    ap.add_argument("--prefill-budget", type=int, default=0, help="padded prompt tokens per prefill step (0 = all)")
    ap.add_argument("--no-unpad-prefill", action="store_true", help="MLPs on pad positions too (EngineConfig)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    spec = json.loads(open(args.workload).read())
    threads = set_threads(args.threads)
    t0 = time.perf_counter()
    bundle = load_model(spec["model"], dtype=args.dtype)
    load_s = time.perf_counter() - t0
    policy = make_policy("full") if args.policy == "full" else make_policy(args.policy, budget=args.budget,
                                                                           interval=args.interval)
    n = len(spec["prompt_ids"])
    sp = SamplingParams(max_new_tokens=spec["max_tokens"], ignore_eos=True)
    cfg = EngineConfig(batch_size=args.batch_size or n, kv_memory=parse_bytes(args.kv_memory),
                       prefill_budget=args.prefill_budget, unpad_prefill=not args.no_unpad_prefill)
    # Warm-up: kernels, allocator and first-call paths, on two short prompts together, then one alone (a compiled
    # step has one graph for batches of 2 or more and one for batch 1: both are built here, outside the timing).
    warm, ids = SamplingParams(max_new_tokens=4, ignore_eos=True), spec["prompt_ids"]
    for k in (2, 1):
        run_engine(bundle, policy, Workload("warmup", [ids[i % len(ids)][:16] for i in range(k)],
                                            [warm] * k), EngineConfig(), "w")
    run = run_engine(bundle, policy, Workload(spec["workload"], spec["prompt_ids"], [sp] * n), cfg, args.policy,
                     args.window_s)
    print(json.dumps({"engine": "skipkv", "policy": args.policy,
                      "budget": args.budget if args.policy != "full" else None,
                      "interval": args.interval if args.policy != "full" else None,
                      "dtype": str(bundle.dtype).removeprefix("torch."),
                      "dtype_reason": bundle.dtype_choice.reason if bundle.dtype_choice else "requested",
                      "threads": threads, "kv_memory": cfg.kv_memory, "prefill_budget": cfg.prefill_budget,
                      "unpad_prefill": cfg.unpad_prefill,
                      "load_s": round(load_s, 1),
                      "tokens_per_s": run.tokens_per_s, "generated_tokens": run.generated_tokens,
                      "wall_s": run.wall_s, "max_batch": run.max_batch, "peak_kv_bytes": run.peak_kv_bytes,
                      "finished": run.requests, "ttft_p50": run.ttft_p50, "tpot_p50": run.tpot_p50,
                      "timeline": run.timeline,
                      "environment": environment(bundle.dtype_choice)}))


if __name__ == "__main__":
    main()
