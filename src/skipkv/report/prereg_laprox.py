"""The analysis fixed in benchmarks/results_laprox_prereg.yaml (issue 19): per test family, each policy's correct / n
with a Wilson 95% interval at each budget, and each compressing policy against `laprox` (the seed's method) on
the same examples: discordant pairs, exact two-sided McNemar p, and Holm's adjusted p over the whole family.

    python benchmarks/prereg.py docs/results/runs/laprox_prereg            # Markdown tables, one per family
    python benchmarks/prereg.py docs/results/runs/laprox_prereg --json out.json

Families (as the config states them, before any cell ran):
  - primary: the two 8K needle sets pooled (niah8k-b*, multikey8k-b*), 12 policies x 2 budgets = 24 tests;
  - secondary, each its own family of 24: niah8k, multikey8k, vt4k (variable tracking), cw4k (common words,
    correct = every reference word found; the mean share found is printed as a description, not tested, beside
    each cell's paired difference from the row tested against, with a bootstrap interval over examples).
    vt4k's mean share of variable names found is printed too, as an exploratory description the config did not
    register (added after the grid finished, when every compressing cell of vt4k found 0/30 chains whole).
Amendment (committed with its two cells, laprox-head and adakv, before either ran; the families above are
unchanged and never see them): head granularity, built after the grid started. For every family above its own
family of 4 policies x 2 budgets = 8 tests, Holm within it: `laprox-head` (the seed's method with one top-k over
every (layer, kv head)) against laprox (the granularity flipped alone), snapkv, rkv and adakv (SnapKV's scores
with Ada-KV's per-layer head allocation), on the examples all of full, snapkv, rkv, laprox, laprox-head and
adakv finished.
A dataset directory `<set>-b<k>` is block k of set <set>; an example is (block, id). Only examples that every
cell of a budget finished (the full cache included) enter that budget's rows, so an interrupted sweep is
analysed on its finished examples; the header says how many, and which blocks are complete.

A sensitivity check, not a family of its own: `--exclude BLOCK:ID` (repeatable) drops an example from every cell
before anything is counted, e.g. the examples whose cells ran on two machines or kernels (docs/results.md):

    python benchmarks/prereg.py docs/results/runs/laprox_prereg --exclude vt4k:variable_tracking-4096-18
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from skipkv.files import exists, read_bytes
from skipkv.report.stats import bootstrap, holm, mcnemar_exact, wilson

AGAINST = "laprox"
BASELINES = ("full", "streaming_llm", "h2o", "snapkv", "pyramidkv", "rkv")
# The registered grid's cells (the families above are computed on exactly these) and the amendment's.
REGISTERED = BASELINES + tuple(f"laprox{a}{b}{c}" for a in ("", "-attn") for b in ("", "-layer")
                               for c in ("", "-pool7"))
AMENDMENT = {"against": "laprox-head", "labels": ("full", "snapkv", "rkv", "adakv", "laprox", "laprox-head")}
FAMILIES = {"8K needles pooled (primary)": ("niah8k", "multikey8k"), "niah8k": ("niah8k",),
            "multikey8k": ("multikey8k",), "vt4k": ("vt4k",), "cw4k": ("cw4k",)}
CELL = re.compile(r"^(?P<label>.+?)(?:-r(?P<ratio>[0-9.]+))?-s\d+$")
BLOCK = re.compile(r"^(?P<set>.+?)(?:-b(?P<block>\d+))?$")


def load(root: Path) -> dict[str, dict[str, dict[str | None, dict[tuple[str, str], dict]]]]:
    """{set: {policy label: {ratio or None: {(block, example id): record}}}} from OUT/<dataset label>/<cell>."""
    grid: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    # Every cell directory counts, records or not: a cell that has not finished an example yet must keep that
    # example out of the comparisons (the sweep creates all of a unit's cell directories when the unit starts).
    for d in sorted(p for p in root.glob("*/*") if p.is_dir()):
        cell, block = CELL.match(d.name), BLOCK.match(d.parent.name)
        if not cell or not block:
            continue
        slot = grid[block["set"]][cell["label"]][cell["ratio"]]
        records = d / "records.jsonl"  # or records.jsonl.gz (`skipkv pack`)
        if not exists(records):
            continue
        for line in read_bytes(records, "records").decode().splitlines():
            if line.strip():
                r = json.loads(line)
                slot[(d.parent.name, r["id"])] = r
    return grid


def exclude(grid, keys: list[str]) -> list[tuple[str, str]]:
    """Drop each `BLOCK:ID` of `keys` from every cell of `grid`, in place; returns the (block, id) pairs dropped.
    A key that no cell holds is an error (a typo would otherwise leave the analysis silently unchanged)."""
    dropped = []
    for key in keys:
        block, sep, ex = key.partition(":")
        hit = False
        for policies in grid.values():
            for by_ratio in policies.values():
                for records in by_ratio.values():
                    hit |= records.pop((block, ex), None) is not None
        if not sep or not hit:
            raise SystemExit(f"prereg: --exclude {key!r}: no cell holds example {ex!r} of block {block!r}")
        dropped.append((block, ex))
    return dropped


def family_rows(grid, sets: tuple[str, ...], ratios: list[str], against: str = AGAINST,
                keep: tuple[str, ...] = REGISTERED) -> tuple[list[dict], dict[str, int]]:
    """Rows {policy, ratio, k, n, lo, hi, score, only_ref, only_me, p} for every policy of `keep` and budget on the
    examples that every such cell of that budget finished in `sets`, each tested against `against`; p is None
    for `against` itself and the full cache."""
    labels = sorted({lab for s in sets for lab in grid.get(s, {}) if lab in keep},
                    key=lambda x: (x not in BASELINES, BASELINES.index(x) if x in BASELINES else 0, x))
    out, sizes = [], {}
    for ratio in ratios:
        cells = {lab: {k: v for s in sets for k, v in grid.get(s, {}).get(lab, {}).get(
            None if lab == "full" else ratio, {}).items()} for lab in labels}
        shared = set.intersection(*(set(c) for c in cells.values())) if cells else set()
        ids = sorted(shared)
        sizes[ratio] = len(ids)
        if not ids or against not in cells:
            continue
        ref = [bool(cells[against][i]["correct"]) for i in ids]
        ref_score = [float(cells[against][i]["score"]) for i in ids]
        for lab in labels:
            me = [bool(cells[lab][i]["correct"]) for i in ids]
            lo, hi = wilson(sum(me), len(me))
            only_ref = sum(r and not m for r, m in zip(ref, me))
            only_me = sum(m and not r for r, m in zip(ref, me))
            tested = lab not in (against, "full")
            score = [float(cells[lab][i]["score"]) for i in ids]
            diff = [m - r for m, r in zip(score, ref_score)]
            out.append({"policy": lab, "ratio": ratio, "k": sum(me), "n": len(me), "lo": lo, "hi": hi,
                        "score": sum(score) / len(ids), "score_ci": bootstrap(score),
                        # Paired on the same examples, a description (no test): this cell's score minus
                        # `against`'s, with a bootstrap interval over examples.
                        "score_diff": sum(diff) / len(ids) if tested else None,
                        "score_diff_ci": bootstrap(diff) if tested else None,
                        "only_ref": only_ref if tested else None, "only_me": only_me if tested else None,
                        "p": mcnemar_exact(only_ref, only_me) if tested else None})
    tested_rows = [r for r in out if r["p"] is not None]
    for r, adj in zip(tested_rows, holm([r["p"] for r in tested_rows])):
        r["p_holm"] = adj
    return out, sizes


def blocks(grid, sets: tuple[str, ...], root: Path) -> str:
    """Which dataset directories of these sets every cell has fully finished (a cell's config says how many)."""
    done, started = [], []
    dirs = (p for p in root.iterdir() if p.is_dir() and BLOCK.match(p.name)["set"] in sets)  # type: ignore[index]
    for d in sorted(dirs):
        started.append(d.name)
        summaries = list(d.glob("*/summary.json"))
        cells = [c for c in d.iterdir() if c.is_dir()]
        if cells and len(summaries) == len(cells):
            done.append(d.name)
    return f"complete: {', '.join(done) or 'none'}; started: {len(started)}"


def _p(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def markdown(name: str, rows: list[dict], sizes: dict[str, int], note: str, score: bool,
             against: str = AGAINST) -> str:
    lines = [f"**{name}** ({note}; examples every cell finished: "
             + ", ".join(f"{float(r):.0%}: {n}" for r, n in sizes.items()) + ")", "",
             "| policy | budget | correct [95% CI] |"
             + (f" mean score [95% CI] | score − {against}, paired [95% CI] |" if score else "")
             + f" vs {against}: only {against} / only this | p | p (Holm) |",
             "|:---|---:|---:|" + ("---:|---:|" if score else "") + "---:|---:|---:|"]
    for r in rows:
        vs = (f" {r['only_ref']} / {r['only_me']} | {_p(r['p'])} | {_p(r['p_holm'])}"
              f"{' *' if r['p_holm'] <= 0.05 else ''} |") if r["p"] is not None else " | | |"
        sc = ""
        if score:
            d = r["score_diff"]
            sc = (f" {r['score']:.2f} [{r['score_ci'][0]:.2f}, {r['score_ci'][1]:.2f}] |"
                  + (f" {d:+.2f} [{r['score_diff_ci'][0]:+.2f}, {r['score_diff_ci'][1]:+.2f}] |" if d is not None
                     else " |"))
        budget = "—" if r["policy"] == "full" else f"{float(r['ratio']):.0%}"
        lines.append(f"| {r['policy']} | {budget} | {r['k']}/{r['n']} [{r['lo']:.0%}, {r['hi']:.0%}] |{sc}{vs}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--json", type=Path, default=None, help="also write every family's rows here")
    ap.add_argument("--exclude", action="append", default=[], metavar="BLOCK:ID",
                    help="leave this example out of every cell (a sensitivity check; repeatable)")
    args = ap.parse_args()
    if not args.root.is_dir():
        raise SystemExit(f"prereg: no such directory {args.root}")
    grid = load(args.root)
    dropped = exclude(grid, args.exclude)
    if dropped:
        print(f"Excluded from every cell (sensitivity check): {', '.join(f'{b}:{i}' for b, i in dropped)}\n")
    ratios = sorted({r for s in grid.values() for lab in s.values() for r in lab if r is not None}, key=float)
    report = {}
    amended: list[tuple[str, tuple[str, ...], Any, Any]] = [
        (f"amendment, head granularity: {name}", sets, AMENDMENT["against"], AMENDMENT["labels"])
        for name, sets in FAMILIES.items()]
    for name, sets, against, keep in [(n, s, AGAINST, REGISTERED) for n, s in FAMILIES.items()] + amended:
        rows, sizes = family_rows(grid, sets, ratios, against, keep)
        if not rows:
            print(f"**{name}**: no example finished in every cell yet\n")
            continue
        report[name] = {"sets": sets, "against": against, "examples": sizes, "rows": rows,
                        **({"excluded": [f"{b}:{i}" for b, i in dropped]} if dropped else {})}
        partial = bool({"cw4k", "vt4k"} & set(sets))  # graded by the share of words or names found
        print(markdown(name, rows, sizes, blocks(grid, sets, args.root), score=partial, against=against) + "\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
