"""The analyses fixed in benchmarks/results_frontier_reasoning.yaml and results_frontier_longctx.yaml (issue 45):
skipkv's seed methods against the 2026 frontier, run on their records.

    skipkv bench prereg-frontier reasoning docs/results/runs/frontier_reasoning [--json out.json]
    skipkv bench prereg-frontier longctx docs/results/runs/frontier_longctx [--json out.json]

A run root holds one directory per block of examples (`<set>-b<k>`) and in it one per cell (`<label>-b<budget>-s0`
for budgets of generated tokens, `<label>-r<ratio>-s0` for shares of the prompt, `<label>-s0` for the full cache).
Only examples every cell of a comparison finished enter it, so an interrupted grid is analysed on what finished,
and each n says so.

Reasoning (GSM8K, one set): per cell correct / n with a Wilson 95% interval and mean generated tokens; the primary
family, exact two-sided McNemar on the same examples with Holm over its 6 tests (PRIMARY_REASONING): TriAttention
vs R-KV, SkipKV vs TriAttention and the combination (skipkv-tri) vs TriAttention at each of the two budgets; the
same pairs' paired mean difference in generated tokens with a bootstrap 95% interval (described, not tested).

Long prompts (two sets: 8K needles, 8K multi-key needles): per cell and set, exact match (the `contains` grade)
correct / n with a Wilson interval and the mean partial score (`partial_credit`) with a bootstrap interval; the
primary family, McNemar on exact match with Holm over its 8 tests (PRIMARY_LONGCTX): LaProx vs Layer-DefensiveKV
and vs CriticalAdaKV at 5% and 10%, per set; the same pairs' paired mean difference in partial score with a
bootstrap interval (described); a secondary family (Holm over its own tests): every other compressing cell
against LaProx, per set and share.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path

from skipkv.report import prereg_skipkv
from skipkv.report.stats import bootstrap, holm, mcnemar_exact, wilson

CELL = re.compile(r"^(?P<label>.+?)(?:-(?:b|r)(?P<level>[\d.]+))?-s\d+$")
REASONING_BUDGETS = ("64", "128")
PRIMARY_REASONING = [(a, b, x) for x in REASONING_BUDGETS
                     for a, b in (("triattention", "rkv"), ("skipkv", "triattention"), ("skipkv-tri", "triattention"))]
LONGCTX_RATIOS = ("0.05", "0.1")
LONGCTX_SETS = ("niah8k", "multikey8k")
PRIMARY_LONGCTX = [(s, a, b, x) for s in LONGCTX_SETS for x in LONGCTX_RATIOS
                   for a, b in (("laprox", "layer-defensivekv"), ("laprox", "criticalkv-ada"))]
UNCOMPRESSED = ("full",)


def load(root: Path) -> dict:
    """{set: {(label, level or None): {(block, id): record}}}, from plain or packed records."""
    return prereg_skipkv.load(root, CELL, "level")


def _lcs(a: str, b: str) -> int:
    """Length of the longest common subsequence of two strings (dynamic programming)."""
    prev = [0] * (len(b) + 1)
    for ch in a:
        cur = [0]
        for j, other in enumerate(b):
            cur.append(prev[j] + 1 if ch == other else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def partial_credit(output: str, reference) -> float:
    """The registered partial score in [0, 1]: the mean over the references (one, or a list) of, for a reference
    of digits, the best over the output's maximal digit runs d of LCS(d, ref) / max(len(d), len(ref)) (a dropped
    or swapped digit costs a share, a long run of other digits earns little); for any other reference, 1 if the
    output contains it (case-insensitive), else 0."""
    refs = [str(r) for r in reference] if isinstance(reference, (list, tuple)) else [str(reference)]
    runs = re.findall(r"\d+", output)
    scores = []
    for ref in refs:
        if ref.isdigit():
            scores.append(max((_lcs(d, ref) / max(len(d), len(ref)) for d in runs), default=0.0))
        else:
            scores.append(float(ref.lower() in output.lower()))
    return sum(scores) / len(scores) if scores else 0.0


def _cell(cells: dict, label: str, level: str | None) -> dict:
    return cells.get((label, level)) or (cells.get((label, None)) if label in UNCOMPRESSED else None) or {}


def _correct(r: dict) -> bool:
    return bool(r["correct"])


def compare(cells: dict, tests: Sequence[tuple[str, str, str | None]], value: str) -> list[dict]:
    """McNemar on correctness for each (a, b, level), Holm over the list; with the paired mean difference of
    `value` ("tokens" or "partial") and its bootstrap interval."""
    rows: list[dict] = []
    for a, b, level in tests:
        ra, rb = _cell(cells, a, level), _cell(cells, b, level)
        common = sorted(set(ra) & set(rb))
        only_a = sum(1 for k in common if _correct(ra[k]) and not _correct(rb[k]))
        only_b = sum(1 for k in common if _correct(rb[k]) and not _correct(ra[k]))
        diffs = [_value(ra[k], value) - _value(rb[k], value) for k in common]
        lo, hi = bootstrap(diffs) if diffs else (0.0, 0.0)
        rows.append({"a": a, "b": b, "level": level, "n": len(common),
                     "acc_a": sum(_correct(ra[k]) for k in common) / max(1, len(common)),
                     "acc_b": sum(_correct(rb[k]) for k in common) / max(1, len(common)),
                     "only_a": only_a, "only_b": only_b, "p": mcnemar_exact(only_a, only_b),
                     f"{value}_diff": sum(diffs) / len(diffs) if diffs else 0.0, "lo": lo, "hi": hi})
    for row, adj in zip(rows, holm([r["p"] for r in rows])):
        row["p_holm"] = adj
    return rows


def _value(r: dict, value: str) -> float:
    return float(r["generated_tokens"]) if value == "tokens" else partial_credit(str(r["output"]), r["reference"])


def describe(cells: dict, value: str) -> list[dict]:
    rows = []
    for (label, level), recs in sorted(cells.items(), key=lambda kv: (float(kv[0][1] or 0), kv[0][0])):
        n = len(recs)
        if not n:
            continue
        k = sum(_correct(r) for r in recs.values())
        lo, hi = wilson(k, n)
        vals = [_value(r, value) for r in recs.values()]
        vlo, vhi = bootstrap(vals) if value == "partial" else (None, None)
        rows.append({"label": label, "level": level, "n": n, "correct": k, "acc": k / n, "lo": lo, "hi": hi,
                     value: sum(vals) / n, f"{value}_lo": vlo, f"{value}_hi": vhi})
    return rows


def analyse(kind: str, root: Path) -> dict:
    grid = load(root)
    if kind == "reasoning":
        cells: dict = {}
        for per_set in grid.values():  # one set (gsm8k), blocks merged by their (block, id) keys
            for key, recs in per_set.items():
                cells.setdefault(key, {}).update(recs)
        return {"cells": describe(cells, "tokens"), "primary": compare(cells, PRIMARY_REASONING, "tokens")}
    out: dict = {"sets": {}}
    primary: list = []
    for s in LONGCTX_SETS:
        cells = grid.get(s, {})
        labels = sorted({lab for lab, lvl in cells if lvl is not None and lab != "laprox"})
        out["sets"][s] = {"cells": describe(cells, "partial"),
                          "secondary": compare(cells, [(lab, "laprox", x) for x in LONGCTX_RATIOS for lab in labels],
                                               "partial")}
        primary += [dict(row, set=s) for row in compare(cells, [(a, b, x) for ss, a, b, x in PRIMARY_LONGCTX
                                                                if ss == s], "partial")]
    for row, adj in zip(primary, holm([r["p"] for r in primary])):  # one family over both sets
        row["p_holm"] = adj
    out["primary"] = primary
    return out


def markdown(result: dict) -> str:
    lines = []

    def table(rows: list[dict]) -> None:
        if not rows:
            lines.append("(no rows yet)\n")
            return
        keys = list(rows[0])
        lines.append("| " + " | ".join(keys) + " |")
        lines.append("|" + "---|" * len(keys))
        for r in rows:
            lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
        lines.append("")

    if "cells" in result:
        lines.append("## Cells\n")
        table(result["cells"])
    for s, part in result.get("sets", {}).items():
        lines.append(f"## {s}: cells\n")
        table(part["cells"])
        lines.append(f"## {s}: secondary (each against laprox, Holm within)\n")
        table(part["secondary"])
    lines.append("## Primary (Holm over the family)\n")
    table(result["primary"])
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = analyse(args.kind, Path(args.root))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    return 0
