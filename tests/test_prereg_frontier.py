"""The frontier grids' registered analyses (skipkv.report.prereg_frontier) against hand counts."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from skipkv.report.prereg_frontier import analyse, partial_credit
from skipkv.report.stats import mcnemar_exact


@pytest.mark.parametrize("output,reference,expected", [
    (" 6493455.", "6493455", 1.0),
    (" 693459.", "6493455", 5 / 7),  # one digit dropped, one changed: LCS 693-45 of 6493455
    ("the number is 12 and 6493455", "6493455", 1.0),  # the best run counts
    ("0123456789" * 3, "6493455", 6 / 30),  # a long run of other digits earns little (LCS 6-9-3-4-5-5)
    ("no digits", "6493455", 0.0),
    ("keys 111 and 222", ["111", "222"], 1.0),
    ("keys 111 and 22", ["111", "222"], (1 + 2 / 3) / 2),
    ("Apple pie", "apple", 1.0),
])
def test_partial_credit_by_hand(output, reference, expected):
    assert partial_credit(output, reference) == pytest.approx(expected)


def _cell(root: Path, block: str, cell: str, rows: list[tuple[str, bool, str, int]], packed: bool = False) -> None:
    d = root / block / cell
    d.mkdir(parents=True)
    text = "".join(json.dumps({"id": i, "correct": ok, "output": out, "reference": "1234", "generated_tokens": n})
                   + "\n" for i, ok, out, n in rows)
    if packed:
        (d / "records.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    else:
        (d / "records.jsonl").write_text(text)


def test_longctx_primary_family_counts_pairs_and_holm(tmp_path):
    # laprox right on a, b, c; criticalkv-ada right on c, d; layer-defensivekv on a only; x is not in every cell
    lap = [("a", True, "1234", 5), ("b", True, "1234", 5), ("c", True, "1234", 5), ("d", False, "124", 5)]
    cka = [("a", False, "1", 5), ("b", False, "9", 5), ("c", True, "1234", 5), ("d", True, "1234", 5),
           ("x", True, "1234", 5)]
    ldk = [("a", True, "1234", 5), ("b", False, "12", 5), ("c", False, "", 5), ("d", False, "", 5)]
    for s in ("niah8k", "multikey8k"):
        _cell(tmp_path, f"{s}-b1", "laprox-r0.05-s0", lap, packed=True)
        _cell(tmp_path, f"{s}-b1", "criticalkv-ada-r0.05-s0", cka)
        _cell(tmp_path, f"{s}-b1", "layer-defensivekv-r0.05-s0", ldk)
    out = analyse("longctx", tmp_path)
    rows = {(r["set"], r["b"], r["level"]): r for r in out["primary"]}
    assert len(out["primary"]) == 8  # 2 sets x 2 shares x 2 pairs, the 0.1 cells still empty (n = 0)
    r = rows[("niah8k", "criticalkv-ada", "0.05")]
    assert (r["n"], r["only_a"], r["only_b"]) == (4, 2, 1)  # x is not in laprox's cell: left out
    assert r["p"] == pytest.approx(mcnemar_exact(2, 1))
    assert r["partial_diff"] == pytest.approx(((1 - 0.25) + (1 - 0) + 0 + (0.75 - 1)) / 4)
    r = rows[("niah8k", "layer-defensivekv", "0.05")]
    assert (r["only_a"], r["only_b"]) == (2, 0)
    assert all(row["p_holm"] >= row["p"] for row in out["primary"])
    cells = {c["label"]: c for c in out["sets"]["multikey8k"]["cells"]}
    assert cells["laprox"]["correct"] == 3 and cells["laprox"]["partial"] == pytest.approx((3 + 0.75) / 4)


def test_reasoning_primary_pairs_and_lengths(tmp_path):
    _cell(tmp_path, "gsm8k-b1", "triattention-b64-s0", [("a", True, "", 100), ("b", False, "", 300)])
    _cell(tmp_path, "gsm8k-b2", "triattention-b64-s0", [("a", True, "", 50)])
    _cell(tmp_path, "gsm8k-b1", "rkv-b64-s0", [("a", False, "", 200), ("b", False, "", 200)])
    _cell(tmp_path, "gsm8k-b2", "rkv-b64-s0", [("a", False, "", 150)])
    _cell(tmp_path, "gsm8k-b1", "full-s0", [("a", True, "", 10), ("b", True, "", 20)])
    out = analyse("reasoning", tmp_path)
    r = next(r for r in out["primary"] if r["a"] == "triattention" and r["b"] == "rkv" and r["level"] == "64")
    assert (r["n"], r["only_a"], r["only_b"]) == (3, 2, 0)  # blocks are kept apart: (1, a), (1, b), (2, a)
    assert r["tokens_diff"] == pytest.approx((-100 + 100 - 100) / 3)
    assert len(out["primary"]) == 6
    assert {c["label"] for c in out["cells"]} == {"triattention", "rkv", "full"}
