"""A sweep's grid as one Markdown table per budget: policies down, datasets across (correct / n), pooled over the
datasets with a Wilson 95% interval, and each policy against a reference policy on the same examples (pooled
discordant pairs, exact McNemar). Cells are read from a sweep's output root, OUT/<dataset>/<label>-r<ratio>-s<seed>.

    python benchmarks/grid.py docs/results/runs/longctx4k --against laprox-pool7 [--score] [--datasets niah,niah_multikey]

--score: the mean score (the share of the reference words found, e.g. common_words) instead of correct/n, with a
seeded bootstrap interval over examples, and against the reference the mean paired difference (bootstrap).
Examples missing from any cell of a budget are left out of that budget's comparisons (pairs need both runs).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from skipkv.report.stats import bootstrap, mcnemar_exact, wilson

ORDER = ("full", "streaming_llm", "h2o", "snapkv", "pyramidkv", "rkv")  # baselines first, then the rest by name
CELL = re.compile(r"^(?P<label>.+?)(?:-r(?P<ratio>[0-9.]+))?-s\d+$")


def load(root: Path) -> dict[str, dict[str, dict[str | None, dict[str, dict]]]]:
    """{dataset: {label: {ratio or None: {example id: record}}}}."""
    grid: dict = defaultdict(lambda: defaultdict(dict))
    for records in sorted(root.glob("*/*/records.jsonl")):
        m = CELL.match(records.parent.name)
        if not m:
            continue
        rows = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
        grid[records.parent.parent.name][m["label"]][m["ratio"]] = {r["id"]: r for r in rows}
    return grid


def table(grid, ratio: str, against: str | None, score: bool) -> str:
    datasets = sorted(grid)
    found = set(lab for ds in datasets for lab in grid[ds])
    labels = [lab for lab in ORDER if lab in found] + sorted(found - set(ORDER))
    cell = {(ds, lab): grid[ds][lab].get(ratio, grid[ds][lab].get(None)) for ds in datasets for lab in labels}
    # Only examples every policy of this budget finished, so every row is on the same examples.
    shared = {ds: set.intersection(*[set(cell[ds, lab] or {}) for lab in labels if lab in grid[ds]]) for ds in datasets}
    vs_head = f" this − {against}, mean [95% CI] |" if score else f" vs {against}: only it / only this, p |"
    head = "| policy | " + " | ".join(datasets) + " | pooled [95% CI] |" + (vs_head if against else "")
    lines = [head, "|:---|" + "---:|" * (len(datasets) + 1) + ("---|" if against else "")]
    for lab in labels:
        parts, k_all, n_all, vals, diffs = [], 0, 0, [], []
        only_ref = only_me = 0
        for ds in datasets:
            recs = cell[ds, lab]
            ids = sorted(shared[ds])
            if not recs or not ids:
                parts.append("—")
                continue
            if score:
                v = [float(recs[i]["score"]) for i in ids]
                vals += v
                parts.append(f"{sum(v) / max(len(v), 1):.2f}")
            else:
                k = sum(bool(recs[i]["correct"]) for i in ids)
                k_all, n_all = k_all + k, n_all + len(ids)
                parts.append(f"{k}/{len(ids)}")
            ref = cell.get((ds, against)) if against else None
            if ref and lab != against:
                diffs += [float(recs[i]["score"]) - float(ref[i]["score"]) for i in ids]
                only_ref += sum(bool(ref[i]["correct"]) and not recs[i]["correct"] for i in ids)
                only_me += sum(bool(recs[i]["correct"]) and not ref[i]["correct"] for i in ids)
        if score:
            lo, hi = bootstrap(vals)
            pooled = f"{sum(vals) / max(len(vals), 1):.2f} [{lo:.2f}, {hi:.2f}] (n = {len(vals)})"
        else:
            lo, hi = wilson(k_all, n_all)
            pooled = f"{k_all}/{n_all} [{lo:.0%}, {hi:.0%}]"
        vs = ""
        if against:
            has_ref = any(cell.get((ds, against)) for ds in datasets)
            if lab == against:
                vs = " |"
            elif not has_ref:
                vs = " — |"
            elif score:
                lo, hi = bootstrap(diffs)
                vs = f" {sum(diffs) / max(len(diffs), 1):+.2f} [{lo:+.2f}, {hi:+.2f}] |"
            else:
                vs = f" {only_ref} / {only_me}, p = {mcnemar_exact(only_ref, only_me):.2f} |"
        lines.append(f"| {lab} | " + " | ".join(parts) + f" | {pooled} |" + vs)
    return "\n".join(lines)


def compact(grid, ratios: list[str], against: str | None, score: bool) -> str:
    """One table: policies down, budgets across; each cell the pooled figure and, against the reference, the
    discordant pairs (only it / only this) or the mean paired difference."""
    rows: dict[str, list[str]] = {}
    for r in ratios:
        for line in table(grid, r, against, score).splitlines()[2:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            label, pooled = cells[0], cells[-2 if against else -1]
            pooled = pooled.split(" [")[0] if not score else pooled.split(" (n")[0]
            vs = cells[-1] if against else ""
            vs = vs.split(",")[0] if vs and not score else vs.split(" [")[0] if vs else ""
            rows.setdefault(label, []).append(f"{pooled} ({vs})" if vs and vs != "—" else pooled)
    head = "| policy | " + " | ".join(f"{float(r):.0%}" for r in ratios) + " |"
    return "\n".join([head, "|:---|" + "---:|" * len(ratios)] + [f"| {k} | " + " | ".join(v) + " |" for k, v in rows.items()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--against", default=None, help="reference policy label for the paired column")
    ap.add_argument("--score", action="store_true", help="mean score instead of correct / n")
    ap.add_argument("--compact", action="store_true", help="one table, budgets across (pooled figures only)")
    ap.add_argument("--datasets", default=None, help="comma-separated dataset dirs to keep (default: all)")
    args = ap.parse_args()
    grid = load(args.root)
    if args.datasets:
        grid = {ds: v for ds, v in grid.items() if ds in args.datasets.split(",")}
    ratios = sorted({r for ds in grid.values() for lab in ds.values() for r in lab if r is not None}, key=float)
    if args.compact:
        print(compact(grid, ratios, args.against, args.score))
        return
    for r in ratios:
        print(f"\n**{float(r):.0%} of the prompt**\n")
        print(table(grid, r, args.against, args.score))


if __name__ == "__main__":
    main()
