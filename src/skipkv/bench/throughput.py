"""Throughput under a KV memory cap: how many requests each policy runs at once, and the tokens/s that buys.

    skipkv bench throughput --model random:qwen2:0.5b --workload synthetic:128x512 --requests 32 \\
        --kv-memory 48MiB --policies full,rkv --budget 64 --interval 32 --out docs/bench_throughput_quick.json
    skipkv bench throughput --model qwen2.5-coder-0.5b-instruct --workload gsm8k --requests 8 \\
        --max-new-tokens 128 --policies full --batch-sweep 1,8 --hf-reference

Workloads: `synthetic:PROMPTxOUTPUT` (random-token prompts of PROMPT tokens, exactly OUTPUT tokens each,
`ignore_eos`, as R-KV's 128-in/16K-out table) or `gsm8k` (the eval harness's prompts, greedy, real stops,
so shorter chains count). All `--requests` are submitted at once.

For each policy under the same `--kv-memory` (admission by reservation, see skipkv/engine/scheduler.py) the
engine runs every request to the end; reported: generated tokens/s and requests/s over the wall time, the
batch it reached (most requests holding a slot at once: the *transition batch*), the peak of the store's
allocated bytes (never above the cap) and of the bytes held, time to first token (median) and per-token
latency (gap between two tokens of one request, p50/p99 over all gaps), and the share of the time spent
compressing. `--batch-sweep 1,2,4` runs each policy without a cap on the first B requests at batch B, to show
where tokens/s stops growing (saturation: the first batch after which it grows by less than 10%).
`--hf-reference` runs transformers' own `generate` (full cache, static batches, same prompts and lengths)
in the same process: at each sweep batch, and for the capped run at the batch the full cache reached.
`--max-seconds S` cuts each engine run after S seconds (steady-state rates for long outputs on a device
with a time budget; transformers' generate has no such cut, so it is not combined with --hf-reference).
Runs are sequential, so on a shared machine compare ratios from one run, not across runs.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from skipkv.bench.throughput_report import (
    HFRun,
    PolicyRun,
    Report,
    SweepPoint,
    format_table,
    plot,
    saturation,
)
from skipkv.config import MAX_BATCH, EngineConfig, SamplingParams
from skipkv.errors import SkipKVError
from skipkv.outputs import check_file, write_atomic

# Re-exported: callers import the report's records from here.
__all__ = ["HFRun", "PolicyRun", "Report", "SweepPoint", "Workload", "make_workload", "parse_workload", "run_bench",
           "run_engine", "run_hf", "saturation"]


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    sampling: list[SamplingParams]


# --------------------------------------------------------------------------------------------- workloads
def parse_workload(spec: str) -> tuple[str, int, int]:
    """'synthetic:128x512' -> ('synthetic', 128, 512); 'gsm8k' -> ('gsm8k', 0, 0)."""
    if spec == "gsm8k":
        return "gsm8k", 0, 0
    m = re.fullmatch(r"synthetic:(\d+)x(\d+)", spec)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise SkipKVError(f"workload must be synthetic:PROMPTxOUTPUT (e.g. synthetic:128x512) or gsm8k, got {spec!r}")
    return "synthetic", int(m.group(1)), int(m.group(2))


def make_workload(spec: str, bundle, n: int, seed: int = 0, max_new_tokens: int | None = None) -> Workload:
    kind, prompt_len, out_len = parse_workload(spec)
    if kind == "synthetic":
        tok = bundle.tokenizer
        special = set(tok.all_special_ids)
        vocab = [i for i in range(min(len(tok), bundle.config.vocab_size)) if i not in special]
        rng = random.Random(seed)
        prompts = [[rng.choice(vocab) for _ in range(prompt_len)] for _ in range(n)]
        sp = SamplingParams(max_new_tokens=max_new_tokens or out_len, ignore_eos=True)
        return Workload(spec, prompts, [sp] * n)
    from skipkv.eval import prompts as eval_prompts
    from skipkv.eval.datasets import data_request, get_dataset

    dataset = get_dataset("gsm8k")
    style = "chat" if getattr(bundle.tokenizer, "chat_template", None) else "raw"
    examples = dataset.load(data_request({}, bundle.tokenizer, style))[:n]
    if len(examples) < n:
        raise SkipKVError(f"gsm8k has {len(examples)} examples; asked for {n} requests")
    tok = bundle.tokenizer
    ids = [eval_prompts.encode(tok, eval_prompts.render(tok, ex, style), style) for ex in examples]
    stop = dataset.raw_stop if style == "raw" else ()
    sp = SamplingParams(max_new_tokens=max_new_tokens or dataset.max_new_tokens, stop=stop)
    return Workload(spec, ids, [sp] * n)


# --------------------------------------------------------------------------------------------- runs
def _percentile(values: list[float], q: float) -> float:
    from skipkv.engine.request import percentile

    return percentile(values, q) if values else 0.0


def run_engine(bundle, policy, work: Workload, config: EngineConfig, name: str,
               max_seconds: float | None = None, timeline_s: float = 30.0) -> PolicyRun:
    """Submit every request of `work` at once and step the engine until all are done (or, with
    `max_seconds`, until that much time passed: the rest is aborted and the rates cover the window).
    Every `timeline_s` seconds the run notes [elapsed, tokens so far, requests that got a token that step]."""
    from skipkv.engine import Engine

    eng = Engine(bundle, policy, config)
    try:
        t0 = time.perf_counter()
        ids = [eng.add_request(p, sp) for p, sp in zip(work.prompts, work.sampling)]
        last: dict[str, float] = {}
        ttft: list[float] = []
        gaps: list[float] = []
        results = []
        generated = max_batch = peak_alloc = peak_held = steps = 0
        compress_s = 0.0
        timeline: list[list[float]] = []
        noted = float("-inf")  # when the last timeline row was taken (unrounded)
        while eng.has_unfinished():
            out = eng.step()
            now = time.perf_counter()
            steps += 1
            generated += len(out.new_tokens)
            if out.new_tokens and now - noted >= timeline_s:
                noted = now
                timeline.append([round(now - t0, 1), generated, len(out.new_tokens)])
            for rid, _ in out.new_tokens:
                if rid in last:
                    gaps.append(now - last[rid])
                else:
                    ttft.append(now - t0)  # every request was submitted at t0
                last[rid] = now
            s = out.stats
            assert s is not None  # every step reports the engine's stats
            max_batch = max(max_batch, s.running)
            peak_alloc = max(peak_alloc, s.kv_allocated_bytes)
            peak_held = max(peak_held, s.kv_held_bytes)
            results += out.finished
            compress_s = s.compress_seconds
            if max_seconds is not None and now - t0 > max_seconds:
                break
        wall = time.perf_counter() - t0
        for rid in ids:
            eng.abort(rid)  # whatever the time limit left running
    finally:
        eng.close()
    return PolicyRun(policy=name, tokens_per_s=generated / wall, requests_per_s=len(results) / wall,
                     max_batch=max_batch, peak_kv_bytes=peak_alloc, peak_kv_held_bytes=peak_held,
                     ttft_p50=_percentile(ttft, 0.5), tpot_p50=_percentile(gaps, 0.5), tpot_p99=_percentile(gaps, 0.99),
                     compress_share=compress_s / wall, generated_tokens=generated,
                     requests=len(results), wall_s=wall, steps=steps, batch_size=config.batch_size,
                     kv_memory=config.kv_memory, timeline=timeline)


def run_hf(bundle, work: Workload, batch: int) -> HFRun:
    """transformers' `generate` (full cache, greedy) over `work` in static batches of `batch`, left-padded.
    Generated tokens count each row up to its first EOS (inclusive, as the engine counts) or max_new_tokens."""
    from skipkv.engine import eos_ids

    tok, model = bundle.tokenizer, bundle.model
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    eos = sorted(eos_ids(bundle))
    generated = 0
    t0 = time.perf_counter()
    for b0 in range(0, len(work.prompts), batch):
        rows = work.prompts[b0:b0 + batch]
        sp = work.sampling[b0]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=bundle.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=bundle.device)
        extra = {"min_new_tokens": sp.max_new_tokens} if sp.ignore_eos else {}
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=sp.max_new_tokens, do_sample=False,
                                 pad_token_id=pad, eos_token_id=eos or None, temperature=None, top_p=None,
                                 top_k=None, **extra)
        for row in out[:, width:].tolist():
            n = len(row)
            if not sp.ignore_eos:
                n = next((i + 1 for i, t in enumerate(row) if t in eos), n)
            generated += n
    wall = time.perf_counter() - t0
    return HFRun(batch=batch, tokens_per_s=generated / wall, generated_tokens=generated, requests=len(work.prompts),
                 wall_s=wall)


def run_bench(model: str, workload: str, requests: int, policies: list[str], kv_memory: int, knobs: dict,
              batch_size: int | None = None, batch_sweep: list[int] | None = None, hf_reference: bool = False,
              max_new_tokens: int | None = None, prefill_chunk: int = 0, prefill_budget: int = 0,
              dtype: str = "auto", device: str | None = None, seed: int = 0, out: str | None = None,
              plot_path: str | None = None, max_seconds: float | None = None, bundle=None,
              repeats: int = 1) -> Report:
    from skipkv.hardware import environment, resolve_auto
    from skipkv.models import load_model, resolve_dtype

    dtype, choice = resolve_auto(dtype, bundle.device if bundle is not None else (device or "cpu"))
    resolve_dtype(dtype)
    from skipkv.policies import make_policy

    # Everything cheap is validated before the model loads.
    parse_workload(workload)
    for path in (out, plot_path):
        if path:
            check_file(path, "--out")
    made = {n: make_policy(n, **({} if n == "full" else {k: v for k, v in knobs.items() if v is not None}))
            for n in policies}
    if repeats < 1:
        raise SkipKVError(f"--repeats must be at least 1, got {repeats}")
    sweep = sorted(set(batch_sweep or []))
    if sweep and max(sweep) > requests:
        raise SkipKVError(f"--batch-sweep goes up to {max(sweep)} but --requests is {requests}")
    engine_cfg = EngineConfig(batch_size=batch_size or min(requests, MAX_BATCH), prefill_chunk=prefill_chunk,
                              prefill_budget=prefill_budget, kv_memory=kv_memory)
    if bundle is None:
        bundle = load_model(model, dtype=dtype, device=device or "cpu")
    work = make_workload(workload, bundle, requests, seed, max_new_tokens)
    # Warm-up (kernels, allocator, first-call paths) so the first policy measured is not penalised.
    run_engine(bundle, next(iter(made.values())), Workload("warmup", [p[:16] for p in work.prompts[:2]],
               [SamplingParams(max_new_tokens=4, ignore_eos=True)] * min(2, requests)), EngineConfig(), "warmup")
    rep = Report(model=model, dtype=dtype, workload=workload, requests=requests, kv_memory=kv_memory,
                 config={"policies": {n: asdict(p) for n, p in made.items()}, "engine": asdict(engine_cfg),
                         "max_new_tokens": work.sampling[0].max_new_tokens, "seed": seed, "batch_sweep": sweep,
                         "max_seconds": max_seconds,
                         "device": str(bundle.device)},
                 machine=environment(choice))
    if kv_memory or not sweep:
        for name, policy in made.items():
            r = run_engine(bundle, policy, work, engine_cfg, name, max_seconds)
            print(f"{name}: {r.tokens_per_s:.1f} tokens/s, batch reached {r.max_batch}, "
                  f"peak KV {r.peak_kv_bytes / 2**20:.1f} MiB, {r.wall_s:.1f} s", flush=True)
            rep.policies.append(r)
        if hf_reference:
            full = next((r for r in rep.policies if r.policy == "full"), None)
            rep.hf_reference = run_hf(bundle, work, full.max_batch if full else engine_cfg.batch_size)
            print(f"transformers generate: {rep.hf_reference.tokens_per_s:.1f} tokens/s at batch "
                  f"{rep.hf_reference.batch}", flush=True)
    for name, policy in made.items():
        for b in sweep:
            sub = Workload(work.name, work.prompts[:b], work.sampling[:b])
            point = SweepPoint(name, b, 0.0)
            # Engine and transformers alternate, so load that drifts during the run hits both alike.
            for _ in range(repeats):
                r = run_engine(bundle, policy, sub, EngineConfig(batch_size=b, prefill_chunk=prefill_chunk,
                                                                 prefill_budget=prefill_budget), name, max_seconds)
                point.engine_runs.append(r.tokens_per_s)
                if hf_reference and name == policies[0]:
                    point.hf_runs.append(run_hf(bundle, sub, b).tokens_per_s)
            point.tokens_per_s = statistics.median(point.engine_runs)
            if point.hf_runs:
                point.hf_tokens_per_s = statistics.median(point.hf_runs)
                point.ratio = statistics.median(e / h for e, h in zip(point.engine_runs, point.hf_runs))
            print(f"{name} batch {b}: {point.tokens_per_s:.1f} tokens/s"
                  + (f" (transformers {point.hf_tokens_per_s:.1f}; engine/transformers {point.ratio:.3f}, "
                     f"median of {repeats})" if point.hf_runs else ""), flush=True)
            rep.sweep.append(point)
        if sweep:
            rep.saturation_batch[name] = saturation([p for p in rep.sweep if p.policy == name])
    rep.table = format_table(rep)
    print(rep.table)
    if out:
        json_path = check_file(out, "--out")  # again: the place may have changed while the benchmark ran
        json_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(json_path, json.dumps(asdict(rep), indent=2))
    if plot_path or out:
        png_path = check_file(plot_path or Path(str(out)).with_suffix(".png"), "--out")
        png_path.parent.mkdir(parents=True, exist_ok=True)
        plot(rep, png_path)
        print(f"wrote {out or ''} {png_path}".strip())
    return rep
