"""The analysis fixed in benchmarks/results_skipkv_prereg.yaml (issue 18), run on its records.

    python benchmarks/prereg_skipkv.py docs/results/runs/skipkv_prereg                # Markdown, per dataset
    python benchmarks/prereg_skipkv.py docs/results/runs/skipkv_prereg --json out.json --plot docs/results/plots
    python benchmarks/prereg_skipkv.py docs/results/runs/skipkv_prereg --dataset math500 --json math500.json

Per dataset (gsm8k, math500; a directory `<set>-b<k>` is block k of 50 examples), per cell: correct / n with
a Wilson 95% interval, mean generated tokens, and per chain the check sentences, the flagged sentences and
the compressions. Tests, exact two-sided McNemar on the same examples, Holm-adjusted within each family:
  - primary (blocks 1-4, n = 200 when complete), budgets 64 and 128: skipkv vs rkv, skipkv-steer vs rkv,
    skipkv-steer vs skipkv (6 tests);
  - secondary (blocks 1-2, n = 100), each of 64/128/192: skipkv vs rkv, snapkv, h2o; skipkv-steer vs rkv,
    skipkv, seal (18 tests), and seal vs full (1): 19 tests.
Length (the steering claim) is described, not tested: the paired mean difference in generated tokens with a
bootstrap 95% interval, for skipkv-steer vs skipkv at each budget and seal vs full.
`--baseline-lengths` adds, outside the registered analysis, the same for each SkipKV variant against R-KV and SEAL.
Only examples that every cell of a comparison finished enter it (an interrupted sweep is analysed on what
finished, and the n says so).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

from skipkv.files import exists, read_bytes
from skipkv.report.stats import bootstrap, holm, mcnemar_exact, wilson

CELL = re.compile(r"^(?P<label>.+?)(?:-b(?P<budget>\d+))?-s\d+$")
BLOCK = re.compile(r"^(?P<set>.+?)-b(?P<block>\d+)$")
BUDGETS = ("64", "128", "192")
PRIMARY = [(a, b, budget) for budget in ("64", "128")
           for a, b in (("skipkv", "rkv"), ("skipkv-steer", "rkv"), ("skipkv-steer", "skipkv"))]
SECONDARY = [(a, b, budget) for budget in BUDGETS
             for a, b in (("skipkv", "rkv"), ("skipkv", "snapkv"), ("skipkv", "h2o"), ("skipkv-steer", "rkv"),
                          ("skipkv-steer", "skipkv"), ("skipkv-steer", "seal"))] + [("seal", "full", None)]
PER_CHAIN = ("check_sentences", "flagged_sentences", "compressions")


def load(root: Path, cell_name: re.Pattern = CELL, level: str = "budget") -> dict:
    """{set: {(label, budget or None): {(block, id): record}}}; every cell directory counts, records or not.
    `cell_name` parses a cell directory's name, its group `level` the budget (prereg_frontier reads ratios too)."""
    grid: dict = defaultdict(lambda: defaultdict(dict))
    for d in sorted(p for p in root.glob("*/*") if p.is_dir()):
        cell, block = cell_name.match(d.name), BLOCK.match(d.parent.name)
        if not cell or not block:
            continue
        slot = grid[block["set"]][(cell["label"], cell[level])]
        records = d / "records.jsonl"  # or records.jsonl.gz (`skipkv pack`)
        for line in read_bytes(records, "records").decode().splitlines() if exists(records) else []:
            if line.strip():
                r = json.loads(line)
                slot[(int(block["block"]), r["id"])] = r
    return grid


def cell_of(cells: dict, label: str, budget: str | None) -> dict:
    """The cell `label` at `budget`; a policy that keeps every token (full, seal) has one cell for all budgets."""
    return cells.get((label, budget)) or cells.get((label, None)) or {}


