"""benchmarks/prereg.py and benchmarks/prereg_skipkv.py, the analyses fixed with the grids of issues 19 and 18.

Their numbers are what docs/results.md reports, so they are recounted here by hand on synthetic run trees: each
cell's correct / n, which examples enter (paired, finished, in the family's blocks), the discordant pairs, the
exact McNemar p, Holm over the whole family, and (issue 18) the paired length differences.
"""

from __future__ import annotations

import importlib
import json
import random
from pathlib import Path

import pytest

from skipkv.report.stats import bootstrap, holm, mcnemar_exact

ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str):
    """The analysis module behind benchmarks/<name>.py (the analyses live in skipkv.report)."""
    return importlib.import_module({"prereg": "skipkv.report.prereg_laprox",
                                    "prereg_skipkv": "skipkv.report.prereg_skipkv"}[name])


@pytest.fixture(scope="module")
def prereg():
    return load_script("prereg")


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


def test_exclude_drops_an_example_from_every_cell(prereg, tmp_path):
    make(tmp_path)
    grid = prereg.load(tmp_path)
    assert prereg.exclude(grid, ["niah8k-b1:ex3", "multikey8k-b1:ex0"]) == [("niah8k-b1", "ex3"),
                                                                            ("multikey8k-b1", "ex0")]
    full = prereg.family_rows(prereg.load(tmp_path), ("niah8k", "multikey8k"), ["0.05"])[1]
    assert prereg.family_rows(grid, ("niah8k", "multikey8k"), ["0.05"])[1] == {"0.05": full["0.05"] - 2}
    assert all(("niah8k-b1", "ex3") not in recs for pol in grid["niah8k"].values() for recs in pol.values())
    for bad in ("niah8k-b1:ex99", "niah8k-b1", "vt4k:ex0"):
        with pytest.raises(SystemExit, match="no cell holds"):
            prereg.exclude(prereg.load(tmp_path), [bad])


def test_partial_scores_are_described_as_paired_differences(prereg, tmp_path):
    """Common words and variable tracking grade a share of words found: each row's mean score, and its mean
    paired difference from the row tested against (same examples), recounted by hand."""
    rng = random.Random(3)
    scores = {cell: {f"ex{i}": rng.choice([0.0, 0.2, 0.4, 0.6, 1.0]) for i in range(9)} for cell in CELLS}
    scores["rkv-r0.05-s0"].pop("ex4")  # unfinished: ex4 leaves every row
    for cell, by_id in scores.items():
        d = tmp_path / "cw4k" / cell
        d.mkdir(parents=True)
        d.joinpath("records.jsonl").write_text("".join(
            json.dumps({"id": i, "correct": v == 1.0, "score": v}) + "\n" for i, v in by_id.items()))
    rows, sizes = prereg.family_rows(prereg.load(tmp_path), ("cw4k",), ["0.05"])
    ids = [f"ex{i}" for i in range(9) if i != 4]
    assert sizes == {"0.05": 8}
    ref = scores["laprox-r0.05-s0"]
    for r in rows:
        mine = scores["full-s0" if r["policy"] == "full" else f"{r['policy']}-r0.05-s0"]
        assert r["score"] == pytest.approx(sum(mine[i] for i in ids) / 8)
        if r["policy"] in ("full", "laprox"):
            assert r["score_diff"] is None
        else:
            assert r["score_diff"] == pytest.approx(sum(mine[i] - ref[i] for i in ids) / 8)
            # The mean alone cannot tell paired from unpaired; the interval is over per-example differences.
            assert r["score_diff_ci"] == bootstrap([mine[i] - ref[i] for i in ids])
            assert r["score_diff_ci"][0] <= r["score_diff"] <= r["score_diff_ci"][1]
    table = prereg.markdown("cw4k", rows, sizes, "note", score=True)
    rkv = next(r for r in rows if r["policy"] == "rkv")
    assert f"| {rkv['score_diff']:+.2f} [" in table


def test_amendment_family_is_against_laprox_head(prereg, tmp_path):
    make(tmp_path)
    grid = prereg.load(tmp_path)
    rows, _ = prereg.family_rows(grid, ("niah8k",), ["0.05"], prereg.AMENDMENT["against"],
                                 prereg.AMENDMENT["labels"])
    tested = {r["policy"] for r in rows if r["p"] is not None}
    assert tested == {"laprox", "rkv", "snapkv"}  # adakv has no cell here; full and laprox-head are not tested


