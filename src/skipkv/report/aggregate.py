"""Aggregation: run records -> one row per (dataset, model, policy variant, budget), recomputed from records.

    sections = aggregate(load_runs([Path("runs/sweep_gsm8k")]))
    for sec in sections: print(sec.dataset, [(r.policy, r.budget_label, r.accuracy) for r in sec.rows])

Runs that differ only by seed are pooled (their records are concatenated). Runs of one policy that differ
in a knob or a sampling setting stay apart, and their label names the setting (`rkv (window=8)`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from skipkv.report.runs import Run
from skipkv.report.stats import interval

MIB = 1 << 20
# Keys that are the x-axis or pooled over, hence never part of a policy-variant label.
_NOT_VARIANT = frozenset({"name", "budget", "budget_ratio", "ratio", "seed"})


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _values(records: Iterable[dict[str, Any]], key: str) -> list[float]:
    """Numeric values of `key` over records, skipping records that lack it (older runs, failed stats)."""
    out = []
    for rec in records:
        v = rec.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(float(v))
    return out


@dataclass(frozen=True)
class Row:
    """Metrics of one table row. `accuracy` is a fraction; KV tokens are per request, per kv head."""

    dataset: str
    model: str
    policy: str  # display label: the policy name, plus the knobs that tell its variants apart
    budget: int | None  # tokens; None for the full cache or a ratio-sized run
    ratio: float | None
    is_full: bool
    n: int  # records (examples x samples) pooled over seeds
    num_runs: int
    accuracy: float  # pass@1: mean over examples of the mean over their samples
    mean_generated_tokens: float
    mean_kv_tokens: float  # mean over records of each record's peak KV length
    peak_kv_tokens: float  # max over records
    peak_kv_mib: float  # max over records of peak KV bytes, in MiB
    mean_decode_kv_tokens: float = math.nan  # mean over records of the peak KV length over decode steps only
    accuracy_ci: tuple[float, float] = (math.nan, math.nan)  # 95% interval of `accuracy` (report/stats.interval)
    mean_decode_kv_mib: float = math.nan  # mean over records of the K/V bytes held over decode steps (MiB)
    mean_compress_seconds: float = math.nan  # mean over records of the wall time spent compressing
    ratio_of: str = "the full cache"  # what `ratio` is a fraction of
    records: tuple[dict[str, Any], ...] = field(default=(), repr=False, compare=False)

    @property
    def budget_label(self) -> str:
        if self.is_full:
            return "full"
        if self.budget is not None:
            return str(self.budget)
        return f"{self.ratio:.0%}" if self.ratio is not None else "?"

    @property
    def is_needle(self) -> bool:
        return any("depth" in r and "length" in r for r in self.records)


@dataclass(frozen=True)
class Section:
    """All rows of one dataset (and model): one table and one set of plots."""

    dataset: str
    model: str
    rows: tuple[Row, ...]

    @property
    def full(self) -> list[Row]:
        return [r for r in self.rows if r.is_full]

    @property
    def is_needle(self) -> bool:
        return any(r.is_needle for r in self.rows)


def pass_at_1(runs_records: Sequence[Sequence[dict[str, Any]]]) -> float:
    """Mean over examples (of every run) of the mean of `correct` over that example's samples.

    The runner's summary.json defines accuracy this way; an example with more finished samples than
    another does not weigh more. A record without a grade counts as wrong.
    """
    return _mean(per_example_scores(runs_records))


def per_example_scores(runs_records: Sequence[Sequence[dict[str, Any]]]) -> list[float]:
    """Per example (of every run), the mean of `correct` over its samples: what pass@1 averages."""
    per_example: list[float] = []
    for records in runs_records:
        by_id: dict[str, list[float]] = {}
        for r in records:
            by_id.setdefault(str(r.get("id")), []).append(1.0 if r.get("correct") is True else 0.0)
        per_example += [sum(v) / len(v) for v in by_id.values()]
    return per_example


def summarize(runs_records: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """The row metrics over the records of one or more runs (the numbers behind one table row)."""
    records = [r for recs in runs_records for r in recs]
    kv_tokens = _values(records, "peak_kv_tokens")
    kv_bytes = _values(records, "peak_kv_bytes")
    scores = per_example_scores(runs_records)
    return {
        "accuracy": _mean(scores),
        "accuracy_ci": interval(scores) if scores else (math.nan, math.nan),
        "mean_generated_tokens": _mean(_values(records, "generated_tokens")),
        "mean_kv_tokens": _mean(kv_tokens),
        "peak_kv_tokens": max(kv_tokens) if kv_tokens else math.nan,
        "peak_kv_mib": max(kv_bytes) / MIB if kv_bytes else math.nan,
        "mean_decode_kv_tokens": _mean(_values(records, "decode_peak_kv_tokens")),
        "mean_decode_kv_mib": _mean(_values(records, "decode_peak_kv_bytes")) / MIB,
        "mean_compress_seconds": _mean(_values(records, "compress_seconds")),
    }


def layer_shares(records: Iterable[dict[str, Any]]) -> list[float] | None:
    """Per layer, the mean over records of the entries that layer held at the end, as a share of the prompt.

    What a model-wide (LaProx) or per-layer (PyramidKV) budget gave each layer (the LaProx paper's Figure 6).
    None when no record has `layer_kv_tokens` or the records disagree on the number of layers.
    """
    rows = [[n / r["prompt_tokens"] for n in r["layer_kv_tokens"]] for r in records
            if r.get("layer_kv_tokens") and isinstance(r.get("prompt_tokens"), int) and r["prompt_tokens"] > 0]
    if not rows or len({len(x) for x in rows}) != 1:
        return None
    return [sum(col) / len(col) for col in zip(*rows)]


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _variant(run: Run) -> dict[str, str]:
    """What, besides budget and seed, distinguishes this run from others of the same policy."""
    items = {k: _canon(v) for k, v in run.policy_config.items() if k not in _NOT_VARIANT}
    items.update({k: _canon(v) for k, v in run.sampling.items() if k not in _NOT_VARIANT})
    return items


def _labels(runs: list[Run]) -> dict[int, str]:
    """Display label per run (by index): the policy name, plus the settings its variants disagree on."""
    variants = [_variant(r) for r in runs]
    labels: dict[int, str] = {}
    for name in {r.policy for r in runs}:
        idx = [i for i, r in enumerate(runs) if r.policy == name]
        keys = sorted({k for i in idx for k in variants[i]})
        differ = [k for k in keys if len({variants[i].get(k) for i in idx}) > 1]
        for i in idx:
            extra = ", ".join(f"{k}={json.loads(variants[i][k]) if k in variants[i] else '-'}" for k in differ)
            labels[i] = f"{name} ({extra})" if extra else name
    return labels


def natural_key(label: str) -> tuple:
    """Sort key that orders numbers inside labels by value: `rkv (window=8)` before `rkv (window=32)`."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", label))


