"""Running a sweep: a cell becomes the runner's EvalConfig and runs, alone or with the cells it shares a
prefill with; cells are dispatched one after another in this process, or as Ray tasks.

    from skipkv.sweep import load_sweep, run_local
    raw, cells = load_sweep("benchmarks/results_gsm8k.yaml"); run_local(cells)
"""

from __future__ import annotations

import re
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skipkv.errors import SkipKVError
from skipkv.sweep.spec import SCALAR_KEYS, Cell, CellFn


# ---------------------------------------------------------------------------------------- cell -> config
def eval_fields(cell: Cell) -> dict[str, Any]:
    """Keyword arguments of the runner's `EvalConfig` for one cell: the one place that maps cell keys to fields.

    Fields the cell leaves unset (None, or absent) are left out, so EvalConfig's defaults apply.
    """
    # blind: a sweep's progress bars show no running accuracy, so a grid fixed before it runs is not watched
    # while it runs (`options: {blind: false}` shows it).
    fields: dict[str, Any] = {"model": cell["model"], "dataset": cell["dataset"], "policy": cell["policy"],
                              "out": cell["out_dir"], "blind": True}
    if cell["policy_knobs"]:
        fields["policy_knobs"] = dict(cell["policy_knobs"])
    if cell["dataset_options"]:
        fields["dataset_options"] = dict(cell["dataset_options"])
    for key in ("budget", "budget_ratio", "reference", "seed"):
        if cell[key] is not None:
            fields[key] = cell[key]
    fields.update({key: cell[key] for key in SCALAR_KEYS if key in cell})
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
    per example (eval.shared.shared_prefill_problem is None, and equal in every field but policy and budget)
    becomes one group unit, {name, out_dir, reference: None, group: [cells]}; other cells stay units of their own.
    A cell that another cell's ratio refers to is never grouped, so the dependency stays a cell's. Order: a
    unit sits where its first cell was."""
    import dataclasses
    import json

    from skipkv.eval.shared import SHARED_FIELDS, shared_prefill_problem

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
    """Run a cell (`run_cell`) or a group unit of `shared_units` (eval.shared.run_shared)."""
    if "group" not in unit:
        return run_cell(unit)
    from skipkv.eval.shared import run_shared

    return [str(p) for p in run_shared([to_eval_config(c) for c in unit["group"]])]


def expand_results(units: list[Cell], results: list[CellResult]) -> list[CellResult]:
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
