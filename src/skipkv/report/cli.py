"""`skipkv report`: tables and plots from finished (or partly finished) run dirs; never runs a model.

    skipkv report runs/sweep_gsm8k                  # tables here; runs/sweep_gsm8k/report/report.md + PNGs
    skipkv report runs/a runs/b --out report --format md
    skipkv report runs/sweep_gsm8k/gsm8k/rkv-b128-s0 --format terminal
    skipkv show runs/g-rkv runs/g-skipkv --id gsm8k-test-0000     # retention pages (report/viewer.py)
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


PACK_HELP = "slim and compress finished run dirs' records (each prompt -> its sha256; gzip), read transparently"


def register(sub: argparse._SubParsersAction) -> None:
    from skipkv.report.tables import FORMATS

    p = sub.add_parser("report", help="tables and plots from run dirs (reads records; runs no model)",
                       description="Aggregate run dirs (or folders holding them) into a policy x budget table "
                                   "per dataset, printed and/or written as report.md with PNG plots.")
    p.add_argument("dirs", nargs="+", type=_dir, metavar="DIR", help="run dirs, or folders searched for them")
    p.add_argument("--out", default=None,  # a str: Path("") would silently become the working directory
                   help="report folder (default: DIR/report when one DIR is given)")
    p.add_argument("--format", choices=FORMATS, default="both",
                   help="terminal: print tables; md: write report.md + PNGs; both (default)")
    p.set_defaults(func=_main)

    p = sub.add_parser("pack", help=PACK_HELP, description=PACK_HELP)
    p.add_argument("dirs", nargs="+", type=_dir, metavar="DIR",
                   help="finished run dirs, or folders searched for them")
    p.add_argument("--dry-run", action="store_true", help="say what would be packed, change nothing")
    p.set_defaults(func=_pack)
    p = sub.add_parser("show", help="HTML pages of what the cache kept, per example (runs traced with --trace)",
                       description="Write one self-contained HTML page per example of a run traced with "
                                   "`skipkv eval --trace`: tokens shaded by retention, a compression replay "
                                   "slider, flagged and check sentences; two run dirs side by side.")
    p.add_argument("dirs", nargs="+", type=_dir, metavar="RUN_DIR", help="one run dir, or two to compare")
    p.add_argument("--id", dest="example_id", default=None, help="only this example (default: every traced one)")
    p.add_argument("--out", default=None,  # a str: Path("") would silently become the working directory
                   help="a new or empty folder for the pages (default: RUN_DIR/show)")
    p.set_defaults(func=_show)


def _show(args: argparse.Namespace) -> int:
    from skipkv.report.viewer import write_pages

    pages = write_pages(list(args.dirs), args.out, args.example_id)
    print(f"wrote {len(pages)} page{'s' if len(pages) != 1 else ''} -> {pages[0].parent}"
          + (f" (open {pages[0]})" if len(pages) == 1 else " (index.html lists them)"))
    return 0


def _pack(args: argparse.Namespace) -> int:
    from skipkv.report.pack import finished, pack, run_dirs

    dirs = sorted({d for root in args.dirs for d in run_dirs(root)})
    if not dirs:
        where = ", ".join(map(str, args.dirs))
        raise SkipKVError(f"pack: no run dirs (config.json + records.jsonl) at or below {where}")
    before = after = done = skipped = 0
    for d in dirs:
        if (d / "records.jsonl").exists() and not finished(d):
            print(f"{d}: skipped, not finished (no summary.json saying complete)")
            skipped += 1
            continue
        got = pack(d, dry_run=args.dry_run)
        if got is None:
            continue
        before, after, done = before + got.before, after + got.after, done + 1
        print(f"{d}: {got.before:,} -> {got.after:,} bytes ({got.prompts} prompts hashed)")
    verb = "would pack" if args.dry_run else "packed"
    print(f"{verb} {done} of {len(dirs)} run dirs ({skipped} not finished): {before:,} -> {after:,} bytes of records")
    return 0


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
