"""Sweeps: a YAML grid (dataset x policy x budget x seed) expanded into one eval run per cell.

    skipkv sweep examples/sweep_gsm8k.yaml --dry-run     # list the cells and their output dirs
    skipkv sweep examples/sweep_gsm8k.yaml               # run them one after another, in this process
    skipkv sweep examples/sweep_gsm8k.yaml --ray         # one Ray task per cell on a local Ray cluster
    skipkv sweep examples/sweep_gsm8k.yaml --ray ray://head:10001 --num-cpus 4

Each cell writes to its own directory, `OUT/<dataset>/<policy>-b<budget>-s<seed>` (`-r<ratio>` for a budget
ratio, no budget part for a policy that keeps everything), and the runner resumes a directory by itself,
so re-running a sweep only finishes what is missing. The YAML (see `SWEEP_KEYS`) is checked up front,
policy names, knobs, dataset names and options against the registries, and every mistake is a one-line
`SkipKVError`. `expand_sweep` turns the parsed YAML into plain cell dicts (no I/O); a cell becomes the
runner's `EvalConfig` only when it runs (`eval_fields`, `to_eval_config`).

A budget ratio on a dataset with a reference answer length (gsm8k, math500...) is a fraction of the
full-cache run's mean generation length, so such a cell refers to the sweep's own full-cache cell of the
same dataset and seed and runs after it; on long-context sets it is a fraction of the prompt length.

With `share_prefill: true`, cells that differ only in policy and budget and whose policies compress from the
stored K/V, window queries and prefill attention sums (every policy but skipkv and seal) run as one unit: each
example is prefilled once and every cell's policy continues from a copy (eval.runner.run_shared,
engine/shared.py). Each cell's directory gets the records a run of its own would write (batch_size 1, greedy).
With h2o among them, that one prefill accumulates attention sums (H2O's slower prefill, once for the unit).
"""

from __future__ import annotations

import argparse
import math
import re
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from skipkv.errors import SkipKVError

