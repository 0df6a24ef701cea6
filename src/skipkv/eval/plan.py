"""An evaluation's settings (EvalConfig) and what a run resolves from them before generating: the dataset,
the grader, the budget (given, a ratio of a reference run, or per prompt), the policy, the lengths that fit.

    from skipkv.eval.plan import EvalConfig
    EvalConfig(model="random:qwen2", dataset="gsm8k", policy="rkv", out="runs/smoke", budget=32)
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skipkv.config import (
    COUNT_WHY,
    MAX_COUNT,
    MAX_SAMPLES,
    MAX_TOKENS,
    SAMPLES_WHY,
    TOKENS_WHY,
    EngineConfig,
    SamplingParams,
    check_fields,
    knob,
)
from skipkv.errors import SkipKVError
from skipkv.eval import prompts
from skipkv.eval.data import Dataset, Example
from skipkv.eval.datasets import get_dataset
from skipkv.eval.graders import GRADERS, Grader
from skipkv.eval.rundir import CONFIG_FILE, SUMMARY_FILE, check_run_dir
from skipkv.outputs import check_dir

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
    limit: int | None = knob(None, "first N examples", kind=int, gt=0, le=MAX_COUNT, why=COUNT_WHY)
    samples: int = knob(1, "samples per example (pass@1 is averaged over them)", gt=0, le=MAX_SAMPLES,
                        why=SAMPLES_WHY)
    temperature: float = _SAMPLING.temperature  # these five and the engine's two are checked by their own
    top_p: float = _SAMPLING.top_p               # dataclasses (SamplingParams, EngineConfig) in __post_init__
    top_k: int = _SAMPLING.top_k
    seed: int = _SAMPLING.seed
    max_new_tokens: int | None = knob(None, "None: the dataset's default", kind=int, gt=0, le=MAX_TOKENS,
                                      why=TOKENS_WHY)
    force_wait: int = _SAMPLING.force_wait  # s1 budget forcing (SamplingParams.force_wait)
    batch_size: int = _ENGINE.batch_size
    prefill_chunk: int = _ENGINE.prefill_chunk
    share_prefix: int = _ENGINE.share_prefix  # prefill a prompt prefix shared by a batch once (EngineConfig)
    unpad_prefill: bool = _ENGINE.unpad_prefill  # MLPs on a padded prefill's real positions only (EngineConfig)
    kv_memory: int = _ENGINE.kv_memory  # KV memory cap in bytes (0 = none; execution only: it does not change tokens)
    prompt_style: str = knob("chat", "chat template or raw text", choices=prompts.STYLES)
    dtype: str = field(default_factory=lambda: _load_model_default("dtype"))
    device: str = field(default_factory=lambda: _load_model_default("device"))
    grader_options: Mapping[str, Any] = field(default_factory=dict)  # fields of the dataset's grader, e.g. timeout_s
    quiet: bool = False
    # Progress without the running accuracy (sweeps set it: a pre-registered grid is not watched as it runs).
    blind: bool = False
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
        EngineConfig(batch_size=self.batch_size, prefill_chunk=self.prefill_chunk, share_prefix=self.share_prefix,
                     kv_memory=self.kv_memory)
        if self.samples > 1 and self.temperature == 0:
            raise SkipKVError("--samples > 1 needs --temperature > 0 (greedy samples are identical)")
        if self.budget is not None and self.budget_ratio is not None:
            raise SkipKVError("give either --budget or --budget-ratio, not both")
        if "budget" in self.policy_knobs and (self.budget is not None or self.budget_ratio is not None):
            raise SkipKVError("the budget is given twice (policy knobs and budget/budget_ratio)")
        if self.reference is not None and self.budget_ratio is None:
            raise SkipKVError("--reference is only used with --reference-share")
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
        run_policy(self, self.budget if self.budget_ratio is None else 1 << 20)


def sample_seed(seed: int, example_id: str, sample: int) -> int:
    """The sampling seed of one (example, sample): independent of batching, order and resumption."""
    digest = hashlib.sha256(f"{seed}|{example_id}|{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF



def _read_reference(cfg: EvalConfig) -> float:
    """Mean generated tokens of the full-cache reference run, checked to be the same model and dataset."""
    from skipkv.files import read_json
    from skipkv.policies import POLICIES

    ref = Path(str(cfg.reference))
    try:
        summary = read_json(ref / SUMMARY_FILE, "summary")
        config = read_json(ref / CONFIG_FILE, "config")
    except SkipKVError as exc:
        raise SkipKVError(f"--reference: {exc}") from None
    raw_policy = config.get("policy")
    policy = str(raw_policy.get("name", "?") if isinstance(raw_policy, dict) else raw_policy)
    if policy not in POLICIES or POLICIES.get(policy).compresses:
        raise SkipKVError(f"--reference {ref} is a {policy!r} run; a budget ratio refers to a full-cache run")
    for key, mine in (("model", cfg.model), ("dataset", cfg.dataset)):
        theirs = config.get(key)
        theirs = theirs.get("name") if isinstance(theirs, dict) else theirs
        if theirs != mine:
            raise SkipKVError(f"--reference {ref} ran {key} {theirs!r}, this run uses {mine!r}")
    mean = summary.get("mean_generated_tokens")
    if not isinstance(mean, (int, float)) or mean <= 0:
        raise SkipKVError(f"--reference {ref}: summary.json has no positive mean_generated_tokens")
    return float(mean)


def budget_plan(cfg: EvalConfig, dataset: Dataset) -> tuple[str, int | None, float | None]:
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


def example_budget(cfg: EvalConfig, ex: Example, prompt_tokens: int) -> int:
    # A long-context example's nominal length (what its tokens were fitted to); else its real prompt length.
    length = int(ex.meta.get("length", prompt_tokens))
    return max(1, round(float(cfg.budget_ratio or 0) * length))


def run_policy(cfg: EvalConfig, budget: int | None):
    from skipkv.policies import make_policy

    knobs = dict(cfg.policy_knobs)
    if budget is not None:
        knobs["budget"] = budget
    return make_policy(cfg.policy, **knobs)


def public_fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if not f.name.startswith("_")}


def make_grader(cfg: EvalConfig, dataset: Dataset) -> Grader:
    cls = GRADERS.get(dataset.grader)
    names = {f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}  # type: ignore[arg-type]
    unknown = sorted(set(cfg.grader_options) - names)
    if unknown:
        raise SkipKVError(f"the {dataset.grader} grader of {cfg.dataset} has no option {unknown[0]!r}; "
                          f"options: {', '.join(sorted(names)) or 'none'}")
    return cls(**cfg.grader_options)



def check_lengths(cfg: EvalConfig, dataset: Dataset, options: dict[str, Any], max_context: int,
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




@dataclass(frozen=True)
class Plan:
    """What a run resolves before its model loads (every check that needs no model)."""

    dataset: Dataset
    grader: Grader
    mode: str  # budget_mode
    ref_mean: float | None
    policy: Any
    max_new: int
    stop: tuple[str, ...]
    out: Path




def make_plan(cfg: EvalConfig) -> Plan:
    from skipkv.eval.data import data_request

    dataset = get_dataset(cfg.dataset)
    dataset.check(data_request(cfg.dataset_options, None, cfg.prompt_style))  # options and --data, before the model
    grader = make_grader(cfg, dataset)
    mode, fixed_budget, ref_mean = budget_plan(cfg, dataset)
    policy = run_policy(cfg, fixed_budget)  # validates the knobs before a model is loaded
    grader.ready()  # e.g. the code sandbox's isolation: unavailable -> a one-line error before any output
    max_new = cfg.max_new_tokens or dataset.max_new_tokens
    stop = dataset.raw_stop if cfg.prompt_style == "raw" else ()
    return Plan(dataset, grader, mode, ref_mean, policy, max_new, stop, check_run_dir(cfg.out))


