"""The device check behind benchmarks/gpu.sh: one process, one model load, four parts, JSON into --out.

    python benchmarks/gpu_run.py --size 7b --device cuda --out $OUT       # on a lent H200 (via gpu.sh)
    python benchmarks/gpu_run.py --size tiny --device cpu --out /tmp/g     # the CPU-sized variant

1. exact: the engine at the full cache equals transformers' greedy generate token for token on the device
   (tiny model in fp64, a ragged batch of 4), and, informative only, how many of 32 greedy tokens agree on
   the big shape in bf16 (bf16 kernels round differently, so a late divergence is not a bug).
2. syncs: host syncs per decode step, counted with torch.cuda.set_sync_debug_mode("warn") over decode steps
   of 4 running requests (expected: 1, the sampler reading the tokens; SkipKV 2, its sentence tracker's one
   copy of the step's hidden states to the host). CUDA only.
3. speed: engine (full cache) vs transformers' generate at batch 1 and 8, synthetic 128 in / 128 out, after a
   warm-up of both at that batch; on CUDA
   transformers also runs under the engine's SDPA backends (kernels.cuda_sdpa_backends: cuDNN excluded).
4. throughput: `skipkv bench throughput` at the paper's setting (budget 512) on synthetic 128x4096 and
   128x16384 under one fixed KV memory, each policy cut after --seconds (steady-state rates).
Nothing is downloaded: random weights in the real shape (random:qwen2:7b = R1-Distill-Qwen-7B's shape).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from skipkv import SamplingParams, generate, make_policy
from skipkv.bench.throughput import Workload, make_workload, run_bench, run_engine, run_hf
from skipkv.config import EngineConfig, parse_bytes
from skipkv.engine import Engine, encode_prompt
from skipkv.kernels import cuda_sdpa_backends
from skipkv.models import load_model

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived a", "2 + 2 =",
           "In the beginning the Universe was created. This has made a lot of people very angry"]
SIZES = {  # model, dtype, outputs, requests, KV memory, budget, seconds per run
    "7b": dict(model="random:qwen2:7b", outputs=(4096, 16384), requests=128, kv_memory="9GiB", budget=512),
    "tiny": dict(model="random:qwen2", outputs=(64, 256), requests=16, kv_memory="160KiB", budget=40),
}


def hf_greedy(bundle, prompt: str, n: int) -> list[int]:
    ids = torch.tensor([encode_prompt(bundle.tokenizer, prompt)], device=bundle.device)
    out = bundle.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                min_new_tokens=n, pad_token_id=bundle.tokenizer.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def check_exact(device: str, big) -> dict:
    tiny = load_model("random:qwen2", dtype="fp64", device=device)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    got = generate(tiny, PROMPTS, sp, make_policy("full"), EngineConfig(batch_size=4))
    exact = all(r.token_ids == hf_greedy(tiny, p, 24) for p, r in zip(PROMPTS, got))
    mine = generate(big, PROMPTS[1:2], SamplingParams(max_new_tokens=32, ignore_eos=True))[0].token_ids
    # transformers under the SDPA backends the engine runs (cuDNN excluded on CUDA): the like-for-like reference;
    # under torch's own pick (cuDNN) a random-weight model's near-tied logits flipped the very first token
    with big.plan.sdpa_context():
        ref = hf_greedy(big, PROMPTS[1], 32)
    agree = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), len(ref))
    return {"tiny_fp64_full_equals_hf_greedy": exact, "big_bf16_greedy_tokens_agreeing_of_32": agree,
            **replayed_equals_eager(device)}


def replayed_equals_eager(device: str) -> dict:
    """The fixed step replayed (engine/graphs.py: CUDA graphs on CUDA) against the same step eager, on the tiny
    model in fp32: the same greedy tokens, per policy (ragged rows, batch 4, compression for rkv)."""
    tiny = load_model("random:qwen2", dtype="fp32", device=device)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    out, loaded = {}, tiny.plan
    for policy in ("full", "rkv"):
        tokens = {}
        for kind in ("eager", "graph"):
            tiny.plan = loaded.with_step(kind)
            got = generate(tiny, PROMPTS, sp, make_policy(policy, **({"budget": 16} if policy == "rkv" else {})),
                           EngineConfig(batch_size=4))
            tokens[kind] = [r.token_ids for r in got]
        tiny.plan = loaded
        out[f"tiny_fp32_{policy}_graph_equals_eager"] = tokens["graph"] == tokens["eager"]
    return out


def count_syncs(bundle, policy: str = "full") -> dict:
    if bundle.device.type != "cuda":
        return {"skipped": "not CUDA"}
    eng = Engine(bundle, make_policy(policy), EngineConfig())
    try:
        for p in PROMPTS:
            eng.add_request(p, SamplingParams(max_new_tokens=40, ignore_eos=True))
        for _ in range(3):  # prefill + a couple of decode steps first
            eng.step()
        steps = 8
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    eng.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        msgs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    finally:
        eng.close()
    return {"decode_steps": steps, "syncs": len(msgs), "syncs_per_step": len(msgs) / steps,
            "distinct": sorted(set(msgs))[:10]}


def speed(bundle, size: str) -> list[dict]:
    rows = []
    for b in (1, 8):
        work = make_workload("synthetic:128x128" if size == "7b" else "synthetic:16x32", bundle, b)
        # Warm-up at this batch first, both sides (kernels and allocator blocks of these shapes): on the first
        # run the engine at batch 8 was 0.48x transformers while its batch-32 steps took a third of that time.
        short = Workload("warmup", work.prompts, [SamplingParams(max_new_tokens=8, ignore_eos=True)] * b)
        run_engine(bundle, make_policy("full"), short, EngineConfig(batch_size=b), "warmup")
        run_hf(bundle, short, b)
        with bundle.plan.sdpa_context():
            run_hf(bundle, short, b)
        eng = run_engine(bundle, make_policy("full"), work, EngineConfig(batch_size=b), "full")
        hf = run_hf(bundle, work, b)
        row = {"batch": b, "engine_tokens_per_s": eng.tokens_per_s, "hf_tokens_per_s": hf.tokens_per_s,
               "engine_over_hf": eng.tokens_per_s / hf.tokens_per_s}
        backends = cuda_sdpa_backends()[0] if bundle.device.type == "cuda" else ()
        if backends:  # transformers under the engine's SDPA backends too (torch's own pick is cuDNN on Hopper)
            with bundle.plan.sdpa_context():
                row["hf_engine_backends_tokens_per_s"] = run_hf(bundle, work, b).tokens_per_s
            row["engine_over_hf_engine_backends"] = eng.tokens_per_s / row["hf_engine_backends_tokens_per_s"]
        rows.append(row)
        also = f" ({row['hf_engine_backends_tokens_per_s']:.1f} under the engine's SDPA backends)" if backends else ""
        print(f"speed batch {b}: engine {eng.tokens_per_s:.1f} tok/s, transformers {hf.tokens_per_s:.1f} tok/s{also}",
              flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=30.0, help="each throughput run is cut after this long")
    ap.add_argument("--policies", default="full,rkv,snapkv,streaming_llm")
    args = ap.parse_args()
    cfg = SIZES[args.size]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"size": args.size, "device": args.device, "config": cfg}
    t0 = time.perf_counter()
    bundle = load_model(cfg["model"], dtype="bf16", device=args.device)
    report["load_s"] = time.perf_counter() - t0
    print(f"loaded {cfg['model']} on {bundle.device} in {report['load_s']:.0f} s", flush=True)

    def save() -> None:
        (out / "gpu_report.json").write_text(json.dumps(report, indent=2, default=str))

    for part, fn in (("exact", lambda: check_exact(args.device, bundle)), ("syncs", lambda: count_syncs(bundle)),
                     ("syncs_skipkv", lambda: count_syncs(bundle, "skipkv")),
                     ("speed", lambda: speed(bundle, args.size))):
        t = time.perf_counter()
        report[part] = fn()
        report[part + "_s"] = time.perf_counter() - t
        print(part, json.dumps(report[part], default=str), flush=True)
        save()
    policies = [p for p in args.policies.split(",") if p]
    report["throughput"] = {}
    for n_out in cfg["outputs"]:
        name = f"synthetic:128x{n_out}" if args.size == "7b" else f"synthetic:16x{n_out}"
        rep = run_bench(cfg["model"], name, cfg["requests"], policies, parse_bytes(cfg["kv_memory"]),
                        {"budget": cfg["budget"], "window": 8 if args.size == "7b" else 4,
                         "interval": 128 if args.size == "7b" else 8},
                        dtype="bf16", out=str(out / f"throughput_{n_out}.json"), max_seconds=args.seconds,
                        bundle=bundle, prefill_budget=16384)
        report["throughput"][name] = [asdict(r) for r in rep.policies]
        save()
    report["total_s"] = time.perf_counter() - t0
    save()
    print(f"done in {report['total_s']:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