# Top-level YAML keys -> one-line description (used by the unknown-key error and --help epilog).
SWEEP_KEYS: dict[str, str] = {
    "model": "model to load (hub id, folder, GGUF, recipe name or random:<family>)",
    "datasets": "list of dataset names, or {name, label?, limit?, <dataset options>} mappings (limit: this "
                "dataset's own first-N instead of the top-level one)",
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
_SCALAR_KEYS = ("limit", "max_new_tokens", "samples", "temperature")  # copied to the cell only when set

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
    for _, label, opts in datasets:
        if "limit" in opts:
            own_limits[label] = _positive_int(opts, "limit", allow_null=True)
            del opts["limit"]
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
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SkipKVError(f"sweep: cannot read {path}: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise SkipKVError(f"sweep: {path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    return raw, expand_sweep(raw, Path.cwd())


# ---------------------------------------------------------------------------------------- cell -> config
def eval_fields(cell: Cell) -> dict[str, Any]:
    """Keyword arguments of the runner's `EvalConfig` for one cell: the one place that maps cell keys to fields.

    Fields the cell leaves unset (None, or absent) are left out, so EvalConfig's defaults apply.
    """
    fields: dict[str, Any] = {"model": cell["model"], "dataset": cell["dataset"], "policy": cell["policy"],
                              "out": cell["out_dir"]}
    if cell["policy_knobs"]:
        fields["policy_knobs"] = dict(cell["policy_knobs"])
    if cell["dataset_options"]:
        fields["dataset_options"] = dict(cell["dataset_options"])
    for key in ("budget", "budget_ratio", "reference", "seed"):
        if cell[key] is not None:
            fields[key] = cell[key]
    fields.update({key: cell[key] for key in _SCALAR_KEYS if key in cell})
    fields.update(cell["options"])
    return fields


def to_eval_config(cell: Cell) -> Any:
    """Build the runner's EvalConfig for one cell (imports the runner, hence torch)."""
    from skipkv.eval.runner import EvalConfig

    try:
        return EvalConfig(**eval_fields(cell))  # checks every field, the policy's knobs and the output dir
    except (TypeError, SkipKVError) as exc:  # TypeError: e.g. an `options` key that is no EvalConfig field
        raise SkipKVError(f"sweep: cell {cell['name']}: {exc}") from None


def run_cell(cell: Cell) -> str:
    """Run one cell with the eval runner; returns its output dir. The default per-cell function."""
    from skipkv.eval.runner import run_eval

    return str(run_eval(to_eval_config(cell)))


def shared_units(cells: list[Cell]) -> list[Cell]:
    """The sweep's units of work under `share_prefill`: every set of two or more cells that can share one prefill
    per example (eval.runner.shared_prefill_problem is None, and equal in every field but policy and budget)
    becomes one group unit, {name, out_dir, reference: None, group: [cells]}; other cells stay units of their own.
    A cell that another cell's ratio refers to is never grouped, so the dependency stays a cell's. Order: a
    unit sits where its first cell was."""
    import dataclasses
    import json

    from skipkv.eval.runner import SHARED_FIELDS, shared_prefill_problem

    referenced = {c["reference"] for c in cells if c.get("reference")}
    keys: list[str | None] = []
    for cell in cells:
        cfg = to_eval_config(cell)
        if cell["out_dir"] in referenced or shared_prefill_problem(cfg) is not None:
            keys.append(None)
            continue
        rest = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in SHARED_FIELDS}
        keys.append(json.dumps(rest, sort_keys=True, default=str))
    members: dict[str, list[Cell]] = {}
    for key, cell in zip(keys, cells):
        if key is not None:
            members.setdefault(key, []).append(cell)
    units: list[Cell] = []
    for key, cell in zip(keys, cells):
        group = members.get(key) if key is not None else None
        if group is None or len(group) < 2:
            units.append(cell)
        elif group[0] is cell:
            units.append({"name": f"{len(group)} cells sharing a prefill ({', '.join(c['name'] for c in group)})",
                          "out_dir": str(Path(cell["out_dir"]).parent), "reference": None, "group": group})
    return units


def run_unit(unit: Cell) -> Any:
    """Run a cell (`run_cell`) or a group unit of `shared_units` (eval.runner.run_shared)."""
    if "group" not in unit:
        return run_cell(unit)
    from skipkv.eval.runner import run_shared

    return [str(p) for p in run_shared([to_eval_config(c) for c in unit["group"]])]


def expand_results(units: list[Cell], results: list["CellResult"]) -> list["CellResult"]:
    """Per-cell results from per-unit ones: a group's outcome (and seconds) holds for each of its cells."""
    out = []
    for unit, res in zip(units, results):
        for cell in unit.get("group", [unit]):
            out.append(CellResult(cell["name"], cell["out_dir"], res.seconds, res.error, res.detail))
    return out


# -------------------------------------------------------------------------------------------- dispatch
@dataclass(frozen=True)
class CellResult:
    """How one cell ended: `error` is None on success, else one line naming the exception."""

    name: str
    out_dir: str
    seconds: float
    error: str | None = None
    detail: str = ""  # full traceback on failure, for the log

    @property
    def ok(self) -> bool:
        return self.error is None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def call_cell(fn: CellFn, cell: Cell, *after: CellResult) -> CellResult:
    """Run `fn(cell)` and turn any exception into a failed CellResult (so one bad cell stops nothing).

    `after` are the results of the cells this one depends on (its full-cache reference): if one failed,
    this cell is not run. (Under Ray they arrive as task arguments, which is what orders the tasks.)
    """
    failed = [r.name for r in after if not r.ok]
    if failed:
        return CellResult(cell["name"], cell["out_dir"], 0.0, f"not run: its reference cell {failed[0]} failed")
    start = time.perf_counter()
    try:
        fn(cell)
    except Exception as exc:  # noqa: BLE001 - a sweep reports every failure per cell and goes on
        # A SkipKVError is a user-facing one-liner already; anything else needs its traceback to be fixed.
        detail = "" if isinstance(exc, SkipKVError) else traceback.format_exc()
        return CellResult(cell["name"], cell["out_dir"], time.perf_counter() - start, _first_line(exc), detail)
    return CellResult(cell["name"], cell["out_dir"], time.perf_counter() - start)


def _schedule(cells: list[Cell]) -> list[tuple[int, int | None]]:
    """(cell index, index of the cell it depends on or None), prerequisites first, otherwise in cell order."""
    by_dir = {c["out_dir"]: i for i, c in enumerate(cells)}
    deps = [by_dir.get(c["reference"]) if c.get("reference") else None for c in cells]
    needed = {d for d in deps if d is not None}
    order = [i for i in range(len(cells)) if i in needed] + [i for i in range(len(cells)) if i not in needed]
    return [(i, deps[i]) for i in order]


def run_local(cells: list[Cell], fn: CellFn = run_cell,
              on_done: Callable[[CellResult], None] | None = None) -> list[CellResult]:
    """Run the cells one after another in this process (references first); results in cell order."""
    results: dict[int, CellResult] = {}
    for i, dep in _schedule(cells):
        results[i] = call_cell(fn, cells[i], *([results[dep]] if dep is not None else []))
        if on_done is not None:
            on_done(results[i])
    return [results[i] for i in range(len(cells))]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _ray_error(exc: BaseException) -> str:
    """One line for a task that raised outside `call_cell` (worker died, skipkv not importable there...)."""
    cause = getattr(exc, "cause", None)  # RayTaskError wraps the worker-side exception
    if isinstance(cause, BaseException) and str(cause).strip():
        return _first_line(cause)
    lines = [ln.strip() for ln in _ANSI.sub("", str(exc)).splitlines() if ln.strip()]
    # Ray's message opens with the task name and pid; the last line is the actual error.
    return f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__


def run_ray(cells: list[Cell], fn: CellFn = run_cell, address: str | None = None,
            num_cpus: float = 1, num_gpus: float = 0, init_kwargs: Mapping[str, Any] | None = None,
            on_done: Callable[[CellResult], None] | None = None) -> list[CellResult]:
    """Run each cell as a Ray task and gather the results (in cell order).

    `address=None` starts a local cluster (or reuses one this process already joined); otherwise it is
    passed to `ray.init`, and the output dirs must be on storage every node sees. A cell that depends on
    a reference cell gets that task's result as an argument, so Ray starts it only once the reference is
    done. A task that raises, or whose worker dies, becomes a failed CellResult; the others keep running.
    """
    try:
        import ray
    except ImportError:
        raise SkipKVError("sweep: --ray needs Ray: pip install 'skipkv[ray]'") from None

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address or None, **dict(init_kwargs or {}))
    try:
        # max_retries=0: a cell that crashed its worker (e.g. out of memory) would most likely crash again;
        # report it instead, and let the user re-run the sweep (the runner resumes the dir).
        task = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=0)(call_cell)
        ref_of: dict[int, Any] = {}
        for i, dep in _schedule(cells):
            ref_of[i] = task.remote(fn, cells[i], *([ref_of[dep]] if dep is not None else []))
        index = {ref: i for i, ref in ref_of.items()}
        results: dict[int, CellResult] = {}
        pending = list(ref_of.values())
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    i = index[ref]
                    try:
                        results[i] = ray.get(ref)
                    except Exception as exc:  # noqa: BLE001 - the task never returned: report, keep gathering
                        results[i] = CellResult(cells[i]["name"], cells[i]["out_dir"], 0.0, _ray_error(exc),
                                                _ANSI.sub("", str(exc)))
                    if on_done is not None:
                        on_done(results[i])
        except KeyboardInterrupt:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        return [results[i] for i in range(len(cells))]
    finally:
        if started_here:
            ray.shutdown()


