"""Resident memory of a loaded model, per linear layout: each variant loaded in a process of its own, then RSS
(/proc/self/statm) and the process's peak (ru_maxrss) after `load_model`. Checks that replacing the linears at
load (models/packed.py: transposed fp32, upcast bf16) leaves the model's footprint where it was.

    python benchmarks/probes/load_memory.py --model qwen2.5-coder-0.5b-instruct --dtype fp32 \
        --out docs/results/upcast/load_memory_fp32_epyc_avx2.json

Variants: `plain` (SKIPKV_TRANSPOSED_LINEARS=0, SKIPKV_UPCAST_LINEARS=0) and `replaced` (both 1: what this dtype
replaces its linears by, if anything).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from skipkv import hardware, kernels
from skipkv.outputs import write_atomic

CHILD = """
import gc, json, resource, sys, time
t = time.perf_counter()
from skipkv.models import load_model
bundle = load_model(sys.argv[1], dtype=sys.argv[2])
gc.collect()
print(json.dumps({"rss_mib": int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "load_seconds": time.perf_counter() - t, "linears": bundle.plan.linears.reason}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = {}
    for variant, flag in (("plain", "0"), ("replaced", "1")):
        env = dict(os.environ, **{kernels.TRANSPOSE_ENV: flag, kernels.UPCAST_ENV: flag})
        child = subprocess.run([sys.executable, "-c", CHILD, args.model, args.dtype], env=env, capture_output=True,
                               text=True)
        if child.returncode != 0:
            print(f"load_memory: the {variant} process failed: {child.stderr.strip().splitlines()[-1:]}",
                  file=sys.stderr)
            return 1
        rows[variant] = json.loads(child.stdout.strip().splitlines()[-1])
        r = rows[variant]
        print(f"{variant}: RSS {r['rss_mib']:.0f} MiB, peak {r['peak_rss_mib']:.0f} MiB, load {r['load_seconds']:.1f} s"
              f" ({r['linears']})", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(args.out), json.dumps({"model": args.model, "dtype": args.dtype, "variants": rows,
                                                 "environment": hardware.environment()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
