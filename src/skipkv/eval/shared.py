"""Several evaluations with one prefill per example: runs that differ only in policy and budget
(SHARED_FIELDS) continue from a copy of one full-cache prefill (engine/shared.py), each into its own run dir.

    from skipkv.eval.shared import run_shared
    run_shared([EvalConfig(..., policy="snapkv", out="runs/a"), EvalConfig(..., policy="laprox", out="runs/b")])
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from skipkv.errors import SkipKVError
from skipkv.eval.plan import EvalConfig, make_plan, run_policy, sample_seed
from skipkv.eval.rundir import Job, locked, log_session, make_record
from skipkv.eval.runner import Run, close_run, open_run
from skipkv.outputs import made_dir

# Fields that may differ between the runs of one shared prefill (everything else must be equal).
SHARED_FIELDS = frozenset({"policy", "policy_knobs", "budget", "budget_ratio", "out", "quiet", "blind"})


def shared_prefill_problem(cfg: EvalConfig) -> str | None:
    """Why `cfg` cannot join a shared prefill (engine/shared.py), or None when it can."""
    from skipkv.engine.shared import shares_prefill

    if cfg.temperature != 0 or cfg.samples != 1:
        return "it samples (a shared prefill needs greedy decoding, one sample)"
    if cfg.prefill_chunk:
        return "its prompts are prefilled in chunks (a policy compresses between them)"
    if cfg.batch_size != 1:
        return "its batch_size is not 1 (each example is prefilled alone)"
    if cfg.reference is not None:
        return "its budget refers to another run"
    if cfg.trace:
        return "it traces"
    if not shares_prefill(run_policy(cfg, cfg.budget if cfg.budget_ratio is None else 1 << 20)):
        return f"policy {cfg.policy} needs the prefill's hidden states or a steering hook"
    return None


def run_shared(cfgs: list[EvalConfig]) -> list[Path]:
    """Run (or resume) several evaluations that differ only in policy and budget (SHARED_FIELDS) with one
    prefill per example: each example is prefilled once with the full cache and every run's policy continues
    from a copy of it (engine/shared.py, which is token for token the run that policy makes alone with
    batch_size 1). Each run dir gets exactly what `run_eval` would write (config.json notes
    execution.shared_prefill); a run's `seconds` is the shared prefill plus its own compression and decode."""
    from tqdm import tqdm

    from skipkv.engine.shared import generate_shared
    from skipkv.models import load_model

    if not cfgs:
        return []
    for cfg in cfgs:
        problem = shared_prefill_problem(cfg)
        if problem:
            raise SkipKVError(f"{cfg.out} cannot share a prefill: {problem}")
        diff = [f.name for f in dataclasses.fields(cfg) if f.name not in SHARED_FIELDS
                and getattr(cfg, f.name) != getattr(cfgs[0], f.name)]
        if diff:
            raise SkipKVError(f"{cfg.out} cannot share a prefill with {cfgs[0].out}: they differ in {diff[0]}")
    outs = [cfg.out for cfg in cfgs]
    if len(set(outs)) != len(outs):
        raise SkipKVError(f"two runs write to {next(o for o in outs if outs.count(o) > 1)}")
    plans = [make_plan(cfg) for cfg in cfgs]
    with contextlib.ExitStack() as stack:
        createds = []
        for plan in plans:
            createds.append(stack.enter_context(made_dir(plan.out)))
            stack.enter_context(locked(plan.out))
        first = cfgs[0]
        bundle = load_model(first.model, dtype=first.dtype, device=first.device)
        memo: dict = {}  # the runs share their data: loaded and rendered once
        runs = [open_run(cfg, plan, bundle, created, shared_prefill=True, memo=memo)
                for cfg, plan, created in zip(cfgs, plans, createds)]
        todo: dict[str, list[tuple[Run, Job]]] = defaultdict(list)
        for run in runs:
            for job in run.jobs:
                todo[job.example.id].append((run, job))
        session = time.time()
        for run in runs:
            if run.jobs:
                log_session(run.plan.out, session, run.environment)
        bar = tqdm(total=sum(len(r.jobs) for r in runs), desc=f"{first.dataset}/shared prefill ({len(runs)} runs)",
                   unit="run-ex", disable=first.quiet, dynamic_ncols=True)
        try:
            for pairs in todo.values():
                ids = pairs[0][1].prompt_ids
                if any(job.prompt_ids != ids for _, job in pairs):
                    raise SkipKVError(f"example {pairs[0][1].example.id} renders differently across the runs")
                sampling = dataclasses.replace(pairs[0][0].sampling,
                                               seed=sample_seed(first.seed, pairs[0][1].example.id, 0))
                policies = [run_policy(run.cfg, job.budget) for run, job in pairs]

                def finished(i: int, result: Any, pairs: list = pairs, seed: int = sampling.seed) -> None:
                    run, job = pairs[i]
                    verdict = run.plan.grader.grade(result.text, job.example)
                    run.store.append(make_record(job, result, verdict, seed, session))
                    bar.update(1)

                generate_shared(bundle, ids, sampling, policies, on_result=finished)
        finally:
            bar.close()
        for run in runs:
            close_run(run)
    return [plan.out for plan in plans]
