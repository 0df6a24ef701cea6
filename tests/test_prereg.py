"""benchmarks/prereg.py, the analysis fixed with issue 19's grid: pairing, which examples enter, the family's Holm.

Its numbers are what docs/results.md reports, so they are recounted here by hand on a synthetic run tree: each
cell's correct / n, the discordant pairs against `laprox`, the exact McNemar p and Holm over the whole family.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from skipkv.report.stats import holm, mcnemar_exact

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def prereg():
    spec = importlib.util.spec_from_file_location("prereg", ROOT / "benchmarks" / "prereg.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CELLS = ["full-s0", "laprox-r0.05-s0", "rkv-r0.05-s0", "snapkv-r0.05-s0", "laprox-head-r0.05-s0"]


def write_tree(root: Path, verdicts: dict) -> None:
    """verdicts {(block, cell): {example id: correct}} -> root/<block>/<cell>/records.jsonl."""
    for (block, cell), by_id in verdicts.items():
        d = root / block / cell
        d.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"id": i, "correct": ok, "score": float(ok)}) for i, ok in by_id.items()]
        (d / "records.jsonl").write_text("\n".join(lines) + ("\n" if lines else ""))


def make(root: Path, seed: int = 0) -> dict:
    rng = random.Random(seed)
    verdicts = {}
    for block in ("niah8k-b1", "multikey8k-b1"):
        for cell in CELLS:
            verdicts[(block, cell)] = {f"ex{i}": rng.random() < 0.5 for i in range(12)}
    # Unfinished: rkv has not done ex11 of the multikey block, so that example leaves every row of the budget.
    del verdicts[("multikey8k-b1", "rkv-r0.05-s0")]["ex11"]
    write_tree(root, verdicts)
    return verdicts


def test_pooled_family_pairs_examples_and_holm_runs_over_the_family(prereg, tmp_path):
    verdicts = make(tmp_path)
    grid = prereg.load(tmp_path)
    rows, sizes = prereg.family_rows(grid, ("niah8k", "multikey8k"), ["0.05"])
    ids = [(b, f"ex{i}") for b in ("niah8k-b1", "multikey8k-b1") for i in range(12)
           if (b, f"ex{i}") != ("multikey8k-b1", "ex11")]
    assert sizes == {"0.05": len(ids)} == {"0.05": 23}
    # The amendment's cell never enters a registered family.
    assert {r["policy"] for r in rows} == {"full", "laprox", "rkv", "snapkv"}

    def verdict(policy: str, key: tuple[str, str]) -> bool:
        cell = "full-s0" if policy == "full" else f"{policy}-r0.05-s0"
        return verdicts[(key[0], cell)][key[1]]

    ps = []
    for r in rows:
        assert r["n"] == len(ids) and r["k"] == sum(verdict(r["policy"], k) for k in ids)
        if r["policy"] in ("full", "laprox"):
            assert r["p"] is None and "p_holm" not in r
            continue
        only_ref = sum(verdict("laprox", k) and not verdict(r["policy"], k) for k in ids)
        only_me = sum(verdict(r["policy"], k) and not verdict("laprox", k) for k in ids)
        assert (r["only_ref"], r["only_me"]) == (only_ref, only_me)
        assert r["p"] == pytest.approx(mcnemar_exact(only_ref, only_me))
        ps.append((r["p"], r["p_holm"]))
    assert len(ps) == 2
    assert [adj for _, adj in ps] == pytest.approx(holm([p for p, _ in ps]))


def test_a_cell_without_records_keeps_every_example_out(prereg, tmp_path):
    make(tmp_path)
    (tmp_path / "niah8k-b1" / "h2o-r0.05-s0").mkdir()  # a cell the sweep created but has not finished anything in
    rows, sizes = prereg.family_rows(prereg.load(tmp_path), ("niah8k",), ["0.05"])
    assert sizes == {"0.05": 0} and rows == []


def test_amendment_family_is_against_laprox_head(prereg, tmp_path):
    make(tmp_path)
    grid = prereg.load(tmp_path)
    rows, _ = prereg.family_rows(grid, ("niah8k",), ["0.05"], prereg.AMENDMENT["against"],
                                 prereg.AMENDMENT["labels"])
    tested = {r["policy"] for r in rows if r["p"] is not None}
    assert tested == {"laprox", "rkv", "snapkv"}  # adakv has no cell here; full and laprox-head are not tested
