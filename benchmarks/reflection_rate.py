"""How often a model reflects: SEAL's step classes over the outputs of finished runs (no model is loaded).

    python benchmarks/reflection_rate.py docs/results/runs/gsm8k/full-s0 docs/results/runs/math500/rkv-b80-s0

Each output is split at "\\n\\n" into steps and each step after the first is classified as `skipkv steer
build` does (SEAL's keywords: transition first, then reflection, else execution). A steering vector is
mean(reflection ∪ transition) − mean(execution), so a model whose chains have (almost) no reflection or
transition steps gives nothing to estimate it from, and nothing for steering to suppress.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from skipkv.report.runs import read_records
from skipkv.sentences.tracker import classify_step


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    print("| run | chains | steps | execution | reflection | transition | chains with any |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for run in argv:
        records, _ = read_records(Path(run) / "records.jsonl")
        counts: Counter[str] = Counter()
        with_any = 0
        for rec in records:
            labels = [classify_step(s) for s in str(rec.get("output", "")).split("\n\n")[1:] if s.strip()]
            counts.update(labels)
            with_any += any(label != "execution" for label in labels)
        print(f"| {run} | {len(records)} | {sum(counts.values())} | {counts['execution']} | "
              f"{counts['reflection']} | {counts['transition']} | {with_any} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
