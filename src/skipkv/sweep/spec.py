"""A sweep file: its keys, their checks, and the expansion of a grid into cells (plain dicts, no I/O).

    python -c "from skipkv.sweep.spec import load_sweep; print(len(load_sweep('benchmarks/results_gsm8k.yaml')[1]))"

Every mistake is a one-line SkipKVError, found when the file is read (policy names, knobs, dataset names and
options against the registries; each cell's EvalConfig is built up front by `load_sweep`).
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from skipkv.errors import SkipKVError

# Top-level YAML keys -> one-line description (used by the unknown-key error and --help epilog).
SWEEP_KEYS: dict[str, str] = {
    "model": "model to load (hub id, folder, GGUF, recipe name or random:<family>)",
    "datasets": "list of dataset names, or {name, label?, limit?, cells?, <dataset options>} mappings (limit: "
                "this dataset's own first-N instead of the top-level one; cells: glob patterns of the cell names "
                "that run on it, e.g. [full-*, rkv-b64-*], instead of every cell)",
    "policies": "list of policy names, or {name, label?, budgets?, <policy knobs>} mappings (budgets: this "
                "entry's own token budgets instead of the top-level list)",
    "budgets": "list of KV budgets in tokens (per request, per kv head)",
    "budget_ratios": "list of KV budgets as fractions in (0, 1] (of the full-cache generation or prompt length)",
    "seeds": "list of integer sampling seeds (one run per seed)",
    "limit": "evaluate the first N examples of each dataset",
    "max_new_tokens": "generation length cap (default: the dataset's)",
    "samples": "samples per example",
    "temperature": "sampling temperature (0 = greedy)",
    "out": "output root; a cell writes to OUT/<dataset>/<cell name>",
    "options": "mapping of further EvalConfig fields for every cell (e.g. batch_size, dtype)",
    "ray": "mapping {num_cpus, num_gpus}: resources of one Ray task",
    "share_prefill": "true: cells that differ only in policy and budget, whose policies need no hidden states, "
                     "run together with one prefill per example (greedy, batch_size 1)",
}
RAY_KEYS = ("num_cpus", "num_gpus")
# Knobs that the sweep owns: a policy entry may not set them (they come from budgets / budget_ratios).
SWEPT_KNOBS = frozenset({"budget", "budget_ratio", "ratio"})
# EvalConfig fields that the sweep sets per cell: `options` may not override them.
CELL_FIELDS = frozenset({"model", "dataset", "policy", "out", "policy_knobs", "budget", "budget_ratio", "reference",
                         "dataset_options", "seed", "limit", "max_new_tokens", "samples", "temperature"})
# Labels become directory names: keep them portable, and never `.`/`..` (a path outside OUT).
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=-]*$")
SCALAR_KEYS = ("limit", "max_new_tokens", "samples", "temperature")  # copied to the cell only when set

Cell = dict[str, Any]
CellFn = Callable[[Cell], Any]


# ----------------------------------------------------------------------------------------------- parsing
def _is_int(x: object) -> bool:
    # bool is an int subclass; `budgets: [true]` is a typo, not a budget of 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(float(x))  # type: ignore[arg-type]


def _type_name(x: object) -> str:
    return "null" if x is None else type(x).__name__


def _list(raw: Mapping[str, Any], key: str, check: Callable[[Any], bool], what: str) -> list | None:
    """The list under `key` (None when absent), non-empty, each item passing `check`, no duplicates."""
    if key not in raw:
        return None
    value = raw[key]
    if not isinstance(value, list):
        raise SkipKVError(f"sweep: '{key}' must be a list of {what}, got {_type_name(value)}")
    if not value:
        raise SkipKVError(f"sweep: '{key}' is an empty list")
    seen: list = []
    for item in value:
        if not check(item):
            raise SkipKVError(f"sweep: '{key}' items must be {what}, got {item!r}")
        if item in seen and not isinstance(item, dict):
            raise SkipKVError(f"sweep: '{key}' lists {item!r} twice")
        seen.append(item)
    return value


def _positive_int(raw: Mapping[str, Any], key: str, allow_null: bool = False) -> int | None:
    value = raw[key]
    if value is None and allow_null:
        return None
    if not _is_int(value) or value <= 0:
        null = " or null" if allow_null else ""
        raise SkipKVError(f"sweep: '{key}' must be a positive integer{null}, got {value!r}")
    return value


def _entry(item: Any, key: str) -> tuple[str, str, dict[str, Any]]:
    """A dataset/policy entry -> (name, label, options). Accepts `name` or `{name, label?, **options}`."""
    if isinstance(item, str):
        name, label, options = item, item, {}
    elif isinstance(item, dict):
        options = dict(item)
        name = options.pop("name", None)
        if not isinstance(name, str) or not name:
            raise SkipKVError(f"sweep: every '{key}' mapping needs a string 'name', got {item!r}")
        label = options.pop("label", name)
        if not isinstance(label, str):
            raise SkipKVError(f"sweep: '{key}' label must be a string, got {label!r}")
        for k in options:
            if not isinstance(k, str):
                raise SkipKVError(f"sweep: '{key}' entry {name!r} has a non-string key {k!r}")
    else:
        raise SkipKVError(f"sweep: '{key}' items must be names or mappings, got {item!r}")
    if not _LABEL_RE.match(label):
        raise SkipKVError(f"sweep: '{key}' label {label!r} is not a safe directory name "
                          "(a letter or digit, then [A-Za-z0-9_.+=-])")
    return name, label, options


def _mapping(raw: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise SkipKVError(f"sweep: '{key}' must be a mapping, got {_type_name(value)}")
    return dict(value)


def _ratio_label(ratio: float) -> str:
    # 0.25 -> "0.25"; %g keeps it short and is stable for the values people write in YAML.
    return f"{ratio:g}"


# --------------------------------------------------------------------------------------------- registries
def _policy_class(name: str) -> Any:
    """The policy class registered as `name` (imports the policies, hence torch)."""
    from skipkv.policies import POLICIES

    try:
        return POLICIES.get(name)
    except SkipKVError as exc:
        raise SkipKVError(f"sweep: {exc}") from None


def _check_dataset(name: str, options: Mapping[str, Any]) -> bool:
    """Check a dataset name and its options against the registry; True for a long-context set."""
    from skipkv.eval.datasets import OPTION_KEYS, get_dataset

    try:
        dataset = get_dataset(name)
    except SkipKVError as exc:
        raise SkipKVError(f"sweep: {exc}") from None
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise SkipKVError(f"sweep: dataset {name!r} has no option {unknown[0]!r}; options: {', '.join(OPTION_KEYS)}")
    return bool(dataset.long_context)


# --------------------------------------------------------------------------------------------- expansion
def expand_sweep(raw: Mapping[str, Any], base_dir: Path | str = ".") -> list[Cell]:
    """Validate a parsed sweep YAML and return one cell dict per run, in a stable order.

    Order: dataset, then policy (YAML order), then budgets (tokens, then ratios), then seed.
    A cell holds `name`, `out_dir` (absolute: `base_dir/out/<dataset label>/<name>`), `model`, `dataset`,
    `dataset_options`, `policy`, `policy_knobs`, `budget` (tokens or None), `budget_ratio` (or None),
    `reference` (out_dir of the full-cache cell a ratio refers to, or None), `seed` (None when the YAML
    gives no seeds), the scalar settings the YAML sets, and `options`. Settings the YAML leaves out stay
    out of the cell, so their defaults remain the runner's (one place per default).
    """
    if not isinstance(raw, Mapping):
        raise SkipKVError(f"sweep: the file must hold a mapping of keys, got {_type_name(raw)}")
    unknown = [k for k in raw if k not in SWEEP_KEYS]
    if unknown:
        raise SkipKVError(f"sweep: unknown key {unknown[0]!r}; known keys: {', '.join(SWEEP_KEYS)}")
    for key in ("model", "datasets", "policies", "out"):
        if key not in raw:
            raise SkipKVError(f"sweep: missing required key '{key}'")
    model = raw["model"]
    if not isinstance(model, str) or not model:
        raise SkipKVError(f"sweep: 'model' must be a non-empty string, got {model!r}")
    out = raw["out"]
    if not isinstance(out, str) or not out:
        raise SkipKVError(f"sweep: 'out' must be a non-empty string (a directory), got {out!r}")

    entry_ok = lambda x: isinstance(x, (str, dict))  # noqa: E731
    datasets = [_entry(d, "datasets") for d in _list(raw, "datasets", entry_ok, "names or mappings") or []]
    policies = [_entry(p, "policies") for p in _list(raw, "policies", entry_ok, "names or mappings") or []]
    budgets = _list(raw, "budgets", lambda b: _is_int(b) and b > 0, "positive integers (tokens)")
    ratios = _list(raw, "budget_ratios", lambda r: _is_number(r) and 0 < r <= 1, "numbers in (0, 1]")
    seeds = _list(raw, "seeds", _is_int, "integers")

    scalars: dict[str, Any] = {}
    if "limit" in raw:
        scalars["limit"] = _positive_int(raw, "limit", allow_null=True)
    for key in ("max_new_tokens", "samples"):
        if key in raw:
            scalars[key] = _positive_int(raw, key)
    if "temperature" in raw:
        t = raw["temperature"]
        if not _is_number(t) or t < 0:
            raise SkipKVError(f"sweep: 'temperature' must be a number >= 0, got {t!r}")
        scalars["temperature"] = float(t)
    options = _mapping(raw, "options")
    clash = sorted(set(options) & (CELL_FIELDS | set(SWEEP_KEYS)))
    if clash:
        raise SkipKVError(f"sweep: 'options' may not set {clash[0]!r}; the sweep sets it per cell")
    ray_opts = _mapping(raw, "ray")
    for k, v in ray_opts.items():
        if k not in RAY_KEYS:
            raise SkipKVError(f"sweep: unknown key 'ray.{k}'; known: {', '.join(RAY_KEYS)}")
        if not _is_number(v) or v < 0:
            raise SkipKVError(f"sweep: 'ray.{k}' must be a number >= 0, got {v!r}")
    if "share_prefill" in raw and not isinstance(raw["share_prefill"], bool):
        raise SkipKVError(f"sweep: 'share_prefill' must be true or false, got {raw['share_prefill']!r}")
    for key, entries in (("datasets", datasets), ("policies", policies)):
        labels = [label for _, label, _ in entries]
        dup = next((lab for lab in labels if labels.count(lab) > 1), None)
        if dup is not None:
            raise SkipKVError(f"sweep: '{key}' has two entries labelled {dup!r}; give them distinct 'label's")

    # Names, knobs and options against the registries: a typo fails now, not hours into the sweep.
    compresses: dict[str, bool] = {}
    own_budgets: dict[str, list[int]] = {}  # a policy entry's `budgets:` replaces the top-level list for it
    for name, label, knobs in policies:
        if "budgets" in knobs:
            own = _list(knobs, "budgets", lambda b: _is_int(b) and b > 0, "positive integers (tokens)")
            own_budgets[label] = list(own or [])
            del knobs["budgets"]
        swept = sorted(SWEPT_KNOBS & set(knobs))
        if swept:
            raise SkipKVError(f"sweep: policy {label!r} sets {swept[0]!r}; list budgets at the top level instead")
        cls = _policy_class(name)
        known = {k[0] for k in cls.knobs()} - SWEPT_KNOBS
        bad = sorted(set(knobs) - known)
        if bad:
            raise SkipKVError(f"sweep: policy {name!r} has no knob {bad[0]!r}; knobs: {', '.join(sorted(known))}")
        compresses[name] = bool(cls.compresses)
    own_limits: dict[str, int | None] = {}  # a dataset entry's `limit:` replaces the top-level one for it
    own_cells: dict[str, list[str]] = {}  # a dataset entry's `cells:` (glob patterns) restricts what runs on it
    for _, label, opts in datasets:
        if "limit" in opts:
            own_limits[label] = _positive_int(opts, "limit", allow_null=True)
            del opts["limit"]
        if "cells" in opts:
            own_cells[label] = list(_list(opts, "cells", lambda c: isinstance(c, str) and bool(c),
                                          "cell-name patterns") or [])
            del opts["cells"]
    long_context = {label: _check_dataset(name, opts) for name, label, opts in datasets}
    budgeted = [label for name, label, _ in policies if compresses[name]]
    if budgeted and not budgets and not ratios:
        raise SkipKVError(f"sweep: policy {budgeted[0]!r} needs 'budgets' or 'budget_ratios'")
    full_label = next((label for name, label, _ in policies if not compresses[name]), None)
    if ratios and budgeted and full_label is None:
        needy = next((label for label, is_long in long_context.items() if not is_long), None)
        if needy is not None:
            raise SkipKVError(f"sweep: budget_ratios on {needy!r} are fractions of a full-cache run's generation "
                              "length: add the 'full' policy to the sweep")

    root = (Path(base_dir) / out).resolve()
    # (suffix, budget, ratio): tokens first, then ratios, each in YAML order.
    budget_axis: list[tuple[str, int | None, float | None]] = [(f"b{b}", b, None) for b in budgets or []]
    budget_axis += [(f"r{_ratio_label(r)}", None, float(r)) for r in ratios or []]
    seed_axis: list[int | None] = list(seeds) if seeds else [None]

    def cell_name(label: str, suffix: str, seed: int | None) -> str:
        return "-".join([label] + ([suffix] if suffix else []) + ([f"s{seed}"] if seed is not None else []))

    cells: list[Cell] = []
    for ds_name, ds_label, ds_options in datasets:
        for pol_name, pol_label, knobs in policies:
            axis = budget_axis if compresses[pol_name] else [("", None, None)]
            if compresses[pol_name] and pol_label in own_budgets:
                axis = [(f"b{b}", b, None) for b in own_budgets[pol_label]]
            for suffix, budget, ratio in axis:
                for seed in seed_axis:
                    name = cell_name(pol_label, suffix, seed)
                    if ds_label in own_cells and not any(fnmatch.fnmatchcase(name, p) for p in own_cells[ds_label]):
                        continue
                    reference = None
                    if ratio is not None and not long_context[ds_label]:
                        reference = str(root / ds_label / cell_name(str(full_label), "", seed))
                    cells.append({
                        "name": name,
                        "out_dir": str(root / ds_label / name),
                        "model": model,
                        "dataset": ds_name,
                        "dataset_options": dict(ds_options),
                        "policy": pol_name,
                        "policy_knobs": dict(knobs),
                        "budget": budget,
                        "budget_ratio": ratio,
                        "reference": reference,
                        "seed": seed,
                        **scalars,
                        **({"limit": own_limits[ds_label]} if ds_label in own_limits else {}),
                        "options": dict(options),
                    })
    for label, patterns in own_cells.items():
        names = [Path(c["out_dir"]).name for c in cells if Path(c["out_dir"]).parent.name == label]
        idle = next((p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)), None)
        if idle is not None:
            raise SkipKVError(f"sweep: dataset {label!r} cells pattern {idle!r} matches no cell")
    dirs = [c["out_dir"] for c in cells]
    if len(set(dirs)) != len(dirs):  # e.g. two ratios that print alike (0.25 and 0.2500001)
        dup = next(d for d in dirs if dirs.count(d) > 1)
        raise SkipKVError(f"sweep: two cells share the output dir {dup}")
    return cells


def ray_resources(raw: Mapping[str, Any]) -> dict[str, float]:
    """The `ray:` mapping of a (validated) sweep: resources for one task; num_cpus defaults to 1."""
    opts = dict(raw.get("ray") or {})
    return {"num_cpus": opts.get("num_cpus", 1), "num_gpus": opts.get("num_gpus", 0)}


def load_sweep(path: Path | str) -> tuple[dict[str, Any], list[Cell]]:
    """Read a sweep YAML -> (the parsed mapping, its cells). `out` is relative to the current directory."""
    from skipkv.files import read_yaml

    raw = read_yaml(Path(path), "sweep")  # bounded, no aliases, no key given twice; a mapping
    return raw, expand_sweep(raw, Path.cwd())
