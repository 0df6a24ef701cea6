"""Decode-step benchmark: per-step time and KV memory as generation grows, one policy against another.

    skipkv bench decode --model random:qwen2:0.5b --policies full,rkv --budget 256 --interval 128 \
        --lengths 256,1024,4096 --out docs/bench_decode.json

For each policy the same prompt is prefilled and decoded with `ignore_eos` up to the longest length, all
policies in lockstep (one decode step of each in turn). The
step time at length L is the median of the steps in (L - span, L] that did not compress (so it is the cost of
attention over the cache actually held); compression time is reported apart, as a share of decode time.
Ratios between policies come from the same run and the same moments, since this machine is shared and noisy.
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
from skipkv.engine import make_requests
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


class _Lane:
    """One policy's requests and runner, stepped in lockstep with the other policies' lanes."""

    def __init__(self, bundle, policy, prompt: str, total: int, batch_size: int) -> None:
        sp = SamplingParams(max_new_tokens=total, ignore_eos=True)
        self.reqs = make_requests(bundle, [prompt] * batch_size, sp, policy)
        self.runner = ModelRunner(bundle, policy, num_slots=batch_size)
        self.run = PolicyRun(policy=type(policy).__name__)
        self.times: list[float] = []
        self.compressed: list[bool] = []
        self.held: list[int] = []

    def prefill(self) -> None:
        for r, t in zip(self.reqs, self.runner.prefill(self.reqs)):
            r.output_ids.append(t)

    def step(self) -> None:
        before = self.reqs[0].compressions
        t0 = time.perf_counter()
        toks = self.runner.decode()
        self.times.append(time.perf_counter() - t0)
        self.compressed.append(self.reqs[0].compressions > before)
        self.held.append(int(self.runner.store.lengths[0, 0]))
        for r, t in zip(self.runner.running, toks):
            r.output_ids.append(t)

    def finish(self, lengths: list[int], span: int) -> PolicyRun:
        run, times = self.run, self.times
        for L in lengths:
            # decode step i (0-based) brings the request to i + 2 generated tokens; take the steps ending at L
            lo, hi = max(0, L - 1 - span), L - 1
            window = [t for t, c in zip(times[lo:hi], self.compressed[lo:hi]) if not c]
            run.step_ms[L] = 1000 * statistics.median(window)
            run.kv_tokens[L] = self.held[hi - 1]
        run.peak_kv_bytes = max(r.peak_kv_bytes for r in self.reqs)
        run.allocated_peak_bytes = self.runner.store.peak_allocated
        run.decode_s = sum(times)
        run.compress_s = sum(r.compress_seconds for r in self.reqs)
        run.compressions = self.reqs[0].compressions
        run.tokens_per_s = len(self.reqs) * len(times) / run.decode_s
        return run


def bench_policies(bundle, policies: list, prompt: str, lengths: list[int], batch_size: int, span: int) -> list[PolicyRun]:
    """Decode every policy's requests in lockstep (one step of each in turn), so that load from elsewhere on a
    shared machine hits all policies alike and their ratios stay meaningful."""
    total = max(lengths)
    lanes = [_Lane(bundle, p, prompt, total, batch_size) for p in policies]
    with attention_backend(bundle.model), torch.inference_mode():
        for lane in lanes:
            lane.prefill()
        for _ in range(total - 1):
            for lane in lanes:
                lane.step()
    return [lane.finish(lengths, span) for lane in lanes]


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
    made = [make_policy(n) if n == "full" else make_policy(n, budget=budget, interval=interval, window=window)
            for n in policies]
    runs = bench_policies(bundle, made, prompt, lengths, batch_size, span)
    table = format_table(runs, lengths)
    print(table)
    report = {"model": model, "dtype": dtype, "batch_size": batch_size, "budget": budget, "interval": interval,
              "window": window, "lengths": lengths, "span": span, "machine": machine(),
              "runs": [r.__dict__ for r in runs], "table": table}
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2))
    return report
