"""glibc's defaults against the tuned heap (`hardware.tune_allocator`, SKIPKV_MALLOC=heap|system): the same engine
work in fresh processes, alternating the two, several rounds. Each run prefills N synthetic prompts of P tokens
under R-KV (budget 256, interval 32; the prompt compressed at prefill), then times D decode steps at batch N.
Reports per run: prefill seconds, decode ms/step, the process's user and system CPU seconds, peak RSS, and whether
its greedy tokens equal the first run's (they must: the allocator moves no arithmetic). Writes one JSON.

    python benchmarks/probes/allocator_ab.py [--requests 32] [--prompt-tokens 300] [--decode-steps 64] [--rounds 2] \
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time, torch
from skipkv.bench.throughput import make_workload
from skipkv.config import EngineConfig, SamplingParams
from skipkv.engine import Engine
from skipkv.hardware import environment
from skipkv.models import load_model
from skipkv.policies import parse_policy_spec
model, n, p, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
bundle = load_model(model, dtype="auto")
prompts = make_workload(f"synthetic:{p}x1", bundle, n, 0, None).prompts
eng = Engine(bundle, parse_policy_spec("rkv:budget=256,interval=32")[1], EngineConfig(batch_size=n))
for q in prompts:
    eng.add_request(q, SamplingParams(max_new_tokens=d + 8, ignore_eos=True))
t0 = time.perf_counter(); eng.step(); prefill = time.perf_counter() - t0
for _ in range(4):
    eng.step()
t0 = time.perf_counter()
for _ in range(d):
    eng.step()
decode = (time.perf_counter() - t0) / d * 1e3
tokens = [r.output_ids[:d] for r in eng.runner.running]
eng.close()
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"prefill_s": prefill, "decode_ms_per_step": decode, "user_s": ru.ru_utime, "sys_s": ru.ru_stime,
                  "max_rss_mib": ru.ru_maxrss / 1024, "tokens": tokens, "allocator": environment()["allocator"]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    runs: list[dict] = []
    first_tokens = None
    for r in range(args.rounds):
        for mode in (("system", "heap") if r % 2 == 0 else ("heap", "system")):
            env = {**os.environ, "SKIPKV_MALLOC": mode}
            out = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.requests), str(args.prompt_tokens),
                                  str(args.decode_steps)], env=env, capture_output=True, text=True, check=True)
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            tokens = rec.pop("tokens")
            first_tokens = first_tokens if first_tokens is not None else tokens
            rec.update(mode=mode, round=r, tokens_equal_first_run=tokens == first_tokens)
            runs.append(rec)
            print(f"round {r} {mode:6s} prefill {rec['prefill_s']:6.1f} s  decode {rec['decode_ms_per_step']:6.1f} "
                  f"ms/step  user {rec['user_s']:6.1f} s  sys {rec['sys_s']:5.1f} s  rss {rec['max_rss_mib']:6.0f} MiB"
                  f"  tokens equal: {rec['tokens_equal_first_run']}", flush=True)
    med = {m: {k: statistics.median(x[k] for x in runs if x["mode"] == m)
               for k in ("prefill_s", "decode_ms_per_step", "user_s", "sys_s", "max_rss_mib")}
           for m in ("system", "heap")}
    print("medians:", json.dumps(med))
    print(f"system/heap: prefill {med['system']['prefill_s'] / med['heap']['prefill_s']:.2f}x, decode "
          f"{med['system']['decode_ms_per_step'] / med['heap']['decode_ms_per_step']:.2f}x")
    if args.out:
        from skipkv.hardware import environment

        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "medians": med, "environment": environment()}, f, indent=1)


if __name__ == "__main__":
    main()
