"""Per-step decode time at batch 1: one `Engine.step()` (full cache) against one transformers forward with its
own `DynamicCache` plus the greedy pick, same prompt, same model, interleaved rounds, medians over steps.

    OMP_NUM_THREADS=1 python benchmarks/decode_step_vs_hf.py [--model qwen2.5-coder-0.5b-instruct] [--dtype fp32]

Whole-run tokens/s (`skipkv bench throughput --hf-reference`) mixes prefill, first-call costs and whatever
else the machine does during a 15 s run; the median of ~60 step times per round is far less sensitive to
that, so this is the figure that says whether the engine's decode loop costs more than transformers' own.
The engine's step includes everything it does per token: scheduling, memory accounting, the store append,
the attention backend, the LM head and sampling.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from skipkv.config import EngineConfig, SamplingParams
from skipkv.engine import Engine
from skipkv.models import load_model
from skipkv.policies import make_policy

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")


def engine_steps(bundle, ids: list[int], n: int) -> list[float]:
    eng = Engine(bundle, make_policy("full"), EngineConfig(batch_size=1))
    try:
        eng.add_request(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
        times = []
        while eng.has_unfinished():
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
    finally:
        eng.close()
    return times[1:]  # the first step is the prefill


def hf_steps(bundle, ids: list[int], n: int) -> list[float]:
    model = bundle.model
    times = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor([ids], device=bundle.device), cache=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(n - 1):
            t = time.perf_counter()
            out = model(input_ids=nxt, cache=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            nxt.item()  # the host reads the token, as the engine's sampler does
            times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    bundle = load_model(args.model, dtype=args.dtype)
    tok = bundle.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True)
    ids = tok(text)["input_ids"]
    engine_steps(bundle, ids, 8), hf_steps(bundle, ids, 8)  # warm-up
    ratios = []
    print(f"{args.model} {args.dtype}, prompt {len(ids)} tokens, {args.tokens} new, torch threads {torch.get_num_threads()}")
    print("| round | engine step p50 ms | transformers step p50 ms | transformers / engine |\n|---|---:|---:|---:|")
    for i in range(args.rounds):
        e = statistics.median(engine_steps(bundle, ids, args.tokens))
        h = statistics.median(hf_steps(bundle, ids, args.tokens))
        ratios.append(h / e)
        print(f"| {i + 1} | {e * 1e3:.1f} | {h * 1e3:.1f} | {h / e:.3f} |", flush=True)
    print(f"median transformers / engine step time: {statistics.median(ratios):.3f} (> 1: the engine is faster)")


if __name__ == "__main__":
    main()