def _budget_order(row: Row) -> tuple:
    # Full cache first, then token budgets ascending, then ratios ascending.
    if row.is_full:
        return (0, 0.0)
    if row.budget is not None:
        return (1, float(row.budget))
    return (2, row.ratio if row.ratio is not None else math.inf)


def aggregate(runs: list[Run]) -> list[Section]:
    """Group runs into sections (dataset, model) and rows (policy variant, budget), metrics from records."""
    by_section: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        by_section.setdefault((run.dataset, run.model), []).append(run)
    sections = []
    for (dataset, model), sec_runs in sorted(by_section.items()):
        labels = _labels(sec_runs)
        groups: dict[tuple, list[Run]] = {}
        for i, run in enumerate(sec_runs):
            key = (labels[i], run.is_full, run.budget, None if run.is_full or run.budget is not None else run.ratio)
            groups.setdefault(key, []).append(run)
        rows = []
        for (label, is_full, budget, ratio), group in groups.items():
            records = [rec for run in group for rec in run.records]
            rows.append(Row(dataset=dataset, model=model, policy=label, budget=budget, ratio=ratio,
                            is_full=is_full, n=len(records), num_runs=len(group), records=tuple(records),
                            ratio_of=group[0].ratio_of,
                            **summarize([run.records for run in group])))
        rows.sort(key=lambda r: (not r.is_full, natural_key(r.policy), _budget_order(r)))
        sections.append(Section(dataset=dataset, model=model, rows=tuple(rows)))
    return sections


@dataclass(frozen=True)
class NeedleGrid:
    """Accuracy over needle depth x context length for one row: `accuracy[i][j]` at depths[i], lengths[j]."""

    depths: tuple[float, ...]
    lengths: tuple[int, ...]
    accuracy: tuple[tuple[float, ...], ...]  # nan where no record
    counts: tuple[tuple[int, ...], ...]


def needle_grid(records: Iterable[dict[str, Any]], max_depths: int = 12) -> NeedleGrid:
    """Bucket needle records by (depth, length) and take the accuracy of each bucket.

    Depths drawn at random (multi-key needles) would give one row per record: past `max_depths` distinct
    depths, depths in [0, 1] are rounded to tenths (11 rows).
    """
    points = [(float(r["depth"]), int(r["length"]), 1.0 if r.get("correct") is True else 0.0) for r in records
              if isinstance(r.get("depth"), (int, float)) and isinstance(r.get("length"), (int, float))]
    if len({d for d, _, _ in points}) > max_depths and all(0 <= d <= 1 for d, _, _ in points):
        points = [(round(d, 1), n, c) for d, n, c in points]
    cells: dict[tuple[float, int], list[float]] = {}
    for depth, length, correct in points:
        cells.setdefault((depth, length), []).append(correct)
    depths = tuple(sorted({d for d, _ in cells}))
    lengths = tuple(sorted({n for _, n in cells}))
    acc = tuple(tuple(_mean(cells.get((d, n), [])) for n in lengths) for d in depths)
    counts = tuple(tuple(len(cells.get((d, n), [])) for n in lengths) for d in depths)
    return NeedleGrid(depths, lengths, acc, counts)
