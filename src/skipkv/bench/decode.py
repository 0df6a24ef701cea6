"""Decode-step benchmark: per-step time and KV memory as generation grows, one policy against another.

    skipkv bench decode --model random:qwen2:0.5b --policies full,rkv --budget 256 --interval 128 \
        --lengths 256,1024,4096 --out docs/bench_decode.json

For each policy the same prompt is prefilled and decoded with `ignore_eos` up to the longest length. The
step time at length L is the median of the steps in (L - span, L] that did not compress (so it is the cost of
attention over the cache actually held); compression time is reported apart, as a share of decode time.
Ratios between policies come from the same run, since this machine is shared and noisy.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from skipkv.attention import attention_backend
from skipkv.config import SamplingParams
from skipkv.engine import _requests
from skipkv.engine.runner import ModelRunner


@dataclass
class PolicyRun:
    policy: str
    step_ms: dict[int, float] = field(default_factory=dict)  # generated length -> median step time
    kv_tokens: dict[int, int] = field(default_factory=dict)  # generated length -> entries held per head
    peak_kv_bytes: int = 0
    allocated_peak_bytes: int = 0
    decode_s: float = 0.0
    compress_s: float = 0.0
    compressions: int = 0
    tokens_per_s: float = 0.0


def bench_policy(bundle, policy, prompt: str, lengths: list[int], batch_size: int, span: int) -> PolicyRun:
    total = max(lengths)
    sp = SamplingParams(max_new_tokens=total, ignore_eos=True)
    reqs = _requests(bundle, [prompt] * batch_size, sp, policy)
    runner = ModelRunner(bundle, policy, num_slots=batch_size)
    times: list[float] = []
    compressed: list[bool] = []
    held: list[int] = []
    run = PolicyRun(policy=type(policy).__name__)
    with attention_backend(bundle.model), torch.inference_mode():
        for r, t in zip(reqs, runner.prefill(reqs)):
            r.output_ids.append(t)
        for _ in range(total - 1):
            before = reqs[0].compressions
            t0 = time.perf_counter()
            toks = runner.decode()
            times.append(time.perf_counter() - t0)
            compressed.append(reqs[0].compressions > before)
            held.append(int(runner.store.lengths[0, 0]))
            for r, t in zip(runner.running, toks):
                r.output_ids.append(t)
    for L in lengths:
        # step i (0-based) produced generated token i + 2; take the steps ending at length L
        lo, hi = max(0, L - 1 - span), L - 1
        window = [t for t, c in zip(times[lo:hi], compressed[lo:hi]) if not c]
        run.step_ms[L] = 1000 * statistics.median(window)
        run.kv_tokens[L] = held[hi - 1]
    run.peak_kv_bytes = max(r.peak_kv_bytes for r in reqs)
    run.allocated_peak_bytes = runner.store.peak_allocated
    run.decode_s = sum(times)
    run.compress_s = sum(r.compress_seconds for r in reqs)
    run.compressions = reqs[0].compressions
    run.tokens_per_s = batch_size * len(times) / run.decode_s
    return run


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def format_table(runs: list[PolicyRun], lengths: list[int]) -> str:
    head = "| policy | " + " | ".join(f"step ms @{L}" for L in lengths) + " | KV entries @max | peak KV MiB | compress share | tok/s |"
    sep = "|" + "---|" * (len(lengths) + 5)
    rows = [head, sep]
    for r in runs:
        share = r.compress_s / r.decode_s if r.decode_s else 0.0
        rows.append(f"| {r.policy} | " + " | ".join(f"{r.step_ms[L]:.1f}" for L in lengths)
                    + f" | {r.kv_tokens[max(lengths)]} | {r.peak_kv_bytes / 2**20:.1f} | {100 * share:.1f}% | {r.tokens_per_s:.2f} |")
    return "\n".join(rows)


def run_bench(model: str, policies: list[str], lengths: list[int], budget: int, interval: int, window: int,
              batch_size: int, dtype: str, span: int, out: str | None) -> dict:
    from skipkv.models import load_model
    from skipkv.policies import make_policy

    bundle = load_model(model, dtype=dtype)
    prompt = "Solve step by step: a train leaves at noon at 60 km/h; when has it covered 150 km?"
    runs = []
    for name in policies:
        knobs = {} if name == "full" else dict(budget=budget, interval=interval, window=window)
        runs.append(bench_policy(bundle, make_policy(name, **knobs), prompt, lengths, batch_size, span))
        print(f"{name}: done", flush=True)
    table = format_table(runs, lengths)
    print(table)
    report = {"model": model, "dtype": dtype, "batch_size": batch_size, "budget": budget, "interval": interval,
              "window": window, "lengths": lengths, "span": span, "machine": machine(),
              "runs": [r.__dict__ for r in runs], "table": table}
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2))
    return report