def compare(cells: dict, tests: list, blocks: set[int]) -> list[dict]:
    rows = []
    for a, b, budget in tests:
        ra, rb = cell_of(cells, a, budget), cell_of(cells, b, budget)
        common = sorted(k for k in set(ra) & set(rb) if k[0] in blocks)
        only_a = sum(1 for k in common if ra[k]["correct"] and not rb[k]["correct"])
        only_b = sum(1 for k in common if rb[k]["correct"] and not ra[k]["correct"])
        rows.append({"a": a, "b": b, "budget": budget, "n": len(common),
                     "acc_a": sum(ra[k]["correct"] for k in common) / max(1, len(common)),
                     "acc_b": sum(rb[k]["correct"] for k in common) / max(1, len(common)),
                     "only_a": only_a, "only_b": only_b, "p": mcnemar_exact(only_a, only_b)})
    for row, adj in zip(rows, holm([r["p"] for r in rows])):
        row["p_holm"] = adj
    return rows


def describe(cells: dict, blocks: set[int] | None = None) -> list[dict]:
    """Per cell: accuracy with its Wilson 95% interval, mean tokens and the per-chain counts (over `blocks`
    only, when given)."""
    rows = []
    for (label, budget), recs in sorted(cells.items(), key=lambda kv: (kv[0][1] is not None, int(kv[0][1] or 0),
                                                                       kv[0][0])):
        if blocks is not None:
            recs = {k: r for k, r in recs.items() if k[0] in blocks}
        n = len(recs)
        if not n:
            continue
        k = sum(bool(r["correct"]) for r in recs.values())
        lo, hi = wilson(k, n)
        row = {"label": label, "budget": budget, "n": n, "correct": k, "acc": k / n, "lo": lo, "hi": hi,
               "tokens": sum(r["generated_tokens"] for r in recs.values()) / n}
        for key in PER_CHAIN:
            row[key] = sum(float(r.get(key, 0)) for r in recs.values()) / n
        rows.append(row)
    return rows


LENGTHS: list[tuple[str, str, str | None]] = [("skipkv-steer", "skipkv", x) for x in BUDGETS] + [
    ("seal", "full", None)]  # registered
# Not in the registered analysis (`--baseline-lengths`, added after the grid finished): each SkipKV variant's length
# against R-KV at the same budget and against SEAL. Described like the registered ones, never tested.
BASELINE_LENGTHS: list[tuple[str, str, str | None]] = [
    (a, b, x) for x in BUDGETS
    for a, b in (("skipkv", "rkv"), ("skipkv-steer", "rkv"), ("skipkv", "seal"), ("skipkv-steer", "seal"))]


def lengths(cells: dict, pairs: list[tuple[str, str, str | None]] = LENGTHS) -> list[dict]:
    out = []
    for a, b, budget in pairs:
        ra, rb = cell_of(cells, a, budget), cell_of(cells, b, budget)
        common = sorted(set(ra) & set(rb))
        diffs = [ra[k]["generated_tokens"] - rb[k]["generated_tokens"] for k in common]
        lo, hi = bootstrap(diffs) if diffs else (0.0, 0.0)
        out.append({"a": a, "b": b, "budget": budget, "n": len(diffs),
                    "mean_diff": sum(diffs) / len(diffs) if diffs else 0.0, "lo": lo, "hi": hi})
    return out


BUDGETED = ("rkv", "snapkv", "h2o", "skipkv", "skipkv-steer")  # plotted against the budget
UNBUDGETED = ("full", "seal")  # keep every token: a horizontal band


