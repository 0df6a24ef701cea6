"""Overlap of the positions two implementations keep, per (layer, kv head): the table of
benchmarks/kvpress_overlap/overlap.py (skipkv against kvpress on the same model and token ids).

    from skipkv.bench.kept_overlap import overlap_row
    overlap_row([kept_a_seq0, ...], [kept_b_seq0, ...])   # each kept_*: [L][H] lists of positions

A unit is one (sequence, layer, kv head). Its overlap is the Jaccard index |A & B| / |A | B| of the two kept
sets (1 when both keep exactly the same positions; it also counts a head that keeps more on one side, which a
share of a fixed budget would not).
"""

from __future__ import annotations

from collections.abc import Sequence

Kept = Sequence[Sequence[Sequence[int]]]  # [L][H] kept positions of one sequence


def jaccard(a: Sequence[int], b: Sequence[int]) -> float:
    """|A & B| / |A | B| of two position sets; 1.0 when both are empty."""
    sa, sb = set(a), set(b)
    union = len(sa | sb)
    return len(sa & sb) / union if union else 1.0


def unit_overlaps(a: Sequence[Kept], b: Sequence[Kept]) -> list[float]:
    """Jaccard per (sequence, layer, kv head), sequence-major, for the same sequences kept by two sides."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} sequences on one side, {len(b)} on the other")
    out = []
    for sa, sb in zip(a, b):
        if len(sa) != len(sb) or any(len(ha) != len(hb) for ha, hb in zip(sa, sb)):
            raise ValueError("the two sides have different layer or kv head counts")
        out += [jaccard(ha, hb) for la, lb in zip(sa, sb) for ha, hb in zip(la, lb)]
    return out


def overlap_row(a: Sequence[Kept], b: Sequence[Kept]) -> dict:
    """One table row: mean and min Jaccard over the units, how many are identical, how many units, and the kept
    counts of both sides (summed over units)."""
    per_unit = unit_overlaps(a, b)
    count = sum(len(h) for seq in a for layer in seq for h in layer)
    count_b = sum(len(h) for seq in b for layer in seq for h in layer)
    return {"mean": sum(per_unit) / len(per_unit), "min": min(per_unit),
            "identical": sum(1 for x in per_unit if x == 1.0), "units": len(per_unit),
            "kept_a": count, "kept_b": count_b}
