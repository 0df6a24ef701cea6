"""The unpadded prefill (EngineConfig.unpad_prefill) against the padded one on the real model: do the greedy
tokens stay the same, and how much sooner does the first token come?

    python benchmarks/probes/unpad_ab.py --examples 16 --new-tokens 128 --rounds 2 \
        --out docs/results/unpad/unpad_ab_gsm8k16.json

Prompts: the first `--examples` GSM8K test questions in the chat template (the vLLM comparison's workload), all
admitted together, so their prefill is one forward over rows right-padded to the longest. Full cache, greedy,
`ignore_eos`. A round runs padded then unpadded (or the reverse, alternating), so drift on a shared machine hits
both alike. Reported: time to the first token (the prefill), whole-run wall time, and per prompt whether the
unpadded run's tokens equal the padded run's (in bf16 an MLP over the real rows alone may round a row
differently, as another batch would; a near-tie can then flip a token and the rest of that chain).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from skipkv import SamplingParams, generate, hardware, load_model, make_policy
from skipkv.config import EngineConfig
from skipkv.eval import prompts
from skipkv.eval.data import data_request
from skipkv.eval.datasets import get_dataset
from skipkv.outputs import write_atomic


def run(bundle, ids: list[list[int]], unpad: bool, new_tokens: int) -> dict:
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    results = generate(bundle, ids, sp, make_policy("full"), EngineConfig(batch_size=len(ids), unpad_prefill=unpad))
    wall = time.perf_counter() - t0
    return {"ttft_s": max(r.ttft_seconds for r in results), "wall_s": wall, "tokens": [r.token_ids for r in results]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--examples", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: one per core)")
    args = p.parse_args(argv)
    threads = hardware.set_threads(args.threads)
    bundle = load_model(args.model, dtype=args.dtype)
    request = data_request({}, bundle.tokenizer, "chat")
    examples = get_dataset("gsm8k").load(request)[:args.examples]
    ids = [prompts.encode(bundle.tokenizer, prompts.render(bundle.tokenizer, ex, "chat"), "chat") for ex in examples]
    run(bundle, [x[:16] for x in ids[:2]], True, 4)  # warm-up: kernels and allocator
    runs: dict[str, list[dict]] = {"padded": [], "unpadded": []}
    for i in range(args.rounds):
        order = [False, True] if i % 2 == 0 else [True, False]
        for unpad in order:
            r = run(bundle, ids, unpad, args.new_tokens)
            runs["unpadded" if unpad else "padded"].append(r)
            print(f"round {i} {'unpadded' if unpad else 'padded'}: first token {r['ttft_s']:.2f} s, "
                  f"wall {r['wall_s']:.2f} s", flush=True)
    base = runs["padded"][0]["tokens"]
    same = [a == b for a, b in zip(base, runs["unpadded"][0]["tokens"])]
    first_diff = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                  for a, b in zip(base, runs["unpadded"][0]["tokens"])]
    summary = {arm: {"ttft_s_median": statistics.median(r["ttft_s"] for r in rs),
                     "wall_s_median": statistics.median(r["wall_s"] for r in rs),
                     "ttft_s": [r["ttft_s"] for r in rs], "wall_s": [r["wall_s"] for r in rs]}
               for arm, rs in runs.items()}
    summary["prompts_with_equal_tokens"] = f"{sum(same)}/{len(same)}"
    summary["first_differing_token"] = first_diff
    summary["padded_repeatable"] = all(r["tokens"] == base for r in runs["padded"])
    summary["prompt_tokens"] = [len(x) for x in ids]
    print(json.dumps({k: v for k, v in summary.items() if k != "prompt_tokens"}))
    out = {"args": vars(args), "summary": summary, "dtype": str(bundle.dtype).removeprefix("torch."),
           "threads": threads,
           "environment": hardware.environment(bundle.dtype_choice)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(args.out), json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
