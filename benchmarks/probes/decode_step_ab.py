"""The decode step's kinds against each other, in one process on one model: the HF modules' step, the fixed-shape
step eager, and the fixed-shape step compiled (engine/step.py, `plan.with_step`), in rotating order.

    python benchmarks/probes/decode_step_ab.py --batch 16 --kinds hf,eager,compiled [--model random:qwen2:0.5b]

Per kind and round a fresh Engine (full cache unless --policy) takes `--batch` ragged prompts of 140-169 random
tokens, runs 8 warm-up steps (the prefill and, compiled, the compiling) and then times `--steps` engine steps;
prints ms per step. Answer recorded in docs/benchmarks.md ("The fixed-shape decode step").
"""

from __future__ import annotations

import argparse
import time

import torch

from skipkv.config import EngineConfig, SamplingParams
from skipkv.engine import Engine
from skipkv.models import load_model
from skipkv.policies import make_policy, parse_policy_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--kinds", default="hf,eager")
    ap.add_argument("--policy", default="full", help="name[:knob=value,...]")
    ap.add_argument("--model", default="random:qwen2:0.5b")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    bundle = load_model(args.model, dtype="auto")
    loaded = bundle.plan
    for rnd in range(args.rounds):
        kinds = args.kinds.split(",")
        for kind in kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]:
            bundle.plan = loaded.with_step(kind)
            policy = make_policy("full") if args.policy == "full" else parse_policy_spec(args.policy)[1]
            eng = Engine(bundle, policy, EngineConfig(batch_size=args.batch))
            g = torch.Generator().manual_seed(1)
            for i in range(args.batch):
                top = min(1000, bundle.model.config.vocab_size)  # a tiny model's vocabulary may be smaller
                ids = torch.randint(0, top, (140 + (i * 7) % 30,), generator=g).tolist()
                eng.add_request(ids, SamplingParams(max_new_tokens=args.steps + 16, ignore_eos=True))
            t0 = time.perf_counter()
            for _ in range(8):
                eng.step()
            warm = time.perf_counter() - t0
            t = time.perf_counter()
            for _ in range(args.steps):
                eng.step()
            ms = (time.perf_counter() - t) / args.steps * 1e3
            print(f"round {rnd} {kind:9s} batch {args.batch}: {ms:.1f} ms/step (warm-up {warm:.1f} s)", flush=True)
            eng.close()


if __name__ == "__main__":
    main()
