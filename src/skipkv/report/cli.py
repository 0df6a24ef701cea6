"""`skipkv report`: tables and plots from finished (or partly finished) run dirs; never runs a model.

    skipkv report runs/sweep_gsm8k                  # tables here; runs/sweep_gsm8k/report/report.md + PNGs
    skipkv report runs/a runs/b --out report --format md
    skipkv report runs/sweep_gsm8k/gsm8k/rkv-b128-s0 --format terminal
"""

from __future__ import annotations

import argparse
from pathlib import Path

from skipkv.errors import SkipKVError
from skipkv.outputs import check_dir


def _dir(text: str) -> Path:
    # Path("") is the working directory: an empty DIR would report on (and write report/ into) it.
    if not text.strip():
        raise argparse.ArgumentTypeError("DIR must name a path, got ''")
    return Path(text)


def register(sub: argparse._SubParsersAction) -> None:
    from skipkv.report import FORMATS

    p = sub.add_parser("report", help="tables and plots from run dirs (reads records; runs no model)",
                       description="Aggregate run dirs (or folders holding them) into a policy x budget table "
                                   "per dataset, printed and/or written as report.md with PNG plots.")
    p.add_argument("dirs", nargs="+", type=_dir, metavar="DIR", help="run dirs, or folders searched for them")
    p.add_argument("--out", default=None,  # a str: Path("") would silently become the working directory
                   help="report folder (default: DIR/report when one DIR is given)")
    p.add_argument("--format", choices=FORMATS, default="both",
                   help="terminal: print tables; md: write report.md + PNGs; both (default)")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from skipkv.report.build import build_report

    out = check_dir(args.out, "report --out") if args.out is not None else None
    if out is None and args.format != "terminal":
        if len(args.dirs) != 1:
            raise SkipKVError("report: give --out when reporting on several DIRs")
        out = args.dirs[0] / "report"
    build_report(list(args.dirs), out, args.format, console=Console())
    return 0
