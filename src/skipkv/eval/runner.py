"""The evaluation runner: dataset -> prompts -> engine (batched) -> graders -> records.jsonl + summary.json.

    skipkv eval --model random:qwen2 --dataset gsm8k --limit 6 --policy rkv --budget 32 --interval 8 \\
        --max-tokens 40 --out runs/smoke --quiet
    run_eval(EvalConfig(model="random:qwen2", dataset="gsm8k", policy="rkv", out="runs/smoke",
                        policy_knobs={"interval": 8}, budget=32, limit=6, max_new_tokens=40, quiet=True))

The settings and what they resolve to before a model loads are in eval/plan.py; the run directory (its
files, identity, lock, summary and record lines) in eval/rundir.py; several runs sharing one prefill per
example in eval/shared.py.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skipkv.config import EngineConfig, SamplingParams
from skipkv.eval import prompts
from skipkv.eval.data import Example, data_request
from skipkv.eval.plan import (
    EvalConfig,
    Plan,
    check_lengths,
    example_budget,
    make_plan,
    public_fields,
    run_policy,
    sample_seed,
)
from skipkv.eval.records import RecordStore, TraceFile
from skipkv.eval.rundir import (
    CONFIG_VERSION,
    RECORDS_FILE,
    SUMMARY_FILE,
    TRACES_FILE,
    Job,
    check_or_write_config,
    jsonable,
    locked,
    log_session,
    make_record,
    summarize,
    write_json,
)
from skipkv.outputs import made_dir

# Re-exported: where callers have always imported them from.
__all__ = ["SUMMARY_FILE", "TRACES_FILE", "EvalConfig", "run_eval", "sample_seed", "summarize"]

# Sampling knobs added after the first runs, with their defaults: recorded in a run's identity only when set.
_LATER_SAMPLING = {"force_wait": 0, "n": 1, "repetition_penalty": 1.0}


def _environment(bundle: Any) -> dict[str, Any]:
    from skipkv.hardware import environment

    return environment(bundle=bundle)



@dataclass
class Run:
    """One run dir, open for writing: its config is written, its unfinished jobs listed."""

    cfg: EvalConfig
    plan: Plan
    examples: list[Example]
    policy_record: dict[str, Any]
    sampling: SamplingParams
    store: RecordStore
    jobs: list[Job]
    environment: dict[str, Any]  # this process's, for sessions.jsonl




def open_run(cfg: EvalConfig, plan: Plan, bundle: Any, created: list, shared_prefill: bool = False,
             memo: dict | None = None) -> Run:
    """Load and render the examples, write (or check) config.json and list the jobs not yet recorded. Call
    within the run dir's `made_dir` and lock; `created` is made_dir's list (cleared once config.json exists).
    `memo`: a dict shared by runs opened together on one bundle (eval/shared.py), so that runs of the same data
    load and render it once (a long-context set fits every haystack by tokenizing it again and again)."""
    from skipkv.engine import check_fits

    dataset, policy, mode, max_new = plan.dataset, plan.policy, plan.mode, plan.max_new
    options = check_lengths(cfg, dataset, dict(cfg.dataset_options), bundle.max_context, max_new)
    request = data_request(options, bundle.tokenizer, cfg.prompt_style)
    memo = {} if memo is None else memo
    key = (cfg.dataset, repr(sorted(options.items())), cfg.prompt_style, cfg.limit, max_new, id(bundle.tokenizer))
    if key not in memo:
        examples = dataset.load(request)[request.offset:]
        if cfg.limit is not None:
            examples = examples[:cfg.limit]
        # Render and size every prompt before anything is written, so a bad setting leaves no run dir behind.
        rendered: dict[str, tuple[str, list[int]]] = {}
        for ex in examples:
            text = prompts.render(bundle.tokenizer, ex, cfg.prompt_style)
            ids = prompts.encode(bundle.tokenizer, text, cfg.prompt_style)
            check_fits(f"example {ex.id}", len(ids), max_new, bundle.max_context)
            rendered[ex.id] = (text, ids)
        memo[key] = examples, rendered
    examples, rendered = memo[key]
    # The policy refuses what it cannot run (e.g. a steering vector built from these examples) before any
    # record is written; made_dir then removes the run directory it created.
    policy.check_run(bundle, cfg.dataset, [ex.id for ex in examples])
    policy_record = {"name": cfg.policy, **dataclasses.asdict(policy)}
    if mode == "prompt_length" or not policy.compresses:
        policy_record["budget"] = None  # set per example (see budget_mode), or no budget applies
    sampling = SamplingParams(max_new_tokens=max_new, temperature=cfg.temperature, top_p=cfg.top_p,
                              top_k=cfg.top_k, seed=cfg.seed, stop=plan.stop, force_wait=cfg.force_wait)
    config = jsonable({
        "model": cfg.model, "dtype": cfg.dtype, "device": cfg.device,
        "dataset": {"name": cfg.dataset, **dataset.identity(request)}
        | ({"offset": request.offset} if request.offset else {}),  # absent at 0: older run dirs still resume
        "prompt_style": cfg.prompt_style, "policy": policy_record, "budget_mode": mode,
        "budget_ratio": cfg.budget_ratio,
        "budget_reference": {"mean_generated_tokens": plan.ref_mean} if plan.ref_mean is not None else None,
        # Knobs added after the first runs are absent at their defaults: older run dirs still resume.
        "sampling": {k: v for k, v in dataclasses.asdict(sampling).items()
                     if k not in _LATER_SAMPLING or v != _LATER_SAMPLING[k]},
        "grader": {"name": dataset.grader, **public_fields(plan.grader)},
        "engine": {k: v for k, v in dataclasses.asdict(EngineConfig()).items()
                   if k not in ("batch_size", "kv_memory", "prefill_budget", "share_prefix", "unpad_prefill")}
        | {"prefill_chunk": cfg.prefill_chunk}
        | ({"share_prefix": cfg.share_prefix} if cfg.share_prefix else {})  # absent when off: older dirs resume
        # bf16/fp16: a ragged batch's padded rows round differently from single runs, so tokens depend on it;
        # likewise the unpadded MLPs (recorded when on: a dir from before them ran padded, and resumes so).
        | ({"batch_size": cfg.batch_size} if bundle.dtype.itemsize < 4 else {})
        | ({"unpad_prefill": True} if cfg.unpad_prefill and bundle.dtype.itemsize < 4 else {}),
        "execution": {"limit": cfg.limit, "samples": cfg.samples, "batch_size": cfg.batch_size,
                      "kv_memory": cfg.kv_memory, "out": str(plan.out), "reference_dir": cfg.reference}
        | ({"shared_prefill": True} if shared_prefill else {}),
        "environment": _environment(bundle) | {"dtype_reason": cfg.dtype_reason}, "config_version": CONFIG_VERSION,
    })
    check_or_write_config(plan.out, config)
    created.clear()  # the folder now holds a run: keep it whatever happens next

    store = RecordStore(plan.out / RECORDS_FILE)
    done = store.keys()
    TraceFile(plan.out / TRACES_FILE).prune(done)  # a trace whose record a crash lost would shadow the re-run's
    jobs: list[Job] = []
    for ex in examples:
        todo = [s for s in range(cfg.samples) if (ex.id, s) not in done]
        if not todo:
            continue
        text, ids = rendered[ex.id]
        per_prompt = mode == "prompt_length" and policy.compresses
        budget = example_budget(cfg, ex, len(ids)) if per_prompt else policy_record["budget"]
        jobs += [Job(ex, s, text, ids, budget) for s in todo]
    return Run(cfg, plan, examples, policy_record, sampling, store, jobs, config["environment"])


def close_run(run: Run) -> None:
    """Write summary.json over every record of the run dir."""
    cfg, store = run.cfg, run.store
    summary = summarize(store.records())
    summary.update(complete=all((ex.id, s) in store.keys() for ex in run.examples for s in range(cfg.samples)),
                   dataset=cfg.dataset, model=cfg.model, policy=cfg.policy, budget=run.policy_record["budget"],
                   budget_ratio=cfg.budget_ratio)
    levels = sorted({str(r["sandbox"]) for r in store.records() if "sandbox" in r})
    if levels:
        summary["sandbox"] = levels[0] if len(levels) == 1 else levels
    write_json(run.plan.out / SUMMARY_FILE, summary)


def run_eval(cfg: EvalConfig) -> Path:
    """Run (or resume) one evaluation into cfg.out; returns the run directory. See the module docstring."""
    from skipkv.engine import generate
    from skipkv.models import load_model

    plan = make_plan(cfg)
    # A run refused from here on (model, lengths, prompt sizes) removes the folders it created and its lock.
    with made_dir(plan.out) as created, locked(plan.out):
        bundle = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
        run = open_run(cfg, plan, bundle, created)
        line = resume_line(run)
        if line and not cfg.quiet:
            print(line, file=sys.stderr, flush=True)
        _generate(cfg, bundle, run, generate)
        close_run(run)
    return plan.out


def resume_line(run: Run) -> str | None:
    """"resuming: N of M records done" when the run dir already holds records of this run, else None."""
    total = len(run.examples) * run.cfg.samples
    done = total - len(run.jobs)
    return f"resuming: {done} of {total} records done" if done else None


def advance(bar: Any, correct: int, finished: int, blind: bool) -> None:
    """Count one finished example on the progress bar, the running accuracy set first, so that the refresh that
    `update` makes already shows this example's verdict."""
    if not blind:
        bar.set_postfix(acc=f"{correct / finished:.3f}", refresh=False)
    bar.update(1)


