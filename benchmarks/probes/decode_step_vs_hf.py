"""Per-step decode time at batch 1: one `Engine.step()` (full cache) against one transformers forward with its
own `DynamicCache` plus the greedy pick, same prompt, same model, the two decodes interleaved step by step.

    OMP_NUM_THREADS=1 python benchmarks/probes/decode_step_vs_hf.py [--model qwen2.5-coder-0.5b-instruct] [--dtype fp32]

Whole-run tokens/s (`skipkv bench throughput --hf-reference`) mixes prefill, first-call costs and whatever
else the machine does during a 15 s run; alternating single steps and taking the median of the per-step
ratios is far less sensitive to that (on this shared VM a step's median drifts by 30% between rounds), so
this is the figure that says whether the engine's decode loop costs more than transformers' own.
The engine's step includes everything it does per token: scheduling, memory accounting, the store append,
the attention backend, the LM head and sampling.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from skipkv.attention import BACKEND
from skipkv.config import EngineConfig, SamplingParams
from skipkv.engine import Engine
from skipkv.models import load_model
from skipkv.policies import make_policy

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")


def interleaved_steps(bundle, ids: list[int], n: int) -> tuple[list[float], list[float]]:
    """Decode `n` tokens twice at once, alternating one engine step and one transformers step, so that the
    machine's slow drifts (other tenants, frequency) hit both alike. Returns (engine, transformers) step times.
    While the Engine is open the model runs the skipkv attention backend; each transformers step switches the
    model back to its own attention for that forward (the switch is outside the timing)."""
    model = bundle.model
    theirs = model.config._attn_implementation  # before the Engine routes attention through its backend
    eng = Engine(bundle, make_policy("full"), EngineConfig(batch_size=1))
    e_times, h_times = [], []
    try:
        eng.add_request(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
        eng.step()  # prefill
        with torch.inference_mode():
            model.set_attn_implementation(theirs)
            cache = DynamicCache(config=model.config)
            out = model(input_ids=torch.tensor([ids], device=bundle.device), cache=cache, use_cache=True,
                        logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            model.set_attn_implementation(BACKEND)
            while eng.has_unfinished():
                t = time.perf_counter()
                eng.step()
                e_times.append(time.perf_counter() - t)
                model.set_attn_implementation(theirs)
                t = time.perf_counter()
                out = model(input_ids=nxt, cache=cache, use_cache=True, logits_to_keep=1)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                nxt.item()  # the host reads the token, as the engine's sampler does
                h_times.append(time.perf_counter() - t)
                model.set_attn_implementation(BACKEND)
    finally:
        model.set_attn_implementation(BACKEND)  # as the Engine left it: close() restores `theirs`
        eng.close()
    return e_times, h_times


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
    interleaved_steps(bundle, ids, 8)  # warm-up
    ratios = []
    print(f"{args.model} {args.dtype}, prompt {len(ids)} tokens, {args.tokens} new, "
          f"torch threads {torch.get_num_threads()}")
    print("| round | engine step p50 ms | transformers step p50 ms | transformers / engine (p50 of per-step ratios) |")
    print("|---|---:|---:|---:|")
    for i in range(args.rounds):
        e, h = interleaved_steps(bundle, ids, args.tokens)
        r = statistics.median(b / a for a, b in zip(e, h))
        ratios.append(r)
        print(f"| {i + 1} | {statistics.median(e) * 1e3:.1f} | {statistics.median(h) * 1e3:.1f} | {r:.3f} |",
              flush=True)
    print(f"median over rounds, transformers / engine step time: {statistics.median(ratios):.3f} "
          "(> 1: the engine is faster)")


if __name__ == "__main__":
    main()
