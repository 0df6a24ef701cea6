"""The reflective testbed's calibration table from finished eval runs (no model is loaded).

    python benchmarks/testbed_calibration.py docs/results/runs/calib-gsm8k/*

Per run: chains, accuracy, mean generated tokens, SEAL step classes per chain (the output split at "\\n\\n",
steps after the first, classified as `skipkv steer build` does: transition first, then reflection), chains
with any non-execution step, and `redundant_sentences` per chain (generated sentences that a later sentence
repeats at cosine > tau; the runs use policy skipkv with a budget above every chain, so nothing is evicted
and the tracker only counts).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from skipkv.report.runs import read_records
from skipkv.sentences.tracker import classify_step


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python benchmarks/testbed_calibration.py RUN_DIR ...", file=sys.stderr)
        return 2
    print("| run | chains | accuracy | mean generated tokens | reflection steps / chain | transition steps / chain "
          "| chains with any | flagged at tau (redundant sentences) / chain |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for run in argv:
        recs, _ = read_records(Path(run) / "records.jsonl")
        if not recs:
            continue
        n, steps, with_any = len(recs), Counter(), 0
        for r in recs:
            labels = [classify_step(s) for s in str(r["output"]).split("\n\n")[1:] if s.strip()]
            steps.update(labels)
            with_any += any(label != "execution" for label in labels)
        mean = lambda key: sum(float(r.get(key, 0)) for r in recs) / n  # noqa: E731
        print(f"| {Path(run).name} | {n} | {mean('correct'):.2f} | {mean('generated_tokens'):.0f} | "
              f"{steps['reflection'] / n:.2f} | {steps['transition'] / n:.2f} | {with_any}/{n} | "
              f"{mean('redundant_sentences'):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
