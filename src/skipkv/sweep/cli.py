"""`skipkv sweep CONFIG.yaml [--dry-run | --status] [--ray [ADDRESS]]`: expand a sweep file and run its cells.

    skipkv sweep examples/sweep_gsm8k.yaml --dry-run     # the cells and their output dirs
    skipkv sweep examples/sweep_gsm8k.yaml --status      # how far each cell is (no accuracy), beside running sweeps
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from skipkv.errors import SkipKVError
from skipkv.sweep.run import CellResult, expand_results, run_local, run_ray, run_unit, shared_units, to_eval_config
from skipkv.sweep.spec import SWEEP_KEYS, Cell, load_sweep, ray_resources


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
    what = p.add_mutually_exclusive_group()
    what.add_argument("--dry-run", action="store_true", help="list the cells and their output dirs; run nothing")
    what.add_argument("--status", action="store_true",
                      help="show each cell's finished records, whether it is complete and which process is "
                           "writing it now (no accuracy; touches nothing, so it is safe beside running sweeps); "
                           "run nothing")
    p.set_defaults(func=_main)


def _shown(path: str) -> str:
    """A path relative to the current directory when it lies below it (shorter in tables), else as is."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def _status_table(config: Path, cells: list[Cell], configs: list[Any]) -> Any:
    from rich.markup import escape
    from rich.table import Table

    from skipkv.sweep.status import cell_status, lock_holders

    holders = lock_holders()
    rows = [cell_status(cell, cfg.limit, cfg.samples, holders) for cell, cfg in zip(cells, configs)]
    done = sum(r.done for r in rows)
    targets = [r.target for r in rows]
    total = f" of {sum(t for t in targets if t is not None)}" if all(t is not None for t in targets) else ""
    finished = sum(r.complete for r in rows)
    running = sum(r.writer is not None and not r.complete for r in rows)
    table = Table(title=f"{config}: {finished} of {len(rows)} cells complete, {running} running, "
                        f"{done}{total} records")
    table.add_column("#", justify="right")
    table.add_column("cell", no_wrap=True)
    table.add_column("dataset dir", no_wrap=True)
    table.add_column("records", justify="right", no_wrap=True)
    table.add_column("state", overflow="fold")
    for i, r in enumerate(rows, 1):
        records = f"{r.done}/{r.target}" if r.target is not None else str(r.done)
        table.add_row(str(i), r.name, escape(Path(r.out_dir).parent.name), records, escape(r.state))
    return table


def _main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    raw, cells = load_sweep(args.config)
    configs = [to_eval_config(cell) for cell in cells]  # every cell must be valid before the first spends hours
    if args.status:
        if args.ray is not None:
            raise SkipKVError("sweep: --status reads the run dirs here; it takes no --ray")
        console.print(_status_table(args.config, cells, configs))
        return 0
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
        results = run_ray(units, fn=run_unit, address=args.ray or None, on_done=on_done,
                          num_cpus=res["num_cpus"], num_gpus=res["num_gpus"])
    results = expand_results(units, results)
    failed = [r for r in results if not r.ok]
    console.print(f"{len(results) - len(failed)}/{len(results)} cells finished", highlight=False)
    for r in failed:
        console.print(f"  failed: {_shown(r.out_dir)}: {r.error}", highlight=False, markup=False, soft_wrap=True)
    # 1, not 2: the sweep ran; some cells did not (2 is reserved for bad input).
    return 1 if failed else 0
