"""How often a model reflects, from finished runs' outputs (no model is loaded): SEAL's step classes per run, and the
reflective testbed's calibration table.

    skipkv bench reflection-rate docs/results/runs/gsm8k/full-s0 docs/results/runs/math500/rkv-b80-s0
    skipkv bench testbed-calibration docs/results/runs/calib-gsm8k/*

Each output is split at "\\n\\n" into steps and each step after the first is classified as `skipkv steer build`
does (SEAL's keywords: transition first, then reflection, else execution). A steering vector is mean(reflection ∪
transition) − mean(execution), so a model whose chains have (almost) no reflection or transition steps gives
nothing to estimate it from, and nothing for steering to suppress. The calibration table adds accuracy, mean
generated tokens and `redundant_sentences` per chain (generated sentences that a later sentence repeats at cosine
> tau; those runs use policy skipkv with a budget above every chain, so nothing is evicted and the tracker only
counts). Records are read packed or not (`skipkv pack`). (`python benchmarks/reflection_rate.py` and
`benchmarks/testbed_calibration.py`, the docs' older commands, run these too.)
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from skipkv.errors import SkipKVError


def step_classes(records: list[dict[str, Any]]) -> tuple[Counter[str], int]:
    """SEAL's step classes over the records' outputs, and how many chains have any non-execution step."""
    from skipkv.sentences.tracker import classify_step

    counts: Counter[str] = Counter()
    with_any = 0
    for rec in records:
        labels = [classify_step(s) for s in str(rec.get("output", "")).split("\n\n")[1:] if s.strip()]
        counts.update(labels)
        with_any += any(label != "execution" for label in labels)
    return counts, with_any


def _records(run: Path) -> list[dict[str, Any]]:
    from skipkv.report.runs import RECORDS_FILE, read_records

    if not run.is_dir():
        raise SkipKVError(f"{run} is not a run folder")
    return read_records(run / RECORDS_FILE)[0]


def reflection_rate(runs: list[Path]) -> str:
    """One Markdown row per run: chains, steps by class, chains with any reflection or transition step."""
    lines = ["| run | chains | steps | execution | reflection | transition | chains with any |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        records = _records(run)
        counts, with_any = step_classes(records)
        lines.append(f"| {run} | {len(records)} | {sum(counts.values())} | {counts['execution']} | "
                     f"{counts['reflection']} | {counts['transition']} | {with_any} |")
    return "\n".join(lines)


def testbed_calibration(runs: list[Path]) -> str:
    """One Markdown row per run with records: accuracy, length, step classes and flagged sentences per chain."""
    lines = ["| run | chains | accuracy | mean generated tokens | reflection steps / chain | transition steps / chain "
             "| chains with any | flagged at tau (redundant sentences) / chain |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        recs = _records(run)
        if not recs:
            continue
        n = len(recs)
        steps, with_any = step_classes(recs)

        def mean(key: str, recs: list = recs, n: int = n) -> float:
            return sum(float(r.get(key, 0)) for r in recs) / n

        lines.append(f"| {run.name} | {n} | {mean('correct'):.2f} | {mean('generated_tokens'):.0f} | "
                     f"{steps['reflection'] / n:.2f} | {steps['transition'] / n:.2f} | {with_any}/{n} | "
                     f"{mean('redundant_sentences'):.2f} |")
    return "\n".join(lines)


def run_reflection_rate(args: argparse.Namespace) -> int:
    print(reflection_rate(args.runs))
    return 0


def run_testbed_calibration(args: argparse.Namespace) -> int:
    print(testbed_calibration(args.runs))
    return 0
