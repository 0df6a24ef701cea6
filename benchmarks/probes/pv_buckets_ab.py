"""Key buckets for the 16-bit p.V (kernels.pv_buckets) on and off: decode step time of one engine per run, each run in
a fresh process (oneDNN's primitive cache starts empty, as in a new server or eval), alternating the order every
round. Grouped decode attention (SKIPKV_DECODE_SDPA=0, what a CPU without AMX picks), p.V in the model's dtype.

    python benchmarks/probes/pv_buckets_ab.py [--case laprox:budget_ratio=0.1@1 --case full@1 --case full@16]
        [--prompt-tokens 2048] [--steps 48] [--rounds 2] [--out FILE.json]

A case is `policy spec@batch`. Prints and writes the mean decode step time of each setting per case and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from skipkv.hardware import environment
from skipkv.kernels import BUCKET_ENV, PV_ENV, SDPA_ENV


def one_run(model: str, spec: str, batch: int, prompt_tokens: int, steps: int) -> float:
    from skipkv.bench.throughput import make_workload
    from skipkv.config import EngineConfig, SamplingParams
    from skipkv.engine import Engine
    from skipkv.models import load_model
    from skipkv.policies import parse_policy_spec

    bundle = load_model(model, dtype="auto")
    prompts = make_workload(f"synthetic:{prompt_tokens}x1", bundle, batch, 0, None).prompts
    eng = Engine(bundle, parse_policy_spec(spec)[1], EngineConfig(batch_size=batch))
    for p in prompts:
        eng.add_request(p, SamplingParams(max_new_tokens=steps + 4, ignore_eos=True))
    eng.step()  # the prefill
    eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    eng.close()
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--case", action="append", help="policy spec@batch (repeatable)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--child", nargs=2, metavar=("SPEC", "BATCH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps({"step_ms": one_run(args.model, args.child[0], int(args.child[1]), args.prompt_tokens,
                                             args.steps)}))
        return
    cases = args.case or ["laprox:budget_ratio=0.1@1", "full@1", "full@16"]
    results = []
    for case in cases:
        spec, batch = case.rsplit("@", 1)
        times: dict[str, list[float]] = {"0": [], "1": []}
        for r in range(args.rounds):
            for on in (("0", "1") if r % 2 == 0 else ("1", "0")):
                env = {**os.environ, SDPA_ENV: "0", PV_ENV: "model", BUCKET_ENV: on}
                out = subprocess.run([sys.executable, __file__, "--model", args.model, "--prompt-tokens",
                                      str(args.prompt_tokens), "--steps", str(args.steps), "--child", spec, batch],
                                     env=env, capture_output=True, text=True, check=True)
                ms = json.loads(out.stdout.strip().splitlines()[-1])["step_ms"]
                times[on].append(ms)
                print(f"{case:28s} round {r} buckets={on} {ms:8.1f} ms/step", flush=True)
        mean = {k: statistics.mean(v) for k, v in times.items()}
        results.append({"case": case, "step_ms": times, "mean_step_ms": mean,
                        "on_over_off": round(mean["1"] / mean["0"], 4)})
        print(f"{case:28s} mean: off {mean['0']:.1f} ms, on {mean['1']:.1f} ms ({mean['1'] / mean['0']:.3f}x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "prompt_tokens": args.prompt_tokens, "steps": args.steps,
                       "rounds": args.rounds, "results": results, "environment": environment()}, f, indent=1)


if __name__ == "__main__":
    main()
