"""Wall time of a grid's cells run one by one (`run_eval` per cell) against the same cells sharing one prefill per
example (`run_shared`), in the same process and on the same examples (each separate run loads the model, as a
sweep's cell does); checks that both wrote the same records (timing fields aside).

    OMP_NUM_THREADS=1 skipkv bench shared-prefill --length 4096 --examples 2 --out /tmp/shared-bench

(`python benchmarks/shared_prefill.py ...`, the docs' older command, is the same.) --out is replaced on every run,
so it must be absent, empty, or an earlier output of this tool (only `shared/` and `alone/` in it): any other
folder is refused, never deleted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from skipkv.eval.runner import EvalConfig, run_eval
from skipkv.eval.shared import run_shared

TIMING = ("seconds", "compress_seconds", "session", "finished_at")
CELLS: list[tuple[str, float | None, dict[str, Any]]] = [
    ("full", None, {}), ("streaming_llm", 0.1, {"phase": "prefill"}), ("snapkv", 0.1, {"phase": "prefill"}),
    ("pyramidkv", 0.1, {"phase": "prefill"}), ("rkv", 0.1, {"phase": "prefill"}), ("laprox", 0.1, {}),
    ("laprox", 0.1, {"kernel": 7}), ("snapkv", 0.05, {"phase": "prefill"}), ("laprox", 0.05, {})]


def configs(root: Path, model: str, length: int, examples: int) -> list[EvalConfig]:
    depths = [round((j + 1) / (examples + 1), 3) for j in range(examples)]
    return [EvalConfig(model=model, dataset="niah", policy=p, out=str(root / f"{i}-{p}"), budget_ratio=r,
                       policy_knobs=k, dataset_options={"lengths": [length], "depths": depths},
                       max_new_tokens=32, batch_size=1, quiet=True)
            for i, (p, r, k) in enumerate(CELLS)]


def records(out: str) -> list[dict]:
    rows = [json.loads(line) for line in (Path(out) / "records.jsonl").read_text().splitlines()]
    return sorted(({k: v for k, v in r.items() if k not in TIMING} for r in rows), key=lambda r: r["id"])


def run(args: argparse.Namespace) -> int:
    """`skipkv bench shared-prefill`: the JSON on stdout."""
    from skipkv.errors import SkipKVError

    if args.out.exists():
        entries = {p.name for p in args.out.iterdir()} if args.out.is_dir() else None
        if entries is None or not entries <= {"shared", "alone"}:
            raise SkipKVError(f"{args.out} exists and is not an earlier output of this tool (only shared/ and "
                              "alone/ in it); it is replaced on every run: give a new folder")
        shutil.rmtree(args.out)
    seconds: dict[str, float] = {}
    for mode in ("shared", "alone"):
        cfgs = configs(args.out / mode, args.model, args.length, args.examples)
        t0 = time.perf_counter()
        if mode == "shared":
            run_shared(cfgs)
        else:
            for cfg in cfgs:
                run_eval(cfg)
        seconds[mode] = time.perf_counter() - t0
    pairs = zip(*(configs(args.out / m, args.model, args.length, args.examples) for m in ("shared", "alone")))
    same = all(records(a.out) == records(b.out) for a, b in pairs)
    result = {"length": args.length, "examples": args.examples, "cells": len(CELLS), "seconds": seconds,
              "speedup": seconds["alone"] / seconds["shared"], "identical_records": same}
    print(json.dumps(result, indent=2))
    return 0

