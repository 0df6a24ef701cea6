"""The greedy pick over a batch-64 block of bf16 logits (Qwen2.5's 151,936-token vocabulary): the fp32 copy and
argmax the sampler used to take, against `max(dim=-1).indices` on the logits as they are (engine/sampler.py's
`greedy_tokens`). Both give the first index of each row's largest value. Random logits; ms per call, 2 threads.

    python benchmarks/probes/greedy_pick.py [--batch 64] [--vocab 151936] [--threads 2]

With --engine, the same two picks in whole decode steps of the real model: 64 requests of 300 synthetic prompt
tokens under R-KV (budget 256, interval 32), one process, alternating blocks of --block steps (each holds one
compression at interval 32) between the old pick and the new; prints and (--out) writes the ms per step of each.

    python benchmarks/probes/greedy_pick.py --engine --rounds 4 [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import skipkv.engine.sampler as sampler
from skipkv.engine.sampler import greedy_tokens


def timed(name: str, fn, n: int = 30) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    ms = (time.perf_counter() - t0) / n * 1e3
    print(f"{name:36s} {ms:7.2f} ms")
    return ms


def old_pick(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().argmax(dim=-1)  # what the sampler did before, after an fp32 copy of every row


def engine_ab(args) -> None:
    from skipkv.bench.throughput import make_workload
    from skipkv.config import EngineConfig, SamplingParams
    from skipkv.engine import Engine
    from skipkv.hardware import environment
    from skipkv.models import load_model
    from skipkv.policies import parse_policy_spec

    bundle = load_model(args.model, dtype="auto")
    prompts = make_workload("synthetic:300x1", bundle, args.batch, 0, None).prompts
    spec = "rkv:budget=256,interval=32"
    eng = Engine(bundle, parse_policy_spec(spec)[1], EngineConfig(batch_size=args.batch))
    steps = 10 + 2 * args.rounds * args.block
    for p in prompts:
        eng.add_request(p, SamplingParams(max_new_tokens=steps + 8, ignore_eos=True))
    for _ in range(10):  # prefill, first compressions
        eng.step()
    ms: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
            sampler.greedy_tokens = old_pick if name == "before" else greedy_tokens
            t0 = time.perf_counter()
            for _ in range(args.block):
                eng.step()
            ms[name].append((time.perf_counter() - t0) / args.block * 1e3)
            print(f"round {r} {name:6s} {ms[name][-1]:7.1f} ms/step", flush=True)
    sampler.greedy_tokens = greedy_tokens
    eng.close()
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(f"median ms/step: before {med['before']:.1f}, after {med['after']:.1f}; "
          f"before/after {med['before'] / med['after']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "policy": spec, "batch": args.batch, "prompt_tokens": 300,
                       "block_steps": args.block, "rounds": args.rounds, "ms_per_step": ms, "median_ms": med,
                       "before_over_after": med["before"] / med["after"], "environment": environment()}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", action="store_true", help="A/B the two picks in whole decode steps")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        engine_ab(args)
        return
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(greedy_tokens(logits), logits.float().argmax(dim=-1))
    for _ in range(3):  # alternating, so load elsewhere hits both alike
        old = timed("float() then argmax (before)", lambda: logits.float().argmax(dim=-1))
        new = timed("greedy_tokens (bf16 max indices)", lambda: greedy_tokens(logits))
        print(f"  ratio {old / new:.2f}x")


if __name__ == "__main__":
    main()