# benchmarks/prereg_skipkv.py, the analysis fixed with issue 18's grid (per dataset; blocks of 50 in the real grid).

SKIPKV_CELLS = ["full-s0", "seal-s0"] + [f"{p}-b{b}-s0" for p in ("rkv", "skipkv", "skipkv-steer")
                                           for b in (64, 128)]


@pytest.fixture(scope="module")
def prereg_skipkv():
    return load_script("prereg_skipkv")


def make_skipkv(root: Path, seed: int = 1) -> dict:
    """gsm8k blocks 1-3, 8 examples each; skipkv at 64 has not finished block 2's last example."""
    rng = random.Random(seed)
    recs = {}
    for block in (1, 2, 3):
        for cell in SKIPKV_CELLS:
            for i in range(8):
                if (block, cell, i) == (2, "skipkv-b64-s0", 7):
                    continue
                recs.setdefault((block, cell), {})[f"q{i}"] = {"id": f"q{i}", "correct": rng.random() < 0.5,
                                                               "generated_tokens": rng.randint(100, 700)}
    for (block, cell), by_id in recs.items():
        d = root / f"gsm8k-b{block}" / cell
        d.mkdir(parents=True)
        (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in by_id.values()))
    return recs


def test_skipkv_families_pair_within_their_blocks_and_holm_over_each(prereg_skipkv, tmp_path):
    recs = make_skipkv(tmp_path)
    cells = prereg_skipkv.load(tmp_path)["gsm8k"]

    def cell(label: str, budget: str | None) -> dict:
        name = f"{label}-s0" if label in ("full", "seal") else f"{label}-b{budget}-s0"
        return {(b, i): r for (b, c), by_id in recs.items() if c == name for i, r in by_id.items()}

    for family, tests, blocks in (("primary", prereg_skipkv.PRIMARY, {1, 2, 3, 4}),
                                  ("secondary", prereg_skipkv.SECONDARY, {1, 2})):
        rows = prereg_skipkv.compare(cells, tests, blocks)
        assert len(rows) == len(tests) == {"primary": 6, "secondary": 19}[family]
        for row in rows:
            a, b = cell(row["a"], row["budget"]), cell(row["b"], row["budget"])
            common = [k for k in set(a) & set(b) if k[0] in blocks]
            assert row["n"] == len(common)  # 0 where a cell is absent here (snapkv, h2o, budget 192)
            only_a = sum(a[k]["correct"] and not b[k]["correct"] for k in common)
            only_b = sum(b[k]["correct"] and not a[k]["correct"] for k in common)
            assert (row["only_a"], row["only_b"]) == (only_a, only_b)
            assert row["p"] == pytest.approx(mcnemar_exact(only_a, only_b))
        assert [r["p_holm"] for r in rows] == pytest.approx(holm([r["p"] for r in rows]))
        if family == "primary":  # skipkv at 64 misses one example of block 2; block 3 counts
            assert rows[0]["n"] == 23 and rows[3]["n"] == 24
        else:  # blocks 1-2 only; seal vs full pairs seal's one cell with the full cache's
            assert rows[0]["n"] == 15 and rows[-1]["n"] == 16 and rows[-1]["a"] == "seal"


def test_skipkv_lengths_are_paired_differences(prereg_skipkv, tmp_path):
    recs = make_skipkv(tmp_path)
    out = prereg_skipkv.lengths(prereg_skipkv.load(tmp_path)["gsm8k"])
    steer64 = next(r for r in out if r["a"] == "skipkv-steer" and r["budget"] == "64")
    diffs = [recs[(b, "skipkv-steer-b64-s0")][i]["generated_tokens"] - recs[(b, "skipkv-b64-s0")][i]["generated_tokens"]
             for (b, c), by_id in recs.items() if c == "skipkv-b64-s0" for i in by_id]
    assert steer64["n"] == len(diffs) == 23
    assert steer64["mean_diff"] == pytest.approx(sum(diffs) / len(diffs))
    assert steer64["lo"] <= steer64["mean_diff"] <= steer64["hi"]
    # not registered: each SkipKV variant against R-KV at its budget and against SEAL (one cell for all budgets)
    extra = prereg_skipkv.lengths(prereg_skipkv.load(tmp_path)["gsm8k"], prereg_skipkv.BASELINE_LENGTHS)
    assert len(extra) == 12
    for a, b in (("skipkv", "rkv-b64-s0"), ("skipkv", "seal-s0")):
        row = next(r for r in extra if r["a"] == a and r["b"] == b.split("-")[0] and r["budget"] == "64")
        d = [recs[(blk, "skipkv-b64-s0")][i]["generated_tokens"] - recs[(blk, b)][i]["generated_tokens"]
             for (blk, c), by_id in recs.items() if c == "skipkv-b64-s0" for i in by_id]
        assert row["n"] == len(d) == 23 and row["mean_diff"] == pytest.approx(sum(d) / len(d))


