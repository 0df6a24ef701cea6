"""Where one decode step's time goes at batch 1: linears, attention, norms, rotary, MLP activation, sampling and
the engine's own Python, from torch.profiler over N steps of a full-cache request on the real model.

    skipkv bench profile-step [--model qwen2.5-coder-0.5b-instruct] [--steps 32] [--out FILE.json]
    skipkv bench profile-step --batch 64 --prompt-tokens 512 --policy rkv:budget=256,interval=32 \
        --warmup 40 --steps 64          # a compressing policy in its steady state (a compression row is added)
    skipkv bench profile-step ... --top 25                   # and the aten ops with the most self time

(`python benchmarks/profile_step.py ...`, the docs' older command, is the same.)

--prompt-tokens N replaces the GSM8K question by N random tokens (the synthetic workload's generator);
--policy takes a `name[:knob=value,...]` spec; --warmup is the steps run before any timing (prefill included).

Each module class gets a profiler range through forward hooks (installed by this script only: nothing in the
library is changed or patched), and a range around the whole model forward; what `Engine.step()` spends outside
the model forward (scheduling, memory accounting, the store append, sampling, detokenisation) is its own row.
"attention (core)" is the attention modules' time minus the q/k/v/o linears inside them: the rotary apply, the
store write and the attention backend. Times are CPU wall time inside each range (children included, nested
ranges subtracted as described), summed over the profiled steps and divided by their count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from skipkv.config import EngineConfig, SamplingParams
from skipkv.engine import Engine
from skipkv.hardware import environment, set_threads
from skipkv.models import load_model
from skipkv.policies import parse_policy_spec

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")


def label_of(module: torch.nn.Module) -> str | None:
    name = type(module).__name__
    # FusedLinear: a packed layer's q/k/v or gate/up product (its LinearParts only slice it)
    if isinstance(module, torch.nn.Linear) or name in ("PackedLinear", "FusedLinear", "UpcastLinear",
                                                       "TransposedLinear"):
        return "linear"
    if name.endswith("RMSNorm"):
        return "norm"
    if name.endswith("RotaryEmbedding"):
        return "rotary (cos/sin)"
    if name.endswith("Attention"):
        return "attention module"
    if name.endswith("MLP"):
        return "mlp module"
    if hasattr(module, "layers") and hasattr(module, "embed_tokens"):  # the decoder stack (the engine calls it and
        return "model forward"                                          # the LM head itself, for the last rows only)
    if "Activation" in name or name in ("SiLU", "SiLUActivation", "GELUActivation"):
        return "mlp activation"
    return None


def install_ranges(model: torch.nn.Module) -> list:
    handles = []
    for module in model.modules():
        label = label_of(module)
        if label is None:
            continue

        def pre(mod, args, label=label):
            mod._prof_range = record_function(f"step/{label}")
            mod._prof_range.__enter__()

        def post(mod, args, out):
            mod._prof_range.__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def run(args: argparse.Namespace) -> int:
    """`skipkv bench profile-step`: the table on stdout, the JSON at --out."""
    threads = set_threads(args.threads)
    bundle = load_model(args.model, dtype=args.dtype)
    tok = bundle.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                     add_generation_prompt=True)
    prompts: list = [prompt] * args.batch
    if args.prompt_tokens:
        from skipkv.bench.throughput import make_workload

        prompts = make_workload(f"synthetic:{args.prompt_tokens}x1", bundle, args.batch, 0, None).prompts
    policy = parse_policy_spec(args.policy)[1]
    eng = Engine(bundle, policy, EngineConfig(batch_size=args.batch))
    for p in prompts:
        eng.add_request(p, SamplingParams(max_new_tokens=args.warmup + args.steps + 40, ignore_eos=True))
    for _ in range(args.warmup):  # prefill + warm-up steps
        eng.step()
    plain = []
    for _ in range(8):  # unhooked step time, for the hooks' own cost
        t0 = time.perf_counter()
        eng.step()
        plain.append(time.perf_counter() - t0)
    first = eng.step().stats
    assert first is not None  # a step that ran carries its stats
    compress0 = first.compress_seconds
    handles = install_ranges(bundle.model)
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            with record_function("step/engine.step"):
                out = eng.step()
            walls.append(time.perf_counter() - t0)
    assert out.stats is not None
    compress_ms = (out.stats.compress_seconds - compress0) * 1e3
    for h in handles:
        h.remove()
    eng.close()
    total: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.name.startswith("step/"):
            total[ev.name[5:]] += ev.cpu_time_total / 1e3  # ms, children included
    n = args.steps
    per = {k: v / n for k, v in total.items()}
    # Linears inside attention vs inside the MLP / the LM head are told apart by nesting: subtract what nests.
    lin_in_attn = lin_in_mlp = act = 0.0
    for ev in prof.events():
        if ev.name == "step/linear" or ev.name == "step/mlp activation":
            parents = []
            p = ev.cpu_parent
            while p is not None:
                parents.append(p.name)
                p = p.cpu_parent
            if ev.name == "step/linear" and "step/attention module" in parents:
                lin_in_attn += ev.cpu_time_total / 1e3 / n
            elif ev.name == "step/linear" and "step/mlp module" in parents:
                lin_in_mlp += ev.cpu_time_total / 1e3 / n
            elif ev.name == "step/mlp activation":
                act += ev.cpu_time_total / 1e3 / n
    step_ms = per["engine.step"]
    model_ms = per["model forward"]
    rows = {
        "linears: q/k/v/o (attention)": lin_in_attn,
        "linears: MLP gate/up/down": lin_in_mlp,
        "linear: LM head": per["linear"] - lin_in_attn - lin_in_mlp,
        "attention core (rotary apply, store write, attention)": per["attention module"] - lin_in_attn,
        "MLP activation and gate product": per["mlp module"] - lin_in_mlp,
        "norms (RMSNorm)": per["norm"],
        "rotary cos/sin": per.get("rotary (cos/sin)", 0.0),
    }
    inside = sum(v for k, v in rows.items() if k != "linear: LM head")
    rows["decoder: rest (embedding, residual adds, glue)"] = model_ms - inside
    # Compression (the policy's scoring and the store's eviction) runs inside engine.step(), outside the model
    # forward; its time comes from the engine's own counter: after the step before profiling, after the last
    # profiled step.
    rows["compression (policy scoring, eviction)"] = compress_ms / n
    rows["engine outside decoder and LM head (scheduling, KV accounting, sampling, Python)"] = (
        step_ms - model_ms - rows["linear: LM head"] - rows["compression (policy scoring, eviction)"])
    print(f"{f'part of one decode step (batch {args.batch})':72s} {'ms':>8s} {'share':>7s}")
    for k, v in rows.items():
        print(f"{k:72s} {v:8.2f} {v / step_ms:7.1%}")
    print(f"{'engine.step() under the profiler':72s} {step_ms:8.2f}")
    top = []
    if args.top:
        ops = [e for e in prof.key_averages() if not e.key.startswith("step/")]
        ops.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
        top = [{"op": e.key, "calls_per_step": e.count / n, "self_ms_per_step": e.self_cpu_time_total / 1e3 / n}
               for e in ops[:args.top]]
        print(f"{'aten op (self CPU time)':60s} {'calls/step':>10s} {'ms/step':>8s}")
        for t in top:
            print(f"{t['op'][:60]:60s} {t['calls_per_step']:10.1f} {t['self_ms_per_step']:8.2f}")
    print(f"step wall without hooks/profiler: median {statistics.median(plain) * 1e3:.2f} ms; "
          f"with: median {statistics.median(walls) * 1e3:.2f} ms ({threads} threads, {bundle.dtype})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "dtype": str(bundle.dtype), "threads": threads, "steps": n,
                       "batch": args.batch, "policy": args.policy,
                       "prompt_tokens": args.prompt_tokens, "warmup": args.warmup,
                       "rows_ms": rows, "top_ops": top, "step_ms_profiled": step_ms,
                       "step_ms_plain_median": statistics.median(plain) * 1e3,
                       "environment": environment(bundle.dtype_choice)}, f, indent=1)
    return 0

