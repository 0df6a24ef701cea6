"""A shared prompt prefix prefilled once (EngineConfig.share_prefix) vs every prompt prefilled whole, on the real
model with the r1think prompts (~950 tokens of exemplars before each question), through the public `generate`.

    OMP_NUM_THREADS=1 python benchmarks/probes/share_prefix_ab.py --examples 8 --configs 8:0,8:64 --new-tokens 32 \
        --rounds 1 --out docs/results/share_prefix/share_prefix_ab.json

Prompts: GSM8K test problems from `--offset` (default 1200, the testbed's calibration slice, never reported).
Each config `BATCH:SHARE` generates the same prompts (full cache, greedy, `ignore_eos`, `--new-tokens`); a round
runs every config in turn, so a slow spell on this shared machine hits them alike. Reported per config (medians
over rounds): time to the first token of the first batch (its prefill), the whole run's wall time, prompt
tokens the shared prefix saved, and the share of greedy tokens equal to the first config's (a shared prefix is a
separate forward, so the last bits of the rest can differ and a near-tie may flip, as with chunked prefill).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from skipkv import SamplingParams, hardware, load_model, make_policy
from skipkv.config import EngineConfig
from skipkv.engine import Engine
from skipkv.errors import SkipKVError
from skipkv.eval import prompts
from skipkv.eval.data import data_request
from skipkv.eval.datasets import get_dataset
from skipkv.outputs import write_atomic


def run(bundle, ids: list[list[int]], batch: int, share: int, new_tokens: int) -> dict:
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    eng = Engine(bundle, make_policy("full"), EngineConfig(batch_size=batch, share_prefix=share))
    t0 = time.perf_counter()
    try:
        rids = [eng.add_request(x, sp) for x in ids]
        results = {}
        while eng.has_unfinished():
            results.update({r.request_id: r for r in eng.step().finished})
        saved = eng.runner.shared_prefix_tokens
    finally:
        eng.close()
    wall = time.perf_counter() - t0
    first = [results[r] for r in rids[:batch]]
    return {"first_batch_ttft_s": max(r.ttft_seconds for r in first), "wall_s": wall, "saved_prompt_tokens": saved,
            "tokens": [results[r].token_ids for r in rids]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--examples", type=int, default=8)
    p.add_argument("--offset", type=int, default=1200)
    p.add_argument("--configs", default="8:0,8:64", help="BATCH:SHARE,... (SHARE 0 = off)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out")
    args = p.parse_args(argv)
    try:
        configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
        if any(len(c) != 2 or c[0] < 1 or c[1] < 0 for c in configs) or args.examples < 1 or args.rounds < 1 \
                or args.new_tokens < 1:
            raise ValueError
    except ValueError:
        print("share_prefix_ab: --configs must be BATCH:SHARE pairs (e.g. 8:0,8:64), --examples, --rounds and "
              "--new-tokens >= 1", file=sys.stderr)
        return 2
    try:
        bundle = load_model(args.model, dtype=args.dtype)
        ds = get_dataset("gsm8k")
        examples = ds.load(data_request({}, bundle.tokenizer, "r1think"))[args.offset:args.offset + args.examples]
    except SkipKVError as e:
        print(f"share_prefix_ab: {e}", file=sys.stderr)
        return 2
    ids = [prompts.encode(bundle.tokenizer, prompts.render(bundle.tokenizer, ex, "r1think"), "r1think")
           for ex in examples]
    runs: dict[str, list[dict]] = {f"{b}:{s}": [] for b, s in configs}
    for rnd in range(args.rounds):
        for b, s in configs:
            r = run(bundle, ids, b, s, args.new_tokens)
            runs[f"{b}:{s}"].append(r)
            print(f"round {rnd} batch {b} share {s}: first-batch TTFT {r['first_batch_ttft_s']:.1f} s, "
                  f"wall {r['wall_s']:.1f} s, saved {r['saved_prompt_tokens']} prompt tokens", flush=True)
    base = runs[f"{configs[0][0]}:{configs[0][1]}"][0]["tokens"]
    rows = []
    for key, rs in runs.items():
        toks = rs[0]["tokens"]
        same = sum(a == b for x, y in zip(toks, base) for a, b in zip(x, y)) / sum(len(x) for x in base)
        rows.append({"config": key, "first_batch_ttft_s": statistics.median(r["first_batch_ttft_s"] for r in rs),
                     "wall_s": statistics.median(r["wall_s"] for r in rs),
                     "saved_prompt_tokens": rs[0]["saved_prompt_tokens"], "tokens_equal_to_first": same,
                     "identical_outputs": sum(x == y for x, y in zip(toks, base))})
    print(f"\n{len(ids)} prompts, {statistics.mean(len(x) for x in ids):.0f} tokens on average, {args.new_tokens} "
          f"new tokens each, {args.dtype}, {torch.get_num_threads()} thread(s)\n")
    print("| batch:share | first-batch TTFT (s) | wall (s) | prompt tokens saved | tokens equal to first | "
          "identical outputs |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['config']} | {r['first_batch_ttft_s']:.1f} | {r['wall_s']:.1f} | {r['saved_prompt_tokens']} | "
              f"{r['tokens_equal_to_first']:.3f} | {r['identical_outputs']}/{len(ids)} |")
    if args.out:
        report = {"args": vars(args), "prompt_tokens": [len(x) for x in ids], "rows": rows,
                  "rounds": {k: [{kk: vv for kk, vv in r.items() if kk != "tokens"} for r in rs]
                             for k, rs in runs.items()},
                  "environment": hardware.environment()}
        write_atomic(Path(args.out), json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
