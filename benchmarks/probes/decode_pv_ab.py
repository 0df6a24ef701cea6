"""p.V in the model's dtype against p.V in fp32 (kernels.decode_pv), in one process on one engine: R-KV at batch 64
in its steady state (the capped workload of docs/benchmarks.md: 512 random prompt tokens, budget 256, interval 32),
decode steps timed in alternating blocks of `--block` steps, one setting then the other, so that both see the same
cache sizes and the same machine noise. Each block of 32 steps holds exactly one compression (the requests decode
in lockstep). Prints and writes the mean step time of each setting and their ratio.

    python benchmarks/probes/decode_pv_ab.py [--batch 64] [--rounds 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from skipkv.bench.throughput import make_workload
from skipkv.config import EngineConfig, SamplingParams
from skipkv.engine import Engine
from skipkv.hardware import environment, set_threads
from skipkv.kernels import PV_ENV, decode_sdpa
from skipkv.models import load_model
from skipkv.policies import parse_policy_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--policy", default="rkv:budget=256,interval=32")
    ap.add_argument("--block", type=int, default=32, help="steps per timed block (a multiple of the interval)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=40, help="steps before timing (prefill included)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()
    threads = set_threads(args.threads)
    bundle = load_model(args.model, dtype="auto")
    if decode_sdpa("cpu")[0]:
        print("note: fused SDPA takes unmasked 16-bit decode steps on this machine; set SKIPKV_DECODE_SDPA=0 to time "
              "the grouped path")
    prompts = make_workload(f"synthetic:{args.prompt_tokens}x1", bundle, args.batch, 0, None).prompts
    eng = Engine(bundle, parse_policy_spec(args.policy)[1], EngineConfig(batch_size=args.batch))
    total = args.warmup + 2 * args.rounds * args.block + 8
    for p in prompts:
        eng.add_request(p, SamplingParams(max_new_tokens=total, ignore_eos=True))
    for _ in range(args.warmup):
        eng.step()
    times: dict[str, list[float]] = {"fp32": [], "model": []}
    blocks: list[dict] = []
    saved = os.environ.get(PV_ENV)
    try:
        for r in range(args.rounds):
            for setting in (("fp32", "model") if r % 2 == 0 else ("model", "fp32")):
                os.environ[PV_ENV] = setting
                t0 = time.perf_counter()
                for _ in range(args.block):
                    eng.step()
                ms = (time.perf_counter() - t0) / args.block * 1e3
                times[setting].append(ms)
                blocks.append({"round": r, "pv": setting, "step_ms": round(ms, 2)})
                print(f"round {r} pv={setting:5s} {ms:8.1f} ms/step")
    finally:
        if saved is None:
            os.environ.pop(PV_ENV, None)
        else:
            os.environ[PV_ENV] = saved
    mean = {k: statistics.mean(v) for k, v in times.items()}
    result = {"model": args.model, "batch": args.batch, "prompt_tokens": args.prompt_tokens, "policy": args.policy,
              "block": args.block, "rounds": args.rounds, "threads": threads, "blocks": blocks,
              "mean_step_ms": {k: round(v, 2) for k, v in mean.items()},
              "model_over_fp32": round(mean["model"] / mean["fp32"], 4),
              "environment": environment()}
    print(f"mean step: p.V fp32 {mean['fp32']:.1f} ms, p.V in the model's dtype {mean['model']:.1f} ms "
          f"({mean['model'] / mean['fp32']:.3f}x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