def plot(name: str, cells: dict, path: Path) -> None:
    """Accuracy (Wilson 95% intervals) and mean generated tokens against the budget, on blocks 1-2, where every
    cell ran the same examples (the secondary family's n; blocks 3-4 hold only the key cells)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = describe(cells, {1, 2})
    fig, (acc, tok) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, label in enumerate(UNBUDGETED):
        r = next((r for r in rows if r["label"] == label), None)
        if r is None:
            continue
        color = f"C{len(BUDGETED) + i}"
        acc.axhline(r["acc"], color=color, ls="--", label=f"{label} (n={r['n']})")
        acc.axhspan(r["lo"], r["hi"], color=color, alpha=0.12)
        tok.axhline(r["tokens"], color=color, ls="--", label=label)
    for i, label in enumerate(BUDGETED):
        pts = sorted((int(r["budget"]), r) for r in rows if r["label"] == label and r["budget"])
        if not pts:
            continue
        xs = [b + (i - 2) * 3 for b, _ in pts]  # a small offset, so the intervals do not cover each other
        ys = [r["acc"] for _, r in pts]
        err = [[r["acc"] - r["lo"] for _, r in pts], [r["hi"] - r["acc"] for _, r in pts]]
        acc.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=f"C{i}",
                     label=f"{label} (n={min(r['n'] for _, r in pts)})")
        tok.plot([b for b, _ in pts], [r["tokens"] for _, r in pts], marker="o", color=f"C{i}", label=label)
    acc.set(xlabel="KV budget (generated tokens kept; prompt protected)", ylabel="accuracy (Wilson 95% CI)",
            title=f"{name}: accuracy, blocks 1-2", xticks=[int(b) for b in BUDGETS])
    tok.set(xlabel="KV budget (generated tokens kept; prompt protected)", ylabel="mean generated tokens",
            title=f"{name}: chain length", xticks=[int(b) for b in BUDGETS])
    acc.legend(fontsize=7)
    tok.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(name: str, result: dict) -> str:
    lines = [f"### {name}", "", "| cell | budget | n | accuracy (95% CI) | mean tokens | check / chain "
             "| flagged / chain | compressions / chain |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in result["cells"]:
        lines.append(f"| {r['label']} | {r['budget'] or '—'} | {r['n']} | {r['correct']}/{r['n']} = {r['acc']:.3f} "
                     f"({r['lo']:.3f}–{r['hi']:.3f}) | {r['tokens']:.0f} | {r['check_sentences']:.2f} | "
                     f"{r['flagged_sentences']:.2f} | {r['compressions']:.2f} |")
    for fam in ("primary", "secondary"):
        lines += ["", f"{fam} family (exact McNemar, Holm over {len(result[fam])} tests)", "",
                  "| A vs B | budget | n | acc A | acc B | only A | only B | p | p (Holm) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result[fam]:
            lines.append(f"| {r['a']} vs {r['b']} | {r['budget'] or '—'} | {r['n']} | {r['acc_a']:.3f} | "
                         f"{r['acc_b']:.3f} | {r['only_a']} | {r['only_b']} | {r['p']:.3g} | {r['p_holm']:.3g} |")
    for key, title in (("lengths", "length (paired mean difference in generated tokens, bootstrap 95% CI; "
                                    "described, not tested)"),
                       ("baseline_lengths", "length against R-KV and SEAL (not in the registered analysis; "
                                            "paired mean difference, bootstrap 95% CI; described, not tested)")):
        if key not in result:
            continue
        lines += ["", title, "", "| A − B | budget | n | mean | 95% CI |", "|---|---:|---:|---:|---|"]
        for r in result[key]:
            lines.append(f"| {r['a']} − {r['b']} | {r['budget'] or '—'} | {r['n']} | {r['mean_diff']:+.1f} | "
                         f"{r['lo']:+.1f} to {r['hi']:+.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="a folder: one PNG per dataset (accuracy and length vs budget)")
    ap.add_argument("--dataset", action="append", help="analyse only this dataset (repeatable; default: every one)")
    ap.add_argument("--baseline-lengths", action="store_true",
                    help="also describe SkipKV's and SkipKV + steering's lengths against R-KV and SEAL "
                         "(not in the registered analysis)")
    args = ap.parse_args(argv)
    grid = load(args.root)
    if args.dataset:
        unknown = sorted(set(args.dataset) - set(grid))
        if unknown:
            ap.error(f"no dataset {', '.join(unknown)} under {args.root} (found: {', '.join(sorted(grid)) or 'none'})")
        grid = {k: v for k, v in grid.items() if k in args.dataset}
    out = {}
    for name, cells in sorted(grid.items()):
        if not any(cells.values()):  # a dataset whose cells have begun but hold no record yet
            continue
        out[name] = {"cells": describe(cells), "primary": compare(cells, PRIMARY, {1, 2, 3, 4}),
                     "secondary": compare(cells, SECONDARY, {1, 2}), "lengths": lengths(cells)}
        if args.baseline_lengths:
            out[name]["baseline_lengths"] = lengths(cells, BASELINE_LENGTHS)
        print(markdown(name, out[name]), end="\n\n")
        if args.plot:
            args.plot.mkdir(parents=True, exist_ok=True)
            plot(name, cells, args.plot / f"skipkv_prereg_{name}.png")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
