"""Forest plots of a pre-registered grid's families: per family, each policy's accuracy with its Wilson 95%
interval, one panel per budget, the policy it is tested against drawn as a band, and every Holm-significant
difference marked. It draws what the analysis wrote (`benchmarks/prereg.py --json`) and tests nothing itself.
With `--score`, it draws each policy's mean partial score (share of words or names found) with its bootstrap
interval instead: a description the analysis does not test, so nothing is starred.

    python benchmarks/prereg.py docs/results/runs/laprox_prereg --json docs/results/laprox_prereg/analysis.json
    python benchmarks/plot_prereg.py docs/results/laprox_prereg/analysis.json --out docs/results/laprox_prereg \
        --family 8k    # only the families whose name matches
    python benchmarks/plot_prereg.py docs/results/laprox_prereg/analysis.json --out docs/results/laprox_prereg \
        --family '^(vt|cw)4k' --score    # <family>_score.png
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from matplotlib.figure import Figure

from skipkv.report.plots import DPI, slug


def measure(r: dict, score: bool) -> tuple[float, float, float]:
    """(value, low, high) in percent: accuracy with its Wilson interval, or the mean score with its bootstrap one."""
    if score:
        return 100 * r["score"], 100 * r["score_ci"][0], 100 * r["score_ci"][1]
    return 100 * r["k"] / r["n"], 100 * r["lo"], 100 * r["hi"]


def forest(name: str, family: dict, path: Path, score: bool = False) -> None:
    """One panel per budget: policies top to bottom in the analysis's order, accuracy (or mean score) with its
    interval."""
    rows, against = family["rows"], family["against"]
    ratios = sorted({r["ratio"] for r in rows}, key=float)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig = Figure(figsize=(4.2 * len(ratios) + 1.6, 0.32 * len(policies) + 1.4), dpi=DPI)
    axes = fig.subplots(1, len(ratios), sharey=True, squeeze=False)[0]
    for ax, ratio in zip(axes, ratios):
        mine = {r["policy"]: r for r in rows if r["ratio"] == ratio}
        ref = mine.get(against)
        if ref is not None:
            value, lo, hi = measure(ref, score)
            ax.axvspan(lo, hi, color="tab:orange", alpha=0.15, lw=0)
            ax.axvline(value, color="tab:orange", lw=1)
        for y, pol in enumerate(policies):
            r = mine.get(pol)
            if r is None:
                continue
            value, lo, hi = measure(r, score)
            colour = "black" if pol == "full" else "tab:orange" if pol == against else "tab:blue"
            ax.errorbar(value, y, xerr=[[max(0.0, value - lo)], [max(0.0, hi - value)]], fmt="o", ms=4,
                        color=colour, capsize=2, lw=1)
            if not score and r.get("p_holm") is not None and r["p_holm"] <= 0.05:
                ax.annotate("*", (hi, y), xytext=(4, -4), textcoords="offset points", fontsize=11)
        n = next(iter(mine.values()))["n"] if mine else 0
        ax.set_title(f"{float(ratio):.0%} of the prompt (n = {n})", fontsize=9)
        ax.set_xlim(-2, 102)
        ax.set_xlabel("mean score (% of reference words or names found), bootstrap 95% CI" if score
                      else "correct (%), Wilson 95% CI", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(labelsize=8)
    axes[0].set_yticks(range(len(policies)), policies)
    axes[0].invert_yaxis()
    fig.suptitle(f"{name}: band = {against}; mean score, a description, not tested (full cache in black)" if score
                 else f"{name}: band = {against}; * = differs from it, Holm p <= 0.05 (full cache in black)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("analysis", type=Path, help="the JSON written by benchmarks/prereg.py --json")
    ap.add_argument("--out", type=Path, required=True, help="directory for one PNG per family")
    ap.add_argument("--family", default="", help="only the families whose name matches this regex (any case)")
    ap.add_argument("--score", action="store_true",
                    help="draw the mean partial score (families whose rows carry one) instead of accuracy")
    args = ap.parse_args()
    try:
        report = json.loads(args.analysis.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"plot_prereg: cannot read {args.analysis}: {exc}") from None
    try:
        wanted = re.compile(args.family, re.IGNORECASE)
    except re.error as exc:
        raise SystemExit(f"plot_prereg: --family {args.family!r} is not a regex: {exc}") from None
    chosen = {name: family for name, family in report.items() if wanted.search(name) and family.get("rows")}
    if not chosen:
        raise SystemExit(f"plot_prereg: no family with rows in {args.analysis} matches --family {args.family!r}")
    if args.score:
        chosen = {name: family for name, family in chosen.items()
                  if all(r.get("score_ci") is not None for r in family["rows"])}
        if not chosen:
            raise SystemExit(f"plot_prereg: no family matching --family {args.family!r} carries scores")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, family in chosen.items():
        path = args.out / f"{slug(name)}{'_score' if args.score else ''}.png"
        forest(name, family, path, score=args.score)
        print(path)


if __name__ == "__main__":
    main()
