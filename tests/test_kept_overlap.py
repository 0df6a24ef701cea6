"""The kept-position overlap table of benchmarks/kvpress_overlap/overlap.py (skipkv.bench.kept_overlap), on
hand-made kept sets; kvpress is not needed.

    python -m pytest tests/test_kept_overlap.py -q
"""

from __future__ import annotations

import pytest

from skipkv.bench.kept_overlap import jaccard, overlap_row, unit_overlaps


def test_jaccard_counts_intersection_over_union():
    assert jaccard([0, 1, 2, 3], [2, 3, 4, 5]) == pytest.approx(2 / 6)
    assert jaccard([1, 2], [2, 1]) == 1.0  # order does not matter
    assert jaccard([0, 1, 2], [0, 1]) == pytest.approx(2 / 3)  # one side keeping more is a difference
    assert jaccard([], []) == 1.0


def test_row_over_sequences_layers_and_heads():
    # two sequences, 2 layers x 2 kv heads each: 8 units
    a = [[[[0, 1, 2], [3, 4, 5]], [[0, 1, 2], [0, 4, 5]]],
         [[[7, 8], [1, 2]], [[9, 10], [1, 3]]]]
    b = [[[[0, 1, 2], [3, 4, 6]], [[0, 1, 2], [0, 4, 5]]],
         [[[7, 8], [1, 2]], [[10, 11], [1, 3]]]]
    assert unit_overlaps(a, b) == pytest.approx([1, 0.5, 1, 1, 1, 1, 1 / 3, 1])
    row = overlap_row(a, b)
    assert row["mean"] == pytest.approx((6 + 0.5 + 1 / 3) / 8)
    assert row["min"] == pytest.approx(1 / 3)
    assert (row["identical"], row["units"], row["kept_a"], row["kept_b"]) == (6, 8, 20, 20)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError):
        unit_overlaps([[[[0]]]], [])
    with pytest.raises(ValueError):
        unit_overlaps([[[[0], [1]]]], [[[[0]]]])
