"""Peak memory and bits of a multi-token grouped forward run whole vs in blocks of rows (attention.GROUPED_BLOCK_BYTES).

    python benchmarks/probes/grouped_blocks_ab.py --offset 205 --limit 25 --out /tmp/grouped_ab

Runs the same `skipkv eval` twice in child processes, the second with attention.GROUPED_BLOCK_BYTES set to
`--whole` (no blocking) and the first to `--block` (the default), in the pre-registered SkipKV grid's MATH-500
setting (r1think prompts, shared prefix, padded prefill, batch 64, bf16, the kernel pins of its resume command):
peak RSS of each child (wait4), and whether every record field but timings and every trace line are the same.
MATH-500 test 205-229 holds the longest prompt of problems 200-249 (1675 tokens), which every row of the group is
padded to past the shared prefix. Prints one JSON object (the processor included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

PINS = {"OMP_NUM_THREADS": "1", "SKIPKV_DECODE_SDPA": "0", "SKIPKV_DECODE_PV": "fp32", "SKIPKV_PACKED_LINEARS": "0",
        "SKIPKV_UPCAST_LINEARS": "1", "SKIPKV_DECODE_PV_BUCKETS": "0"}
LAUNCH = ("import sys, skipkv.attention as a; a.GROUPED_BLOCK_BYTES = int(sys.argv[1]); "
          "sys.argv = ['skipkv'] + sys.argv[2:]; from skipkv.cli import main; main()")
TIMINGS = {"seconds", "compress_seconds", "session", "finished_at"}


def run(block: int, out: Path, args: argparse.Namespace) -> int:
    """Peak RSS (bytes) of one `skipkv eval` child."""
    cmd = [sys.executable, "-c", LAUNCH, str(block), "eval", "--model", args.model, "--dataset", "math500",
           "--offset", str(args.offset), "--limit", str(args.limit), "--policy", args.policy, "--budget", "64",
           "--interval", "32", "--protect-prompt", "true", "--max-new-tokens", str(args.max_new_tokens),
           "--batch-size", "64", "--share-prefix", "64", "--no-unpad-prefill", "--prompt-style", "r1think",
           "--force-wait", "2", "--dtype", "bf16", "--threads", "1", "--out", str(out), "--quiet", "--trace"]
    proc = subprocess.Popen(cmd, env=os.environ | PINS, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"error: skipkv eval failed ({' '.join(cmd[3:])})")
    return usage.ru_maxrss * 1024  # KiB on Linux


def same(a: Path, b: Path) -> dict:
    ra = {r["id"]: r for r in map(json.loads, (a / "records.jsonl").read_text().splitlines())}
    rb = {r["id"]: r for r in map(json.loads, (b / "records.jsonl").read_text().splitlines())}
    differ = sorted({f"{k}.{f}" for k in ra for f in ra[k] if f not in TIMINGS and ra[k][f] != rb.get(k, {}).get(f)})
    return {"records": len(ra), "same_ids": ra.keys() == rb.keys(), "differing_fields": differ,
            "traces_identical": (a / "traces.jsonl").read_bytes() == (b / "traces.jsonl").read_bytes()}


def family_model() -> str:
    """'family F model M' from /proc/cpuinfo (the name alone does not tell one EPYC generation from another)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lines if ":" in line)}
    return f"family {info.get('cpu family', '?')} model {info.get('model', '?')}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--policy", default="rkv")
    ap.add_argument("--offset", type=int, default=205)
    ap.add_argument("--limit", type=int, default=25)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--block", type=int, default=None, help="bytes (default: attention.GROUPED_BLOCK_BYTES)")
    ap.add_argument("--whole", type=int, default=1 << 50, help="bytes large enough that no forward is split")
    ap.add_argument("--out", type=Path, required=True, help="a folder for the two run directories")
    args = ap.parse_args()
    from skipkv.attention import GROUPED_BLOCK_BYTES

    block = args.block if args.block is not None else GROUPED_BLOCK_BYTES
    args.out.mkdir(parents=True, exist_ok=True)
    peaks = {}
    for name, value in (("blocked", block), ("whole", args.whole)):
        if (args.out / name).exists():
            sys.exit(f"error: {args.out / name} exists; give another --out")
        peaks[name] = run(value, args.out / name, args)
    from skipkv.hardware import environment

    print(json.dumps({"machine": environment()["machine"], "lscpu_family_model": family_model(),
                      "model": args.model, "policy": args.policy, "offset": args.offset, "limit": args.limit,
                      "max_new_tokens": args.max_new_tokens, "block_bytes": block,
                      "peak_rss_mib": {k: round(v / 2**20) for k, v in peaks.items()},
                      **same(args.out / "blocked", args.out / "whole")}, indent=1))


if __name__ == "__main__":
    main()