# -------------------------------------------------------------------------------------------------- CLI
def register(sub: argparse._SubParsersAction) -> None:
    epilog = "YAML keys:\n" + "\n".join(f"  {k:<15} {v}" for k, v in SWEEP_KEYS.items())
    p = sub.add_parser("sweep", help="run an eval grid (dataset x policy x budget x seed) from a YAML file",
                       description="Expand a sweep YAML into one eval run per cell and run them, "
                                   "locally or as Ray tasks.",
                       epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", type=Path, help="sweep YAML (see examples/sweep_gsm8k.yaml)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run each cell as a Ray task; without ADDRESS start a local cluster")
    p.add_argument("--num-cpus", type=float, default=None,
                   help="CPUs per Ray task (default: the YAML's ray.num_cpus, else 1)")
    p.add_argument("--dry-run", action="store_true", help="list the cells and their output dirs; run nothing")
    p.set_defaults(func=_main)


def _shown(path: str) -> str:
    """A path relative to the current directory when it lies below it (shorter in tables), else as is."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def _main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    raw, cells = load_sweep(args.config)
    for cell in cells:  # every cell must make a valid EvalConfig before the first one spends hours
        to_eval_config(cell)
    units = shared_units(cells) if raw.get("share_prefill") else cells
    if args.dry_run:
        group_of = {c["out_dir"]: i for i, u in enumerate(units, 1) for c in u.get("group", [])}
        table = Table(title=f"{len(cells)} cells from {args.config}")
        # The output dir names the dataset; cell names must stay whole, paths may fold.
        table.add_column("#", justify="right")
        table.add_column("cell", no_wrap=True)
        table.add_column("output dir", overflow="fold")
        table.add_column("ratio of", no_wrap=True)
        if group_of:
            table.add_column("shared prefill", no_wrap=True)
        for i, cell in enumerate(cells, 1):
            ref = Path(cell["reference"]).name if cell["reference"] else ""
            shared = [f"group {group_of[cell['out_dir']]}" if cell["out_dir"] in group_of else ""] if group_of else []
            table.add_row(str(i), cell["name"], escape(_shown(cell["out_dir"])), ref, *shared)
        console.print(table)
        return 0

    def on_done(result: CellResult) -> None:
        status = "[green]ok[/green]" if result.ok else f"[red]FAILED[/red] {escape(result.error or '')}"
        where = escape(f"{result.name} ({Path(result.out_dir).parent.name})")
        console.print(f"{where}: {status} ({result.seconds:.0f} s)", highlight=False)
        if result.detail:  # the traceback is what one needs to fix a failed cell; the line above is its summary
            console.print(result.detail.rstrip(), style="dim", highlight=False, markup=False)

    if args.ray is None:
        results = run_local(units, fn=run_unit, on_done=on_done)
    else:
        res = ray_resources(raw)
        if args.num_cpus is not None:
            res["num_cpus"] = args.num_cpus
        results = run_ray(units, fn=run_unit, address=args.ray or None, on_done=on_done, **res)
    results = expand_results(units, results)
    failed = [r for r in results if not r.ok]
    console.print(f"{len(results) - len(failed)}/{len(results)} cells finished", highlight=False)
    for r in failed:
        console.print(f"  failed: {_shown(r.out_dir)}: {r.error}", highlight=False, markup=False, soft_wrap=True)
    # 1, not 2: the sweep ran; some cells did not (2 is reserved for bad input).
    return 1 if failed else 0
