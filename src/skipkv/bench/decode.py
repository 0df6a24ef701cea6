"""Decode-step benchmark: per-step time and KV memory as generation grows, one policy against another.

    skipkv bench decode --model random:qwen2:0.5b --policies full,rkv --budget 256 --interval 128 \
        --lengths 256,1024,4096 --out docs/bench_decode.json

For each policy the same prompt is prefilled and decoded with `ignore_eos` up to the longest length, all
policies in lockstep (one decode step of each in turn). The
step time at length L is the median of the steps in (L - span, L] that did not compress (so it is the cost of
attention over the cache actually held); compression time is reported apart, as a share of decode time.
Ratios between policies come from the same run and the same moments, since this machine is shared and noisy.
A policy may carry knobs (`laprox:granularity=head,budget_ratio=0.5`; separate such specs with ";"), and
`--prompt-tokens N` replaces the short built-in question by an N-token prompt (the question repeated), for
prefill-compressing policies. Head-ragged vs uniform at equal kept tokens (docs/benchmarks.md):

    skipkv bench decode --model qwen2.5-coder-0.5b-instruct --threads 1 --prompt-tokens 2048 --lengths 64,128 \
        --policies "laprox:budget_ratio=0.25;laprox:budget_ratio=0.25,granularity=head"
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field

import torch

from skipkv.config import MAX_TOKENS, TOKENS_WHY, SamplingParams, check_fields, knob
from skipkv.engine import make_requests
from skipkv.engine.runner import ModelRunner
from skipkv.errors import SkipKVError
from skipkv.models.patches import routed
from skipkv.outputs import check_file, write_atomic

QUESTION = "Solve step by step: a train leaves at noon at 60 km/h; when has it covered 150 km?"


@dataclass
class PolicyRun:
    policy: str
    step_ms: dict[int, float | None] = field(default_factory=dict)  # generated length -> median step time
    kv_tokens: dict[int, int] = field(default_factory=dict)  # generated length -> entries held per head
    peak_kv_bytes: int = 0
    allocated_peak_bytes: int = 0
    decode_s: float = 0.0
    compress_s: float = 0.0
    compressions: int = 0
    tokens_per_s: float = 0.0


class _Lane:
    """One policy's requests and runner, stepped in lockstep with the other policies' lanes."""

    def __init__(self, bundle, label: str, policy, prompt: str | list[int], total: int, batch_size: int) -> None:
        sp = SamplingParams(max_new_tokens=total, ignore_eos=True)
        self.reqs = make_requests(bundle, [prompt] * batch_size, sp, policy)
        self.runner = ModelRunner(bundle, policy, num_slots=batch_size)
        self.run = PolicyRun(policy=label)
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
        # entries per kv head, the mean over layers and heads (layers and heads may keep different counts)
        store = self.runner.store
        self.held.append(round(float(store.lengths[:, 0].sum()) / store.num_layers))
        for r, t in zip(self.runner.running, toks):
            r.output_ids.append(t)

    def finish(self, lengths: list[int], span: int) -> PolicyRun:
        run, times = self.run, self.times
        for L in lengths:
            # decode step i (0-based) brings the request to i + 2 generated tokens; take the steps ending at L
            lo, hi = max(0, L - 1 - span), L - 1
            window = [t for t, c in zip(times[lo:hi], self.compressed[lo:hi]) if not c]
            # every step in the span compressed (interval 1): no plain step to time at this length
            run.step_ms[L] = 1000 * statistics.median(window) if window else None
            run.kv_tokens[L] = self.held[hi - 1]
        run.peak_kv_bytes = max(r.peak_kv_bytes for r in self.reqs)
        run.allocated_peak_bytes = self.runner.store.peak_allocated
        run.decode_s = sum(times)
        run.compress_s = sum(r.compress_seconds for r in self.reqs)
        run.compressions = self.reqs[0].compressions
        run.tokens_per_s = len(self.reqs) * len(times) / run.decode_s
        return run


def bench_policies(bundle, policies: list, prompt: str | list[int], lengths: list[int], batch_size: int,
                   span: int, labels: list[str] | None = None, progress: bool = False) -> list[PolicyRun]:
    """Decode every policy's requests in lockstep (one step of each in turn), so that load from elsewhere on a
    shared machine hits all policies alike and their ratios stay meaningful. `progress`: a bar of decode steps
    on stderr."""
    from tqdm import tqdm

    total = max(lengths)
    labels = labels or [type(p).__name__ for p in policies]
    lanes = [_Lane(bundle, n, p, prompt, total, batch_size) for n, p in zip(labels, policies)]
    with routed(bundle.model), torch.inference_mode():
        for lane in lanes:
            lane.prefill()
        for _ in tqdm(range(total - 1), desc="decode steps", unit="step", disable=not progress, dynamic_ncols=True):
            for lane in lanes:
                lane.step()
    return [lane.finish(lengths, span) for lane in lanes]


def format_table(runs: list[PolicyRun], lengths: list[int]) -> str:
    head = ("| policy | " + " | ".join(f"step ms @{L}" for L in lengths)
            + " | KV entries @max | peak KV MiB | compress share | tok/s |")
    sep = "|" + "---|" * (len(lengths) + 5)
    rows = [head, sep]
    for r in runs:
        share = r.compress_s / r.decode_s if r.decode_s else 0.0
        steps = " | ".join("n/a" if r.step_ms[L] is None else f"{r.step_ms[L]:.1f}" for L in lengths)
        rows.append(f"| {r.policy} | {steps} | {r.kv_tokens[max(lengths)]} | {r.peak_kv_bytes / 2**20:.1f} | "
                    f"{100 * share:.1f}% | {r.tokens_per_s:.2f} |")
    return "\n".join(rows)


@dataclass(frozen=True)
class DecodeBenchConfig:
    """The arguments of `skipkv bench decode`, checked when built (before a model loads or the benchmark runs)."""

    model: str = "random:qwen2:0.5b"
    policies: tuple[str, ...] = ("full", "rkv")
    lengths: tuple[int, ...] = (256, 1024, 4096)
    budget: int = knob(256, "KV budget of the compressing policies", gt=0, le=MAX_TOKENS, why=TOKENS_WHY)
    interval: int = knob(128, "compress every this many tokens", gt=0, le=MAX_TOKENS, why=TOKENS_WHY)
    window: int = knob(8, "recent tokens always kept", ge=0, le=MAX_TOKENS, why=TOKENS_WHY)
    batch_size: int = knob(1, "requests decoded together (each one materialised)", gt=0, le=4096)
    dtype: str = "auto"
    span: int = knob(64, "steps before each length whose median is reported", gt=0, le=MAX_TOKENS, why=TOKENS_WHY)
    prompt_tokens: int = knob(0, "prompt length in tokens (0: the short built-in question)", ge=0, le=MAX_TOKENS,
                              why=TOKENS_WHY)
    out: str | None = knob(None, "JSON report path", kind=str)
    progress: bool = False  # a bar of decode steps on stderr (the CLI turns it on)

    def __post_init__(self) -> None:
        from skipkv.models import resolve_dtype

        check_fields(self, "bench decode")
        if not self.policies:
            raise SkipKVError("bench decode: give at least one policy")
        if not self.lengths or any(isinstance(n, bool) or not isinstance(n, int) or n <= 1 for n in self.lengths):
            raise SkipKVError(f"bench decode lengths must be integers > 1, got {list(self.lengths)}")
        resolve_dtype(self.dtype)
        self.make_policies()  # unknown names and bad knobs fail here
        if self.out is not None:
            check_file(self.out, "--out")

    def make_policies(self) -> list:
        """One policy per spec (`name` or `name:knob=value,...`); the shared budget/interval/window apply unless
        the spec sets them."""
        from skipkv.policies import make_policy, parse_policy_spec

        return [make_policy(n) if n == "full" else
                parse_policy_spec(n, budget=self.budget, interval=self.interval, window=self.window)[1]
                for n in self.policies]


def run_bench(cfg: DecodeBenchConfig) -> dict:
    """Run the benchmark of `cfg`, print its table, write its JSON report to cfg.out (atomically) if given."""
    from skipkv.hardware import environment
    from skipkv.models import load_model

    made = cfg.make_policies()
    bundle = load_model(cfg.model, dtype=cfg.dtype)
    lengths = list(cfg.lengths)
    prompt: str | list[int] = QUESTION
    if cfg.prompt_tokens:
        ids = bundle.tokenizer(QUESTION + " ", add_special_tokens=False)["input_ids"]
        prompt = (ids * (cfg.prompt_tokens // len(ids) + 1))[:cfg.prompt_tokens]
    runs = bench_policies(bundle, made, prompt, lengths, cfg.batch_size, cfg.span, list(cfg.policies),
                          progress=cfg.progress)
    table = format_table(runs, lengths)
    print(table)
    report = {"model": cfg.model, "dtype": str(bundle.dtype).removeprefix("torch."), "batch_size": cfg.batch_size,
              "budget": cfg.budget,
              "interval": cfg.interval, "window": cfg.window, "lengths": lengths, "span": cfg.span,
              "prompt_tokens": cfg.prompt_tokens,
              "machine": environment(bundle.dtype_choice), "runs": [r.__dict__ for r in runs], "table": table}
    if cfg.out:
        out = check_file(cfg.out, "--out")  # again: the place may have changed while the benchmark ran
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, json.dumps(report, indent=2))
    return report
