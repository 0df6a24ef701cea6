"""Prefill + compression time per policy on one long prompt (issue 10: what each policy costs at prefill).

    OMP_NUM_THREADS=1 python benchmarks/probes/prefill_time.py --model qwen2.5-coder-0.5b-instruct --length 8192 \
        --budget-ratio 0.05 --repeats 2 --out docs/results/prefill_time_8k.json

Each policy prefills the same needle prompt and produces one token (`max_new_tokens=1`) through the public
`generate`; the engine's own timers give time to first token and the wall time inside the policy's
compression, so prefill = TTFT − compression (the model's forward passes plus the first token). Policies
run interleaved, round by round, so a slow spell on this shared machine hits all of them alike; the table
gives per-policy medians over rounds and each one's compression time as a multiple of SnapKV's from the
same rounds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

from skipkv import SamplingParams, generate, load_model
from skipkv.eval import prompts
from skipkv.eval.datasets import data_request, get_dataset
from skipkv.policies import parse_policy_spec

DEFAULT_POLICIES = ("full;streaming_llm;h2o;snapkv;pyramidkv;rkv;laprox;laprox:kernel=7;laprox:norm=frobenius")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dataset", default="niah")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--budget-ratio", type=float, default=0.05)
    ap.add_argument("--policies", default=DEFAULT_POLICIES, help="';'-separated policy specs")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", help="bf16: the dtype of the needle evaluations")
    ap.add_argument("--out", default=None, help="JSON file")
    args = ap.parse_args(argv)
    if not 0 < args.budget_ratio <= 1 or args.repeats < 1:
        print("error: --budget-ratio must be in (0, 1] and --repeats >= 1", file=sys.stderr)
        return 2

    bundle = load_model(args.model, dtype=args.dtype)
    ds = get_dataset(args.dataset)
    ex = next(e for e in ds.load(data_request({"lengths": [args.length]}, bundle.tokenizer, "chat"))
              if int(e.meta.get("length", 0)) == args.length)
    ids = prompts.encode(bundle.tokenizer, prompts.render(bundle.tokenizer, ex, "chat"), "chat")
    budget = max(1, round(args.budget_ratio * len(ids)))
    specs = [s.strip() for s in args.policies.split(";") if s.strip()]
    sp = SamplingParams(max_new_tokens=1)
    times: dict[str, list[dict]] = {s: [] for s in specs}
    for rnd in range(args.repeats):
        for spec in specs:
            policy = None if spec == "full" else parse_policy_spec(spec, budget=budget)[1]
            (res,) = generate(bundle, [ids], sp, policy)
            times[spec].append({"ttft_s": res.ttft_seconds, "compress_s": res.compress_seconds,
                                "prefill_s": res.ttft_seconds - res.compress_seconds,
                                "kv_mib": res.decode_peak_kv_bytes / 2**20 if res.decode_peak_kv_bytes else None})
            print(f"round {rnd}: {spec:24s} ttft {res.ttft_seconds:7.2f} s  compress {res.compress_seconds:6.2f} s",
                  flush=True)

    def med(spec: str, key: str) -> float:
        return statistics.median(t[key] for t in times[spec])

    ref = "snapkv" if "snapkv" in specs else None
    lines = [f"{args.model}, {args.dataset} prompt of {len(ids)} tokens, budget {budget} tokens "
             f"({args.budget_ratio:g} of the prompt), {args.dtype}, {torch.get_num_threads()} thread(s), "
             f"median of {args.repeats} interleaved rounds", "",
             "| policy | prefill (s) | compression (s) | time to first token (s) | compression / SnapKV's |",
             "|---|---:|---:|---:|---:|"]
    for spec in specs:
        ratio = "—" if ref is None or med(ref, "compress_s") == 0 or med(spec, "compress_s") == 0 else \
            f"{statistics.median(a['compress_s'] / b['compress_s'] for a, b in zip(times[spec], times[ref])):.1f}x"
        lines.append(f"| {spec} | {med(spec, 'prefill_s'):.2f} | {med(spec, 'compress_s'):.2f} | "
                     f"{med(spec, 'ttft_s'):.2f} | {ratio} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "model": args.model, "dataset": args.dataset, "prompt_tokens": len(ids), "budget": budget,
            "budget_ratio": args.budget_ratio, "dtype": args.dtype, "threads": torch.get_num_threads(),
            "repeats": args.repeats, "machine": {"host": platform.node(), "torch": torch.__version__},
            "times": times, "table": table}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
