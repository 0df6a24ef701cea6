"""The evaluation runner: dataset -> prompts -> engine (batched) -> graders -> records.jsonl + summary.json.

    skipkv eval --model random:qwen2 --dataset gsm8k --limit 6 --policy rkv --budget 32 --interval 8 \\
        --max-new-tokens 40 --out runs/smoke --quiet
    run_eval(EvalConfig(model="random:qwen2", dataset="gsm8k", policy="rkv", out="runs/smoke",
                        policy_knobs={"interval": 8}, budget=32, limit=6, max_new_tokens=40, quiet=True))

A run directory holds three files.

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
                                 16-bit dtypes, see below)
Not compared: execution {limit, samples, batch_size, kv_memory, out, reference_dir} — a larger --limit or more
--samples extends a run, and in fp32/fp64 batch size does not change tokens (the engine's batch == singles
invariant; in bf16/fp16 a padded row rounds differently, so there batch_size is compared) —
and environment {git_revision, git_dirty, versions, machine, created}.

records.jsonl — one JSON object per finished (id, sample), appended, flushed and fsynced as it finishes:
  id, sample, seed               example id, sample index (0..samples-1), the sampling seed it used
  prompt, output                 the exact prompt text and the generated text
  reference, extracted           the reference answer(s) (code: the test program) and what the grader read
  correct, score, grade_detail   bool; float in [0, 1] (fraction of references found, else 0/1); a short note
  generated_tokens, prompt_tokens, peak_kv_tokens, peak_kv_bytes (peaks at any moment, a long prompt's
  staging before its compression included), decode_peak_kv_tokens, decode_peak_kv_bytes (peaks over decode
  steps only), compressions, compress_seconds, seconds
  finish_reason                  "eos" | "length" | "stop"
  layer_kv_tokens                entries each layer held at the end (differ per layer under LaProx / PyramidKV)
  sandbox                        code tasks: the isolation level that ran the program ("namespaces" | "unsafe-basic")
  + policy stats, flat           what the policy reports per request (Policy.stats), e.g. sentences,
                                 check_sentences, flagged_sentences (skipkv), steered_tokens (with steering)
  budget                         the KV budget this request ran under (null for a policy that keeps everything)
  session, finished_at           unix time the generating process started generating / this record finished
  + task meta, flat              e.g. length, depth, num_needles (long context), subject, level (math500), entry_point
A killed run loses at most the requests in flight; re-running the same command skips finished pairs.

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
import fcntl
import hashlib
import inspect
import json
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from skipkv.config import EngineConfig, SamplingParams, check_fields, knob
from skipkv.errors import SkipKVError
from skipkv.eval import prompts
from skipkv.eval.datasets import Dataset, Example, data_request, get_dataset
from skipkv.eval.graders import GRADERS, Grader
from skipkv.eval.records import RecordStore, TraceFile
from skipkv.outputs import check_dir, made_dir, write_atomic

CONFIG_FILE, RECORDS_FILE, SUMMARY_FILE, LOCK_FILE = "config.json", "records.jsonl", "summary.json", ".lock"
TRACES_FILE = "traces.jsonl"
IDENTITY_KEYS = ("model", "dtype", "device", "dataset", "prompt_style", "policy", "budget_mode", "budget_ratio",
                 "budget_reference", "sampling", "grader", "engine")
CORE_RECORD_KEYS = frozenset({
    "id", "sample", "seed", "prompt", "output", "reference", "extracted", "correct", "score", "grade_detail",
    "generated_tokens", "prompt_tokens", "peak_kv_tokens", "peak_kv_bytes", "decode_peak_kv_tokens",
    "decode_peak_kv_bytes", "compressions", "compress_seconds", "seconds", "finish_reason", "budget", "session", "finished_at",
    "layer_kv_tokens", "sandbox", "trace"})
GROUP_KEYS = ("length", "depth")  # meta keys the summary breaks accuracy down by
CONFIG_VERSION = 1

_SAMPLING = SamplingParams()
_ENGINE = EngineConfig()


def _load_model_default(name: str) -> Any:
    from skipkv.models import load_model

    return inspect.signature(load_model).parameters[name].default


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation run. Defaults come from SamplingParams, EngineConfig, load_model and the dataset class.

    Every field is checked when the config is built (`check_fields` plus the cross-field rules in
    `__post_init__`), so a bad value fails before a model loads or a file is written; sweeps build one per
    cell when the sweep file is read.
    """

    model: str
    dataset: str
    policy: str
    out: str
    policy_knobs: Mapping[str, Any] = field(default_factory=dict)  # window, sink, interval, phase, own knobs
    budget: int | None = knob(None, "tokens; or give budget_ratio", kind=int, gt=0)
    budget_ratio: float | None = knob(None, "budget as a fraction", kind=float, gt=0.0, le=1.0)
    reference: str | None = None  # run dir of a full-cache run: budget = ratio x its mean generated tokens
    dataset_options: Mapping[str, Any] = field(default_factory=dict)  # source, data, lengths, depths, per_length, seed
    limit: int | None = knob(None, "first N examples", kind=int, gt=0)
    samples: int = knob(1, "samples per example (pass@1 is averaged over them)", gt=0)
    temperature: float = _SAMPLING.temperature  # these five and the engine's two are checked by their own
    top_p: float = _SAMPLING.top_p               # dataclasses (SamplingParams, EngineConfig) in __post_init__
    top_k: int = _SAMPLING.top_k
    seed: int = _SAMPLING.seed
    max_new_tokens: int | None = knob(None, "None: the dataset's default", kind=int, gt=0)
    force_wait: int = _SAMPLING.force_wait  # s1 budget forcing (SamplingParams.force_wait)
    batch_size: int = _ENGINE.batch_size
    prefill_chunk: int = _ENGINE.prefill_chunk
    kv_memory: int = knob(_ENGINE.kv_memory, "KV memory cap in bytes (0 = none; execution only: it does not "
                          "change tokens)", ge=0)
    prompt_style: str = knob("chat", "chat template or raw text", choices=prompts.STYLES)
    dtype: str = field(default_factory=lambda: _load_model_default("dtype"))
    device: str = field(default_factory=lambda: _load_model_default("device"))
    grader_options: Mapping[str, Any] = field(default_factory=dict)  # fields of the dataset's grader, e.g. timeout_s
    quiet: bool = False
    trace: bool = False  # also write traces.jsonl for `skipkv show` (does not change results)
    # Set from dtype: "auto" resolves to this machine's dtype at once (the run's identity names the dtype that
    # ran), and this keeps why; "requested" when a dtype was given.
    dtype_reason: str = field(default="", init=False)

    def __post_init__(self) -> None:
        for name in ("model", "dataset", "policy", "dtype", "device"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise SkipKVError(f"eval {name} must be a non-empty string, got {value!r}")
        if self.reference is not None and not isinstance(self.reference, str):
            raise SkipKVError(f"eval reference must be a path, got {self.reference!r}")
        for name in ("policy_knobs", "dataset_options", "grader_options"):
            if not isinstance(getattr(self, name), Mapping):
                raise SkipKVError(f"eval {name} must be a mapping, got {getattr(self, name)!r}")
        check_fields(self, "eval")
        # The sampling and engine knobs are validated by the dataclasses that own their constraints.
        SamplingParams(max_new_tokens=self.max_new_tokens or 1, temperature=self.temperature, top_p=self.top_p,
                       top_k=self.top_k, seed=self.seed, force_wait=self.force_wait)
        EngineConfig(batch_size=self.batch_size, prefill_chunk=self.prefill_chunk)
        if self.samples > 1 and self.temperature == 0:
            raise SkipKVError("--samples > 1 needs --temperature > 0 (greedy samples are identical)")
        if self.budget is not None and self.budget_ratio is not None:
            raise SkipKVError("give either --budget or --budget-ratio, not both")
        if "budget" in self.policy_knobs and (self.budget is not None or self.budget_ratio is not None):
            raise SkipKVError("the budget is given twice (policy knobs and budget/budget_ratio)")
        if self.reference is not None and self.budget_ratio is None:
            raise SkipKVError("--reference is only used with --budget-ratio")
        from skipkv.hardware import resolve_auto
        from skipkv.models import check_device, resolve_dtype

        check_device(self.device)
        dtype, choice = resolve_auto(self.dtype, self.device)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "dtype_reason", choice.reason if choice else "requested")
        resolve_dtype(self.dtype)
        check_dir(self.out, "--out")
        # The policy and its knobs. A ratio's budget is only known later (from the reference run or each
        # prompt's length); a large one stands in, so rules like budget > window do not refuse a valid setup.
        _make_policy(self, self.budget if self.budget_ratio is None else 1 << 20)