def test_skipkv_plot_uses_blocks_1_2_and_writes_one_png_per_dataset(prereg_skipkv, tmp_path):
    recs = make_skipkv(tmp_path / "grid")
    cells = prereg_skipkv.load(tmp_path / "grid")["gsm8k"]
    rows = prereg_skipkv.describe(cells, {1, 2})
    rkv64 = next(r for r in rows if r["label"] == "rkv" and r["budget"] == "64")
    in_12 = [r for (b, c), by_id in recs.items() if c == "rkv-b64-s0" and b in (1, 2) for r in by_id.values()]
    assert rkv64["n"] == len(in_12) == 16 and rkv64["correct"] == sum(r["correct"] for r in in_12)
    assert prereg_skipkv.main([str(tmp_path / "grid"), "--plot", str(tmp_path / "plots")]) == 0
    png = tmp_path / "plots" / "skipkv_prereg_gsm8k.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_skipkv_dataset_option_keeps_one_dataset_and_refuses_an_unknown_one(prereg_skipkv, tmp_path, capsys):
    make_skipkv(tmp_path / "grid")
    math = tmp_path / "grid" / "math500-b1" / "full-s0"
    math.mkdir(parents=True)
    (math / "records.jsonl").write_text(json.dumps({"id": "m0", "correct": True, "generated_tokens": 9}) + "\n")
    both, one = tmp_path / "both.json", tmp_path / "one.json"
    assert prereg_skipkv.main([str(tmp_path / "grid"), "--json", str(both)]) == 0
    assert "### math500" in capsys.readouterr().out
    assert prereg_skipkv.main([str(tmp_path / "grid"), "--dataset", "gsm8k", "--json", str(one)]) == 0
    printed = capsys.readouterr().out
    assert "### gsm8k" in printed and "### math500" not in printed
    assert set(json.loads(both.read_text())) == {"gsm8k", "math500"}
    assert json.loads(one.read_text()) == {"gsm8k": json.loads(both.read_text())["gsm8k"]}
    assert "baseline_lengths" not in json.loads(both.read_text())["gsm8k"]  # the registered output, unchanged
    assert prereg_skipkv.main([str(tmp_path / "grid"), "--baseline-lengths", "--json", str(one)]) == 0
    assert len(json.loads(one.read_text())["gsm8k"]["baseline_lengths"]) == 12
    assert "not in the registered analysis" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        prereg_skipkv.main([str(tmp_path / "grid"), "--dataset", "aime"])
    assert e.value.code == 2 and "no dataset aime" in capsys.readouterr().err


def test_plot_draws_accuracy_or_the_mean_score_and_refuses_families_without_one(tmp_path):
    """benchmarks/plot_prereg.py on an analysis written by prereg.py: one PNG per family; `--score` only for
    families whose rows carry a score interval, with a clear error otherwise."""
    import subprocess
    import sys

    def row(policy, ratio, score=True):
        r = {"policy": policy, "ratio": ratio, "k": 3, "n": 10, "lo": 0.1, "hi": 0.6, "p": None}
        if score:
            r.update(score=0.4, score_ci=[0.3, 0.5])
        return r

    report = {"cw4k": {"against": "laprox", "rows": [row(p, r) for r in ("0.05", "0.1") for p in ("full", "laprox")]},
              "niah8k": {"against": "laprox", "rows": [row("laprox", "0.05", score=False)]}}
    analysis = tmp_path / "analysis.json"
    analysis.write_text(json.dumps(report))
    plot = [sys.executable, str(ROOT / "benchmarks" / "plot_prereg.py"), str(analysis), "--out", str(tmp_path)]
    done = subprocess.run(plot + ["--score"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "cw4k_score.png").stat().st_size > 0 and not (tmp_path / "niah8k_score.png").exists()
    done = subprocess.run(plot + ["--score", "--family", "niah"], capture_output=True, text=True)
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [
        "plot_prereg: no family matching --family 'niah' carries scores"]
    assert subprocess.run(plot + ["--family", "niah"], capture_output=True).returncode == 0
    assert (tmp_path / "niah8k.png").exists()
