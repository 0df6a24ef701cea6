"""Paired comparison of two eval runs on the same examples: accuracy with Wilson 95% intervals, an exact
McNemar test on the discordant pairs, mean generated length, identical outputs, and the policy stats the
records carry (e.g. SkipKV's flagged_sentences).

    skipkv bench paired runs/results/gsm8k/rkv-b80-s0 runs/results/gsm8k/skipkv-b80-s0

(`python benchmarks/paired.py A B` runs this too.) Records are read packed or not (`skipkv pack`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from skipkv.errors import SkipKVError
from skipkv.report.stats import mcnemar_exact, wilson


def load(run: Path) -> dict:
    """{(example id, sample): record} of a run dir, packed or not; a dir without records is an error."""
    from skipkv.report.runs import RECORDS_FILE, read_records

    rows = read_records(run / RECORDS_FILE)[0]
    if not rows:
        raise SkipKVError(f"{run} holds no records")
    return {(r["id"], r.get("sample", 0)): r for r in rows}


def run(args: argparse.Namespace) -> int:
    """`skipkv bench paired A B`."""
    compare(str(args.run_a), str(args.run_b))
    return 0


def compare(a_dir: str, b_dir: str) -> None:
    a, b = load(Path(a_dir)), load(Path(b_dir))
    keys = sorted(set(a) & set(b))
    if not keys:
        raise SkipKVError(f"{a_dir} and {b_dir} share no example: nothing to pair")
    n = len(keys)
    for name, runs in ((Path(a_dir).name, a), (Path(b_dir).name, b)):
        k = sum(bool(runs[x]["correct"]) for x in keys)
        lo, hi = wilson(k, n)
        gen = sum(runs[x]["generated_tokens"] for x in keys) / max(n, 1)
        kv = sum(runs[x]["decode_peak_kv_tokens"] for x in keys) / max(n, 1)
        print(f"{name:24s} n={n:4d}  accuracy {k / max(n, 1):6.1%} [{lo:.1%}, {hi:.1%}]  mean generated {gen:6.1f}  "
              f"mean decode-peak KV {kv:6.1f} tokens/head")
    only_a = sum(bool(a[x]["correct"]) and not b[x]["correct"] for x in keys)
    only_b = sum(bool(b[x]["correct"]) and not a[x]["correct"] for x in keys)
    same = sum(a[x]["output"] == b[x]["output"] for x in keys)
    print(f"discordant: only {Path(a_dir).name} right {only_a}, only {Path(b_dir).name} right {only_b}; "
          f"exact McNemar p = {mcnemar_exact(only_a, only_b):.3f}; identical outputs {same}/{n}")
    for stat in ("sentences", "check_sentences", "flagged_sentences"):
        vals = [b[x][stat] for x in keys if stat in b[x]]
        if vals:
            print(f"{Path(b_dir).name} {stat}: mean {sum(vals) / len(vals):.2f}, requests with any "
                  f"{sum(v > 0 for v in vals)}/{len(vals)}")