def _generate(cfg: EvalConfig, bundle: Any, run: Run, generate: Any) -> None:
    """Generate every job of `run` through the engine (one call per distinct budget), recording each as it
    finishes."""
    from tqdm import tqdm

    jobs, sampling, grader, store = run.jobs, run.sampling, run.plan.grader, run.store
    if not jobs:
        return
    session = time.time()
    log_session(run.plan.out, session, run.environment)
    groups: dict[int | None, list[Job]] = defaultdict(list)
    for job in jobs:
        groups[job.budget].append(job)
    traces = TraceFile(store.path.parent / TRACES_FILE) if cfg.trace else None
    bar = tqdm(total=len(jobs), desc=f"{cfg.dataset}/{cfg.policy}", unit="ex", disable=cfg.quiet, dynamic_ncols=True)
    correct = finished_count = 0
    try:
        for budget, group in groups.items():
            policy = run_policy(cfg, budget)
            params = [dataclasses.replace(sampling, seed=sample_seed(cfg.seed, j.example.id, j.sample)) for j in group]

            def finished(result: Any, group: list[Job] = group, params: list[SamplingParams] = params) -> None:
                nonlocal correct, finished_count
                job = group[result.index]
                verdict = grader.grade(result.text, job.example)
                record = make_record(job, result, verdict, params[result.index].seed, session)
                if traces is not None:
                    traces.append(job.example.id, job.sample, result.trace)
                    record["trace"] = TRACES_FILE
                store.append(record)
                correct, finished_count = correct + verdict.correct, finished_count + 1
                advance(bar, correct, finished_count, cfg.blind)

            generate(bundle, [j.prompt_ids for j in group], params, policy,
                     EngineConfig(batch_size=cfg.batch_size, prefill_chunk=cfg.prefill_chunk, kv_memory=cfg.kv_memory,
                                  share_prefix=cfg.share_prefix, unpad_prefill=cfg.unpad_prefill),
                     on_result=finished, progress=False, trace=cfg.trace)
    finally:
        bar.close()
