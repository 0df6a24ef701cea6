"""The SkipKV paper's tables from finished run directories: accuracy and generation length per method x budget.

    skipkv bench paper-tables runs/reproduce_skipkv/MODEL/runs      # ROOT/<dataset>/<cell>/summary.json

(`python benchmarks/paper_tables.py ROOT`, what benchmarks/reproduce_skipkv.sh runs, is the same.)

One table per dataset and figure: rows are methods in the paper's order (the full cache, R-KV, SnapKV, H2O,
SkipKV without and with steering, SEAL), columns the budgets found; a method without a budget (full, SEAL)
fills every column. Cells: pass@1 in % (mean over samples) and, in the second table, mean generated tokens.
Reads summary.json only (no model is loaded); a cell still running shows its records so far, marked *.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ORDER = ("full", "rkv", "snapkv", "h2o", "skipkv", "skipkv-steer", "seal")
NAMES = {"full": "FullKV", "rkv": "R-KV", "snapkv": "SnapKV", "h2o": "H2O", "skipkv": "SkipKV (eviction only)",
         "skipkv-steer": "SkipKV", "seal": "SEAL (full cache)"}
CELL = re.compile(r"^(?P<label>.+?)(?:-b(?P<budget>\d+))?(?:-s\d+)?$")


def run(args: argparse.Namespace) -> int:
    """`skipkv bench paper-tables ROOT`."""
    from skipkv.errors import SkipKVError

    if not args.root.is_dir():
        raise SkipKVError(f"{args.root} is not a folder (a sweep's out dir: ROOT/<dataset>/<cell>)")
    tables(args.root)
    return 0


def tables(root: Path) -> None:
    """The tables on stdout."""
    for ds in sorted(p for p in root.iterdir() if p.is_dir()):
        cells: dict[tuple[str, int | None], dict] = {}
        for summary in sorted(ds.glob("*/summary.json")):
            m = CELL.match(summary.parent.name)
            if m:
                cells[(m["label"], int(m["budget"]) if m["budget"] else None)] = json.loads(summary.read_text())
        budgets = sorted({b for _, b in cells if b is not None})
        labels = [lab for lab in ORDER if any(k[0] == lab for k in cells)]
        labels += sorted({k[0] for k in cells} - set(labels))
        for title, key, fmt in (("pass@1 (%)", "accuracy", lambda v: f"{100 * v:.1f}"),
                                ("mean generated tokens", "mean_generated_tokens", lambda v: f"{v:.0f}")):
            print(f"\n### {ds.name}: {title}\n")
            print("| method | " + " | ".join(f"budget {b}" for b in budgets) + " |")
            print("|---|" + "---:|" * len(budgets))
            for lab in labels:
                row = []
                for b in budgets:
                    s = cells.get((lab, b)) or cells.get((lab, None))
                    row.append("-" if not s or not s.get("n") else fmt(s[key]) + ("" if s.get("complete") else "*"))
                print(f"| {NAMES.get(lab, lab)} | " + " | ".join(row) + " |")