def sample_seed(seed: int, example_id: str, sample: int) -> int:
    """The sampling seed of one (example, sample): independent of batching, order and resumption."""
    digest = hashlib.sha256(f"{seed}|{example_id}|{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


# --------------------------------------------------------------------------------------------- config
def _read_reference(cfg: EvalConfig) -> float:
    """Mean generated tokens of the full-cache reference run, checked to be the same model and dataset."""
    from skipkv.policies import POLICIES

    ref = Path(str(cfg.reference))
    try:
        summary = json.loads((ref / SUMMARY_FILE).read_text())
        config = json.loads((ref / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise SkipKVError(f"--reference {ref}: cannot read its summary.json/config.json ({exc})") from None
    policy = str(config.get("policy", {}).get("name", "?"))
    if policy not in POLICIES or POLICIES.get(policy).compresses:
        raise SkipKVError(f"--reference {ref} is a {policy!r} run; a budget ratio refers to a full-cache run")
    for key, mine in (("model", cfg.model), ("dataset", cfg.dataset)):
        theirs = config.get(key, {}).get("name") if key == "dataset" else config.get(key)
        if theirs != mine:
            raise SkipKVError(f"--reference {ref} ran {key} {theirs!r}, this run uses {mine!r}")
    mean = summary.get("mean_generated_tokens")
    if not isinstance(mean, (int, float)) or mean <= 0:
        raise SkipKVError(f"--reference {ref}: summary.json has no positive mean_generated_tokens")
    return float(mean)


def _budget_plan(cfg: EvalConfig, dataset: Dataset) -> tuple[str, int | None, float | None]:
    """(budget_mode, fixed budget or None, reference mean or None)."""
    if cfg.budget_ratio is None:
        return "tokens", cfg.budget, None
    if cfg.reference is not None:
        mean = _read_reference(cfg)
        return "reference", max(1, round(cfg.budget_ratio * mean)), mean
    if dataset.long_context:
        return "prompt_length", None, None
    raise SkipKVError(f"--budget-ratio on {cfg.dataset} needs --reference DIR (a full-cache run of the same "
                      "model and dataset): the ratio is of its mean generation length")


def _example_budget(cfg: EvalConfig, ex: Example, prompt_tokens: int) -> int:
    # A long-context example's nominal length (what its tokens were fitted to); else its real prompt length.
    length = int(ex.meta.get("length", prompt_tokens))
    return max(1, round(float(cfg.budget_ratio or 0) * length))


def _make_policy(cfg: EvalConfig, budget: int | None):
    from skipkv.policies import make_policy

    knobs = dict(cfg.policy_knobs)
    if budget is not None:
        knobs["budget"] = budget
    return make_policy(cfg.policy, **knobs)


def _public_fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if not f.name.startswith("_")}


def _make_grader(cfg: EvalConfig, dataset: Dataset) -> Grader:
    cls = GRADERS.get(dataset.grader)
    names = {f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}  # type: ignore[arg-type]
    unknown = sorted(set(cfg.grader_options) - names)
    if unknown:
        raise SkipKVError(f"the {dataset.grader} grader of {cfg.dataset} has no option {unknown[0]!r}; "
                          f"options: {', '.join(sorted(names)) or 'none'}")
    return cls(**cfg.grader_options)


def _environment() -> dict[str, Any]:
    from skipkv.hardware import environment

    return environment()


def _jsonable(obj: Any) -> Any:
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


def _check_or_write_config(out: Path, config: dict[str, Any]) -> None:
    path = out / CONFIG_FILE
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            raise SkipKVError(f"{path} is not valid JSON; use another --out") from None
        diffs = _differences({k: old.get(k, "<absent>") for k in IDENTITY_KEYS},
                             {k: config[k] for k in IDENTITY_KEYS})
        if diffs:
            more = f" and {len(diffs) - 3} more" if len(diffs) > 3 else ""
            raise SkipKVError(f"{out} holds a different run: {'; '.join(diffs[:3])}{more}; use another --out")
        return
    _write_json(path, config)


def _check_run_dir(path: str) -> Path:
    """The run directory: a usable folder that is a run of ours, or holds none of our files yet (so a run
    never overwrites a records.jsonl or summary.json it did not write)."""
    out = check_dir(path, "--out")
    if out.is_dir() and not (out / CONFIG_FILE).exists():
        theirs = [name for name in (RECORDS_FILE, SUMMARY_FILE) if (out / name).exists()]
        if theirs:
            raise SkipKVError(f"{out} has {theirs[0]} but no config.json (not a run dir of skipkv eval); "
                              "use another --out")
    return out


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Atomic: a reader sees the old file or the new one, never half of one."""
    write_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Hold the run dir's lock; a run refused before it wrote config.json also removes the lock file."""
    path = out / LOCK_FILE
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SkipKVError(f"another skipkv eval is writing to {out}") from None
        # A refused run unlinks the lock file: a process that opened it just before holds a lock on a
        # file no longer there, so the lock only counts if the path still names the file we locked.
        if not path.exists() or os.stat(path).st_ino != os.fstat(lock.fileno()).st_ino:
            raise SkipKVError(f"another skipkv eval is writing to {out}")
        try:
            yield
        except BaseException:
            if not (out / CONFIG_FILE).exists():
                with contextlib.suppress(OSError):
                    path.unlink()
            raise


def _check_lengths(cfg: EvalConfig, dataset: Dataset, options: dict[str, Any], max_context: int,
                   max_new: int) -> dict[str, Any]:
    """Long-context lengths that fit the model: defaults are filtered, an explicit one that does not fit is an error."""
    if not dataset.long_context:
        return options
    from skipkv.eval.longctx import DEFAULT_LENGTHS

    fits = [n for n in (options.get("lengths") or DEFAULT_LENGTHS) if n + max_new <= max_context]
    if options.get("lengths") and len(fits) < len(options["lengths"]):
        raise SkipKVError(f"lengths {list(options['lengths'])} + max_new_tokens {max_new} exceed the model's "
                          f"context of {max_context} tokens")
    if not fits:
        raise SkipKVError(f"no default length fits the model's context of {max_context} tokens; give --lengths")
    return {**options, "lengths": tuple(fits)}


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


# ---------------------------------------------------------------------------------------------- run
@dataclass(frozen=True)
class _Job:
    example: Example
    sample: int
    prompt: str
    prompt_ids: list[int]
    budget: int | None


@dataclass(frozen=True)
class _Plan:
    """What a run resolves before its model loads (every check that needs no model)."""

    dataset: Dataset
    grader: Grader
    mode: str  # budget_mode
    ref_mean: float | None
    policy: Any
    max_new: int
    stop: tuple[str, ...]
    out: Path


@dataclass
class _Run:
    """One run dir, open for writing: its config is written, its unfinished jobs listed."""

    cfg: EvalConfig
    plan: _Plan
    examples: list[Example]
    policy_record: dict[str, Any]
    sampling: SamplingParams
    store: RecordStore
    jobs: list[_Job]


def _plan(cfg: EvalConfig) -> _Plan:
    dataset = get_dataset(cfg.dataset)
    grader = _make_grader(cfg, dataset)
    mode, fixed_budget, ref_mean = _budget_plan(cfg, dataset)
    policy = _make_policy(cfg, fixed_budget)  # validates the knobs before a model is loaded
    grader.ready()  # e.g. the code sandbox's isolation: unavailable -> a one-line error before any output
    max_new = cfg.max_new_tokens or dataset.max_new_tokens
    stop = dataset.raw_stop if cfg.prompt_style == "raw" else ()
    return _Plan(dataset, grader, mode, ref_mean, policy, max_new, stop, _check_run_dir(cfg.out))


def _open_run(cfg: EvalConfig, plan: _Plan, bundle: Any, created: list, shared_prefill: bool = False) -> _Run:
    """Load and render the examples, write (or check) config.json and list the jobs not yet recorded. Call
    within the run dir's `made_dir` and lock; `created` is made_dir's list (cleared once config.json exists)."""
    from skipkv.engine import check_fits

    dataset, policy, mode, max_new = plan.dataset, plan.policy, plan.mode, plan.max_new
    options = _check_lengths(cfg, dataset, dict(cfg.dataset_options), bundle.max_context, max_new)
    request = data_request(options, bundle.tokenizer, cfg.prompt_style)
    examples = dataset.load(request)[request.offset:]
    if cfg.limit is not None:
        examples = examples[:cfg.limit]
    # The policy refuses what it cannot run (e.g. a steering vector built from these examples) before any
    # record is written; made_dir then removes the run directory it created.
    policy.check_run(bundle, cfg.dataset, [ex.id for ex in examples])
    # Render and size every prompt before anything is written, so a bad setting leaves no run dir behind.
    rendered: dict[str, tuple[str, list[int]]] = {}
    for ex in examples:
        text = prompts.render(bundle.tokenizer, ex, cfg.prompt_style)
        ids = prompts.encode(bundle.tokenizer, text, cfg.prompt_style)
        check_fits(f"example {ex.id}", len(ids), max_new, bundle.max_context)
        rendered[ex.id] = (text, ids)
    policy_record = {"name": cfg.policy, **dataclasses.asdict(policy)}
    if mode == "prompt_length" or not policy.compresses:
        policy_record["budget"] = None  # set per example (see budget_mode), or no budget applies
    sampling = SamplingParams(max_new_tokens=max_new, temperature=cfg.temperature, top_p=cfg.top_p,
                              top_k=cfg.top_k, seed=cfg.seed, stop=plan.stop, force_wait=cfg.force_wait)
    config = _jsonable({
        "model": cfg.model, "dtype": cfg.dtype, "device": cfg.device,
        "dataset": {"name": cfg.dataset, **dataset.identity(request)}
        | ({"offset": request.offset} if request.offset else {}),  # absent at 0: older run dirs still resume
        "prompt_style": cfg.prompt_style, "policy": policy_record, "budget_mode": mode,
        "budget_ratio": cfg.budget_ratio,
        "budget_reference": {"mean_generated_tokens": plan.ref_mean} if plan.ref_mean is not None else None,
        "sampling": {k: v for k, v in dataclasses.asdict(sampling).items()
                     if k != "force_wait" or v},  # absent when off: older run dirs still resume
        "grader": {"name": dataset.grader, **_public_fields(plan.grader)},
        "engine": {k: v for k, v in dataclasses.asdict(EngineConfig()).items()
                   if k not in ("batch_size", "kv_memory", "prefill_budget")}
        | {"prefill_chunk": cfg.prefill_chunk}
        # bf16/fp16: a ragged batch's padded rows round differently from single runs, so tokens depend on it.
        | ({"batch_size": cfg.batch_size} if bundle.dtype.itemsize < 4 else {}),
        "execution": {"limit": cfg.limit, "samples": cfg.samples, "batch_size": cfg.batch_size,
                      "kv_memory": cfg.kv_memory, "out": str(plan.out), "reference_dir": cfg.reference}
        | ({"shared_prefill": True} if shared_prefill else {}),
        "environment": _environment() | {"dtype_reason": cfg.dtype_reason}, "config_version": CONFIG_VERSION,
    })
    _check_or_write_config(plan.out, config)
    created.clear()  # the folder now holds a run: keep it whatever happens next

    store = RecordStore(plan.out / RECORDS_FILE)
    done = store.keys()
    TraceFile(plan.out / TRACES_FILE).prune(done)  # a trace whose record a crash lost would shadow the re-run's
    jobs: list[_Job] = []
    for ex in examples:
        todo = [s for s in range(cfg.samples) if (ex.id, s) not in done]
        if not todo:
            continue
        text, ids = rendered[ex.id]
        per_prompt = mode == "prompt_length" and policy.compresses
        budget = _example_budget(cfg, ex, len(ids)) if per_prompt else policy_record["budget"]
        jobs += [_Job(ex, s, text, ids, budget) for s in todo]
    return _Run(cfg, plan, examples, policy_record, sampling, store, jobs)


def _close_run(run: _Run) -> None:
    """Write summary.json over every record of the run dir."""
    cfg, store = run.cfg, run.store
    summary = summarize(store.records())
    summary.update(complete=all((ex.id, s) in store.keys() for ex in run.examples for s in range(cfg.samples)),
                   dataset=cfg.dataset, model=cfg.model, policy=cfg.policy, budget=run.policy_record["budget"],
                   budget_ratio=cfg.budget_ratio)
    levels = sorted({str(r["sandbox"]) for r in store.records() if "sandbox" in r})
    if levels:
        summary["sandbox"] = levels[0] if len(levels) == 1 else levels
    _write_json(run.plan.out / SUMMARY_FILE, summary)


def run_eval(cfg: EvalConfig) -> Path:
    """Run (or resume) one evaluation into cfg.out; returns the run directory. See the module docstring."""
    from skipkv.engine import generate
    from skipkv.models import load_model

    plan = _plan(cfg)
    # A run refused from here on (model, lengths, prompt sizes) removes the folders it created and its lock.
    with made_dir(plan.out) as created, _locked(plan.out):
        bundle = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
        run = _open_run(cfg, plan, bundle, created)
        _generate(cfg, bundle, run.jobs, run.sampling, plan.grader, run.store, generate)
        _close_run(run)
    return plan.out


# Fields that may differ between the runs of one shared prefill (everything else must be equal).
SHARED_FIELDS = frozenset({"policy", "policy_knobs", "budget", "budget_ratio", "out", "quiet"})


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
    if not shares_prefill(_make_policy(cfg, cfg.budget if cfg.budget_ratio is None else 1 << 20)):
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
    plans = [_plan(cfg) for cfg in cfgs]
    with contextlib.ExitStack() as stack:
        createds = []
        for plan in plans:
            createds.append(stack.enter_context(made_dir(plan.out)))
            stack.enter_context(_locked(plan.out))
        first = cfgs[0]
        bundle = load_model(first.model, dtype=first.dtype, device=first.device)
        runs = [_open_run(cfg, plan, bundle, created, shared_prefill=True)
                for cfg, plan, created in zip(cfgs, plans, createds)]
        todo: dict[str, list[tuple[_Run, _Job]]] = defaultdict(list)
        for run in runs:
            for job in run.jobs:
                todo[job.example.id].append((run, job))
        session = time.time()
        bar = tqdm(total=sum(len(r.jobs) for r in runs), desc=f"{first.dataset}/shared prefill ({len(runs)} runs)",
                   unit="run-ex", disable=first.quiet, dynamic_ncols=True)
        try:
            for pairs in todo.values():
                ids = pairs[0][1].prompt_ids
                if any(job.prompt_ids != ids for _, job in pairs):
                    raise SkipKVError(f"example {pairs[0][1].example.id} renders differently across the runs")
                sampling = dataclasses.replace(pairs[0][0].sampling,
                                               seed=sample_seed(first.seed, pairs[0][1].example.id, 0))
                policies = [_make_policy(run.cfg, job.budget) for run, job in pairs]

                def finished(i: int, result: Any, pairs: list = pairs, seed: int = sampling.seed) -> None:
                    run, job = pairs[i]
                    verdict = run.plan.grader.grade(result.text, job.example)
                    run.store.append(_record(job, result, verdict, seed, session))
                    bar.update(1)

                generate_shared(bundle, ids, sampling, policies, on_result=finished)
        finally:
            bar.close()
        for run in runs:
            _close_run(run)
    return [plan.out for plan in plans]


def _record(job: _Job, result: Any, verdict: Any, seed: int, session: float) -> dict[str, Any]:
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


def _generate(cfg: EvalConfig, bundle: Any, jobs: list[_Job], sampling: SamplingParams, grader: Grader,
              store: RecordStore, generate: Any) -> None:
    """Generate every job through the engine (one call per distinct budget), recording each as it finishes."""
    from tqdm import tqdm

    if not jobs:
        return
    session = time.time()
    groups: dict[int | None, list[_Job]] = defaultdict(list)
    for job in jobs:
        groups[job.budget].append(job)
    traces = TraceFile(store.path.parent / TRACES_FILE) if cfg.trace else None
    bar = tqdm(total=len(jobs), desc=f"{cfg.dataset}/{cfg.policy}", unit="ex", disable=cfg.quiet, dynamic_ncols=True)
    correct = finished_count = 0
    try:
        for budget, group in groups.items():
            policy = _make_policy(cfg, budget)
            params = [dataclasses.replace(sampling, seed=sample_seed(cfg.seed, j.example.id, j.sample)) for j in group]

            def finished(result: Any, group: list[_Job] = group, params: list[SamplingParams] = params) -> None:
                nonlocal correct, finished_count
                job = group[result.index]
                verdict = grader.grade(result.text, job.example)
                record = _record(job, result, verdict, params[result.index].seed, session)
                if traces is not None:
                    traces.append(job.example.id, job.sample, result.trace)
                    record["trace"] = TRACES_FILE
                store.append(record)
                correct, finished_count = correct + verdict.correct, finished_count + 1
                bar.update(1)
                bar.set_postfix(acc=f"{correct / finished_count:.3f}", refresh=False)

            generate(bundle, [j.prompt_ids for j in group], params, policy,
                     EngineConfig(batch_size=cfg.batch_size, prefill_chunk=cfg.prefill_chunk, kv_memory=cfg.kv_memory),
                     on_result=finished, progress=False, trace=cfg.trace)
    finally:
        bar.close()
