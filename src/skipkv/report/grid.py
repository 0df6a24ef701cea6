"""A sweep's grid as one Markdown table per budget: policies down, datasets across (correct / n), pooled over the
datasets with a Wilson 95% interval, and each policy against a reference policy on the same examples (pooled
discordant pairs, exact McNemar). Cells are read from a sweep's output root, OUT/<dataset>/<label>-r<ratio>-s<seed>.

    skipkv bench grid docs/results/runs/longctx4k --against laprox-pool7 [--score] [--datasets niah,niah_multikey]

(`python benchmarks/grid.py ...`, the command the docs' older tables name, runs this too.) Records are read packed
or not (`skipkv pack`).

--score: the mean score (the share of the reference words found, e.g. common_words) instead of correct/n, with a
seeded bootstrap interval over examples, and against the reference the mean paired difference (bootstrap).
Examples missing from any cell of a budget are left out of that budget's comparisons (pairs need both runs).
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from skipkv.report.stats import bootstrap, mcnemar_exact, wilson

ORDER = ("full", "streaming_llm", "h2o", "snapkv", "pyramidkv", "rkv")  # baselines first, then the rest by name
CELL = re.compile(r"^(?P<label>.+?)(?:-r(?P<ratio>[0-9.]+))?-s\d+$")


def load(root: Path) -> dict[str, dict[str, dict[str | None, dict[str, dict]]]]:
    """{dataset: {label: {ratio or None: {example id: record}}}}, from records packed or not."""
    from skipkv.report.runs import RECORDS_FILE, read_records

    grid: dict = defaultdict(lambda: defaultdict(dict))
    for cell in sorted(d for d in root.glob("*/*") if d.is_dir()):
        m = CELL.match(cell.name)
        rows = read_records(cell / RECORDS_FILE)[0] if m else []
        if rows:
            grid[cell.parent.name][m["label"]][m["ratio"]] = {r["id"]: r for r in rows}  # type: ignore[index]
    return grid


@dataclass
class Row:
    """One policy at one budget: per-dataset figures, the pooled figure and its interval, and against the
    reference the short comparison (discordant pairs or mean difference) and its detail (p or interval)."""

    label: str
    parts: list[str]
    pooled: str
    interval: str
    vs: str = ""  # empty for the reference itself; "—" when the reference has no run at this budget
    vs_detail: str = ""


def rows(grid, ratio: str, against: str | None, score: bool) -> list[Row]:
    datasets = sorted(grid)
    found = set(lab for ds in datasets for lab in grid[ds])
    labels = [lab for lab in ORDER if lab in found] + sorted(found - set(ORDER))
    cell = {(ds, lab): grid[ds][lab].get(ratio, grid[ds][lab].get(None)) for ds in datasets for lab in labels}
    # Only examples every policy of this budget finished, so every row is on the same examples.
    shared = {ds: set.intersection(*[set(cell[ds, lab] or {}) for lab in labels if lab in grid[ds]]) for ds in datasets}
    has_ref = against is not None and any(cell.get((ds, against)) for ds in datasets)
    out = []
    for lab in labels:
        parts: list[str] = []
        vals: list[float] = []
        refs: list[float | None] = []
        for ds in datasets:
            recs, ids = cell[ds, lab], sorted(shared[ds])
            if not recs or not ids:
                parts.append("—")
                continue
            v = [float(recs[i]["score"] if score else bool(recs[i]["correct"])) for i in ids]
            vals += v
            parts.append(f"{sum(v) / len(v):.2f}" if score else f"{int(sum(v))}/{len(v)}")
            ref = cell.get((ds, against)) if has_ref else None
            if ref:
                refs += [float(ref[i]["score"] if score else bool(ref[i]["correct"])) for i in ids]
            else:
                refs += [None] * len(ids)
        n = len(vals)
        if score:
            lo, hi = bootstrap(vals)
            row = Row(lab, parts, f"{sum(vals) / max(n, 1):.2f}", f"[{lo:.2f}, {hi:.2f}] (n = {n})")
        else:
            lo, hi = wilson(int(sum(vals)), n)
            row = Row(lab, parts, f"{int(sum(vals))}/{n}", f"[{lo:.0%}, {hi:.0%}]")
        pairs = [(me, ref) for me, ref in zip(vals, refs) if ref is not None]
        if against is not None and lab != against:
            if not has_ref:
                row.vs = "—"
            elif score:
                diffs = [me - ref for me, ref in pairs]
                lo, hi = bootstrap(diffs)
                row.vs, row.vs_detail = f"{sum(diffs) / max(len(diffs), 1):+.2f}", f"[{lo:+.2f}, {hi:+.2f}]"
            else:
                only_ref = sum(bool(ref) and not me for me, ref in pairs)
                only_me = sum(bool(me) and not ref for me, ref in pairs)
                row.vs, row.vs_detail = f"{only_ref} / {only_me}", f"p = {mcnemar_exact(only_ref, only_me):.2f}"
        out.append(row)
    return out


def table(grid, ratio: str, against: str | None, score: bool) -> str:
    datasets = sorted(grid)
    vs_head = f" this − {against}, mean [95% CI] |" if score else f" vs {against}: only it / only this, p |"
    lines = ["| policy | " + " | ".join(datasets) + " | pooled [95% CI] |" + (vs_head if against else ""),
             "|:---|" + "---:|" * (len(datasets) + 1) + ("---|" if against else "")]
    for r in rows(grid, ratio, against, score):
        vs = " |" if against else ""
        if against and r.vs:
            vs = f" {r.vs}{(' ' if score else ', ') + r.vs_detail if r.vs_detail else ''} |"
        lines.append(f"| {r.label} | " + " | ".join(r.parts) + f" | {r.pooled} {r.interval} |" + vs)
    return "\n".join(lines)


def compact(grid, ratios: list[str], against: str | None, score: bool) -> str:
    """One table: policies down, budgets across; each cell the pooled figure (with its interval for scores)
    and, against the reference, the discordant pairs (only it / only this) or the mean paired difference."""
    cells: dict[str, list[str]] = {}
    for ratio in ratios:
        for r in rows(grid, ratio, against, score):
            fig = f"{r.pooled} {r.interval.split(' (n')[0]}" if score else r.pooled
            cells.setdefault(r.label, []).append(f"{fig} ({r.vs})" if r.vs and r.vs != "—" else fig)
    head = "| policy | " + " | ".join(f"{float(r):.0%}" for r in ratios) + " |"
    body = [f"| {k} | " + " | ".join(v) + " |" for k, v in cells.items()]
    return "\n".join([head, "|:---|" + "---:|" * len(ratios)] + body)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("root", type=Path, help="a sweep's output root: ROOT/<dataset>/<label>-r<ratio>-s<seed>")
    ap.add_argument("--against", default=None, help="reference policy label for the paired column")
    ap.add_argument("--score", action="store_true", help="mean score instead of correct / n")
    ap.add_argument("--compact", action="store_true", help="one table, budgets across (pooled figures only)")
    ap.add_argument("--datasets", default=None, help="comma-separated dataset dirs to keep (default: all)")


def run(args: argparse.Namespace) -> int:
    """`skipkv bench grid`: the tables on stdout."""
    from skipkv.errors import SkipKVError

    if not args.root.is_dir():
        raise SkipKVError(f"{args.root} is not a folder")
    grid = load(args.root)
    if not grid:
        raise SkipKVError(f"{args.root} holds no finished cells (ROOT/<dataset>/<label>[-r<ratio>]-s<seed>)")
    if args.datasets:
        grid = {ds: v for ds, v in grid.items() if ds in args.datasets.split(",")}
    ratios = sorted({r for ds in grid.values() for lab in ds.values() for r in lab if r is not None}, key=float)
    if args.compact:
        print(compact(grid, ratios, args.against, args.score))
        return 0
    for r in ratios:
        print(f"\n**{float(r):.0%} of the prompt**\n")
        print(table(grid, r, args.against, args.score))
    return 0

