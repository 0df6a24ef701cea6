"""Build one workload both engines run, as token ids (so both see exactly the same prompts).

    python benchmarks/vllm_anchor/workload.py --workload gsm8k --requests 16 --max-tokens 128 --out /tmp/w.json
    python benchmarks/vllm_anchor/workload.py --workload synthetic:128x4096 --requests 64 --out /tmp/w.json

gsm8k: the first N GSM8K test questions in the model's chat template (the eval harness's prompts);
synthetic:PxO: random-token prompts of P tokens and O new tokens (skipkv bench throughput's generator, same seed).
Every request is greedy with `ignore_eos`: exactly --max-tokens (or O) new tokens each.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from skipkv.bench.throughput import make_workload
from skipkv.models import load_model
from skipkv.models.recipes import RECIPES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="a pulled model name or a model folder")
    ap.add_argument("--workload", default="gsm8k")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, help="new tokens per request (default: the workload's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    folder = str(RECIPES[args.model].folder()) if args.model in RECIPES else args.model
    bundle = load_model(args.model, dtype="fp32")  # only the tokenizer and config are used
    work = make_workload(args.workload, bundle, args.requests, args.seed, args.max_tokens)
    max_tokens = args.max_tokens or work.sampling[0].max_new_tokens
    spec = {"model": args.model, "model_dir": folder, "workload": args.workload, "requests": args.requests,
            "max_tokens": max_tokens, "seed": args.seed, "prompt_ids": work.prompts}
    Path(args.out).write_text(json.dumps(spec))
    lens = [len(p) for p in work.prompts]
    print(f"{args.out}: {len(lens)} prompts of {min(lens)}-{max(lens)} tokens, {max_tokens} new tokens each")


if __name__ == "__main__":
    main()
