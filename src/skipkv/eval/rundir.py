"""The run directory of `skipkv eval`: its files, what makes two runs the same, its lock, its summary.

    python -c "import json; from skipkv.eval.rundir import summarize; print(summarize([]))"

The runner (eval/runner.py) and shared-prefill runs (eval/shared.py) write run dirs through this module;
the report reads them. A run directory holds three files.

config.json — the resolved run. Keys that change results (IDENTITY_KEYS) are compared when the same
directory is used again; any difference is a SkipKVError, so one directory never mixes two setups:
  model, dtype, device           the model as loaded
  dataset                        {name, grader, source/file/sha256 or generator parameters (lengths, depths, seed ...),
                                 offset (when > 0: the examples skipped before --limit counts)}
  prompt_style                   "chat" | "raw" | "r1think" (eval/prompts.py)
  policy                         {name, budget, window, sink, interval, phase, + the policy's own knobs}
                                 (budget is null when it is set per prompt, see budget_mode)
  budget_mode                    "tokens" (given), "reference" (ratio x a full-cache run's mean generation
                                 length, the SkipKV/R-KV definition) or "prompt_length" (long-context sets
                                 without a reference: ratio x the example's nominal length in tokens)
  budget_ratio, budget_reference {mean_generated_tokens} of the reference run, or null
  sampling                       {max_new_tokens, temperature, top_p, top_k, seed, stop, force_wait (when > 0)}
  grader                         {name, + its settings}
  engine                         EngineConfig minus batch_size, kv_memory and prefill_budget (plus batch_size for
                                 16-bit dtypes, see below; share_prefix only when on, so older dirs resume;
                                 unpad_prefill only when on and 16-bit: older dirs ran padded and resume so)
Not compared: execution {limit, samples, batch_size, kv_memory, out, reference_dir} — a larger --limit or more
--samples extends a run, and in fp64 batch size does not change tokens (the engine's batch == singles
invariant), in fp32 only by the last bits (MKL sums 1-3 rows in another order than 4 or more, as another
processor's kernels would: a near-tie can flip, which is not compared either); in bf16/fp16 a padded row rounds
differently, so there batch_size is compared) —
and environment {git_revision, git_dirty, versions, machine, created}, except that a 16-bit CPU run resumes
only on the decode attention it recorded (environment.decode_attention_cpu: kernel and p.V dtype), and a bf16 CPU
run only on the linears it recorded (oneDNN's bf16 kernel on prepacked weights, fp32 products of upcast weights,
or torch's own: environment.packed_linears_cpu_bf16, upcast_linears_cpu_bf16).

records.jsonl — one JSON object per finished (id, sample), appended, flushed and fsynced as it finishes:
  id, sample, seed               example id, sample index (0..samples-1), the sampling seed it used
  prompt, output                 the exact prompt text and the generated text
  reference, extracted           the reference answer(s) (code: the test program) and what the grader read
  correct, score, grade_detail   bool; float in [0, 1] (fraction of references found, else 0/1); a short note
  generated_tokens, prompt_tokens, peak_kv_tokens, peak_kv_bytes (peaks at any moment, a long prompt's
  staging before its compression included), decode_peak_kv_tokens, decode_peak_kv_bytes (peaks over decode
  steps only), compressions, compress_seconds, seconds
  finish_reason                  "eos" | "length" | "stop"
  layer_kv_tokens                entries each layer held at the end (differ per layer under LaProx / PyramidKV;
                                 the mean over its kv heads under head-split policies)
  head_kv_tokens                 entries each (layer, kv head) held at the end, [L][H] (heads differ under
                                 adakv and laprox --granularity head)
  sandbox                        code tasks: the isolation level that ran the program ("namespaces" | "unsafe-basic")
  + policy stats, flat           what the policy reports per request (Policy.stats), e.g. sentences,
                                 check_sentences, flagged_sentences (skipkv), steered_tokens (with steering)
  budget                         the KV budget this request ran under (null for a policy that keeps everything)
  session, finished_at           unix time the generating process started generating / this record finished
  + task meta, flat              e.g. length, depth, num_needles (long context), subject, level (math500), entry_point
A killed run loses at most the requests in flight; re-running the same command skips finished pairs.

sessions.jsonl — one line {session, environment} per process that generated into the directory (the `session` its
records carry, and that process's environment as config.json records the first's): a run resumed on another
processor says so, and which records each one produced.

traces.jsonl — only with --trace (EvalConfig.trace): one line {id, sample, trace} per traced record, written
just before the record (whose `trace` key then names this file); the trace (engine/trace.py) is what
`skipkv show` draws. Lines left by a crash between the two writes are dropped when the run resumes.

summary.json — over all records in the directory:
  n (records), n_examples, samples (most samples of one example), complete (every selected pair done)
  accuracy                       pass@1: per example the mean of `correct` over its samples, then the mean
  score                          the same average of `score`
  mean_generated_tokens, mean_prompt_tokens, mean_peak_kv_tokens, peak_kv_tokens,
  mean_peak_kv_bytes, peak_kv_bytes, mean_decode_peak_kv_tokens, mean_decode_peak_kv_bytes,
  mean_compressions, finish_reasons {reason: count}
  tokens_per_second              generated tokens / generation wall time, summed over sessions
  by                             {meta key: {value: accuracy}} for length and depth, when examples have them
  sandbox                        code tasks: the isolation level of the records (a list if they differ)
  dataset, model, policy, budget, budget_ratio
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skipkv.errors import SkipKVError
from skipkv.eval.data import Example
from skipkv.outputs import check_dir, write_atomic

CONFIG_FILE, RECORDS_FILE, SUMMARY_FILE, LOCK_FILE = "config.json", "records.jsonl", "summary.json", ".lock"
TRACES_FILE, SESSIONS_FILE = "traces.jsonl", "sessions.jsonl"
IDENTITY_KEYS = ("model", "dtype", "device", "dataset", "prompt_style", "policy", "budget_mode", "budget_ratio",
                 "budget_reference", "sampling", "grader", "engine")
CORE_RECORD_KEYS = frozenset({
    "id", "sample", "seed", "prompt", "output", "reference", "extracted", "correct", "score", "grade_detail",
    "generated_tokens", "prompt_tokens", "peak_kv_tokens", "peak_kv_bytes", "decode_peak_kv_tokens",
    "decode_peak_kv_bytes", "compressions", "compress_seconds", "seconds", "finish_reason", "budget", "session",
    "finished_at",
    "layer_kv_tokens", "head_kv_tokens", "sandbox", "trace"})
GROUP_KEYS = ("length", "depth")  # meta keys the summary breaks accuracy down by
CONFIG_VERSION = 1


def jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def _differences(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key} ({json.dumps(a)[:40]} -> {json.dumps(b)[:40]})")
    return diffs


def _unrecorded_defaults_dropped(old: Any, new: Any) -> Any:
    """`new`'s policy record without the knobs that `old` does not record and that `new` sets to the policy's
    default: a knob added to a policy after a run dir was written (e.g. `protect_prompt`, `granularity`) keeps
    the policy's earlier behaviour at its default, so that run still resumes; any other value is a different
    run. A knob that `old` records and `new` lacks stays a difference."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    from skipkv.policies import POLICIES

    if new.get("name") not in POLICIES.names():
        return new
    cls = POLICIES.get(new["name"])
    if not dataclasses.is_dataclass(cls):
        return new
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    return {k: v for k, v in new.items() if k in old or k not in defaults or jsonable(defaults[k]) != v}


def _check_kernels(out: Path, old: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """A 16-bit CPU run resumes only on the decode attention it began with (kernels.decode_sdpa, decode_pv), a
    bf16 one only on the same linears (kernels.linear_kernel), an fp32 one only packed or unpacked as it began:
    the kernels round differently, so a change of processor or default mid-run would mix two computations in one
    cell; an fp32 run resumes only on the decode step (compiled or eager) it began with. Runs whose record
    predates a kernel's entry are not checked for it."""
    from skipkv.kernels import PACK_ENV, PV_ENV, SDPA_ENV, STEP_ENV, UPCAST_ENV, attention_kernel, linear_kernel

    if not str(config.get("device", "cpu")).startswith("cpu"):
        return
    recorded = old.get("environment") or {}
    if config.get("dtype") == "fp32":  # oneDNN's packed fp32 products and MKL's round differently
        was_fp32 = (recorded.get("packed_linears_cpu_fp32") or {}).get("packed")
        now_fp32 = (config["environment"].get("packed_linears_cpu_fp32") or {}).get("packed")
        if was_fp32 is not None and now_fp32 is not None and was_fp32 != now_fp32:
            raise SkipKVError(f"{out} was run with {'packed' if was_fp32 else 'unpacked'} fp32 linears, this run "
                              f"would use {'packed' if now_fp32 else 'unpacked'} ones; resume it with "
                              f"{PACK_ENV}={int(was_fp32)}, or use another --out")
        # The compiled step fuses the norms and rotary, which round otherwise than the eager ops.
        was_step = (recorded.get("decode_step_cpu_fp32") or {}).get("step")
        now_step = (config["environment"].get("decode_step_cpu_fp32") or {}).get("step")
        if was_step is not None and now_step is not None and was_step != now_step:
            raise SkipKVError(f"{out} was run with the {was_step} decode step, this run would use the {now_step} one; "
                              f"resume it with {STEP_ENV}={was_step}, or use another --out")
        return
    if config.get("dtype") not in ("bf16", "fp16"):
        return
    if recorded.get("decode_attention_cpu"):
        was = attention_kernel(recorded["decode_attention_cpu"])
        now = attention_kernel(config["environment"].get("decode_attention_cpu"))
        if was != now:
            raise SkipKVError(
                f"{out} was run with decode attention {was[0]} and p.V in {was[1]}, this run would use {now[0]} "
                f"and {now[1]}; resume it with {SDPA_ENV}={int(was[0] == 'sdpa')} {PV_ENV}={was[1]}, "
                "or use another --out")
    was_linear, now_linear = linear_kernel(recorded), linear_kernel(config["environment"])
    if config.get("dtype") == "bf16" and was_linear is not None and was_linear != now_linear:
        pack, upcast = int(was_linear == "packed"), int(was_linear == "upcast")
        raise SkipKVError(
            f"{out} was run with {was_linear} bf16 linears, this run would use {now_linear}; resume it with "
            f"{PACK_ENV}={pack} {UPCAST_ENV}={upcast}, or use another --out")


def check_or_write_config(out: Path, config: dict[str, Any]) -> None:
    path = out / CONFIG_FILE
    if path.exists():
        from skipkv.files import read_json

        try:
            old = read_json(path, "config")
        except SkipKVError as exc:
            raise SkipKVError(f"{exc}; use another --out") from None
        diffs = _differences({k: old.get(k, "<absent>") for k in IDENTITY_KEYS},
                             {k: config[k] for k in IDENTITY_KEYS} | {"policy": _unrecorded_defaults_dropped(
                                 old.get("policy"), config["policy"])})
        if diffs == ['engine.unpad_prefill ("<absent>" -> true)']:
            raise SkipKVError(f"{out} holds a different run: {diffs[0]}; it ran before the unpadded prefill: resume "
                              "it with --no-unpad-prefill (a sweep: `unpad_prefill: false` in its options)")
        if diffs:
            more = f" and {len(diffs) - 3} more" if len(diffs) > 3 else ""
            raise SkipKVError(f"{out} holds a different run: {'; '.join(diffs[:3])}{more}; use another --out")
        _check_kernels(out, old, config)
        return
    write_json(path, config)


def check_run_dir(path: str) -> Path:
    """The run directory: a usable folder that is a run of ours, or holds none of our files yet (so a run
    never overwrites a records.jsonl or summary.json it did not write)."""
    out = check_dir(path, "--out")
    if out.is_dir() and not (out / CONFIG_FILE).exists():
        theirs = [name for name in (RECORDS_FILE, SUMMARY_FILE) if (out / name).exists()]
        if theirs:
            raise SkipKVError(f"{out} has {theirs[0]} but no config.json (not a run dir of skipkv eval); "
                              "use another --out")
    return out


def log_session(out: Path, session: float, environment: Mapping[str, Any]) -> None:
    """Append the generating process's line to sessions.jsonl (see the module docstring)."""
    with open(out / SESSIONS_FILE, "a") as f:
        f.write(json.dumps({"session": session, "environment": jsonable(environment)}, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Atomic: a reader sees the old file or the new one, never half of one."""
    write_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold the run dir's lock; a run refused before it wrote config.json also removes the lock file."""
    from filelock import FileLock, Timeout

    path = out / LOCK_FILE
    # An flock on the run dir's .lock (filelock's Unix lock), so `sweep --status` finds its holder in /proc/locks.
    lock = FileLock(path, timeout=0, is_singleton=False)
    try:
        lock.acquire()
    except Timeout:
        raise SkipKVError(f"another skipkv eval is writing to {out}") from None
    try:
        # A refused run unlinks the lock file: a process that opened it just before holds a lock on a file no
        # longer there, so the lock only counts if the path still names the file we locked.
        fd = lock._context.lock_file_fd
        if fd is None or not path.exists() or os.stat(path).st_ino != os.fstat(fd).st_ino:
            raise SkipKVError(f"another skipkv eval is writing to {out}")
        try:
            yield
        except BaseException:
            if not (out / CONFIG_FILE).exists():
                with contextlib.suppress(OSError):
                    path.unlink()
            raise
    finally:
        lock.release()



# ------------------------------------------------------------------------------------------- summary
def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary.json metrics (see the module docstring) over `records`."""
    if not records:
        return {"n": 0, "n_examples": 0}
    by_example: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_example[str(r["id"])].append(r)

    def pass1(rs: list[dict[str, Any]], key: str = "correct") -> float:
        groups: dict[str, list[float]] = defaultdict(list)
        for r in rs:
            groups[str(r["id"])].append(float(r[key]))
        return sum(sum(v) / len(v) for v in groups.values()) / len(groups)

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in records) / len(records)

    sessions: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        sessions[r.get("session")].append(r)
    wall = sum(max(float(r["finished_at"]) for r in rs) - float(s) for s, rs in sessions.items() if s is not None)
    timed = sum(int(r["generated_tokens"]) for s, rs in sessions.items() if s is not None for r in rs)
    by: dict[str, dict[str, float]] = {}
    for key in GROUP_KEYS:
        values = sorted({r[key] for r in records if key in r})
        if len(values) > 1:
            by[key] = {str(v): pass1([r for r in records if r.get(key) == v]) for v in values}
    return {
        "n": len(records), "n_examples": len(by_example), "samples": max(len(v) for v in by_example.values()),
        "accuracy": pass1(records), "score": pass1(records, "score"),
        "mean_generated_tokens": mean("generated_tokens"), "mean_prompt_tokens": mean("prompt_tokens"),
        "mean_peak_kv_tokens": mean("peak_kv_tokens"), "peak_kv_tokens": max(int(r["peak_kv_tokens"]) for r in records),
        "mean_peak_kv_bytes": mean("peak_kv_bytes"), "peak_kv_bytes": max(int(r["peak_kv_bytes"]) for r in records),
        # Peaks over decode steps only (after a long prompt's staging and compression): the steady state.
        "mean_decode_peak_kv_tokens": mean("decode_peak_kv_tokens"),
        "mean_decode_peak_kv_bytes": mean("decode_peak_kv_bytes"),
        "mean_compressions": mean("compressions"),
        "finish_reasons": dict(Counter(str(r["finish_reason"]) for r in records)),
        "tokens_per_second": timed / wall if wall > 0 else None,
        "by": by,
    }



@dataclass(frozen=True)
class Job:
    """One (example, sample) to generate: the rendered prompt and the budget it runs under."""

    example: Example
    sample: int
    prompt: str
    prompt_ids: list[int]
    budget: int | None


def make_record(job: Job, result: Any, verdict: Any, seed: int, session: float) -> dict[str, Any]:
    """The records.jsonl line of one finished job (see the module docstring)."""
    record = {
        "id": job.example.id, "sample": job.sample, "seed": seed,
        "prompt": job.prompt, "output": result.text, "reference": job.example.reference,
        "extracted": verdict.extracted, "correct": verdict.correct, "score": verdict.score,
        "grade_detail": verdict.detail, "generated_tokens": result.generated_tokens,
        "prompt_tokens": result.prompt_tokens, "peak_kv_tokens": result.peak_kv_tokens,
        "peak_kv_bytes": result.peak_kv_bytes, "decode_peak_kv_tokens": result.decode_peak_kv_tokens,
        "decode_peak_kv_bytes": result.decode_peak_kv_bytes, "compressions": result.compressions,
        "compress_seconds": result.compress_seconds, "seconds": result.seconds,
        "finish_reason": result.finish_reason, "budget": job.budget, "session": session,
        "layer_kv_tokens": result.layer_kv_tokens,
        "head_kv_tokens": result.head_kv_tokens,
        "finished_at": time.time(),
    }
    clash = CORE_RECORD_KEYS & (set(job.example.meta) | set(result.extra))
    if clash:
        raise SkipKVError(f"example meta or policy stat {sorted(clash)[0]!r} clashes with a record field")
    record.update(result.extra)  # the policy's per-request figures, e.g. flagged_sentences
    if verdict.sandbox is not None:
        record["sandbox"] = verdict.sandbox  # the isolation level that ran this record's code
    record.update(job.example.meta)
    return record


