"""`skipkv bench grid` and `skipkv bench paired` (skipkv/report/grid.py, paired.py): the tables from run dirs whose
records are plain or packed (`skipkv pack`), against counts worked out by hand, and one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skipkv.cli import main
from skipkv.report.pack import pack

# Six examples; the reference (rkv) right on e0-e3, the other (snapkv) right on e0, e1, e4: discordant 2 / 1.
RIGHT = {"rkv": {"e0", "e1", "e2", "e3"}, "snapkv": {"e0", "e1", "e4"}}


def cell(root: Path, name: str, right: set[str], packed: bool, n: int = 6) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model": "m"}))
    rows = [{"id": f"e{i}", "sample": 0, "prompt": f"q{i}", "output": "x" if f"e{i}" in right else f"y{i}",
             "correct": f"e{i}" in right, "generated_tokens": 10 + i, "decode_peak_kv_tokens": 5} for i in range(n)]
    (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"complete": True, "n": n}))
    if packed:
        assert pack(d) is not None and (d / "records.jsonl.gz").exists()
    return d


@pytest.mark.parametrize("packed", [False, True])
def test_grid_counts_and_pairs_cells_packed_or_not(tmp_path, capsys, packed):
    for label, right in RIGHT.items():
        cell(tmp_path / "gsm8k", f"{label}-r0.1-s0", right, packed=packed and label == "snapkv")
    assert main(["bench", "grid", str(tmp_path), "--against", "rkv"]) == 0
    out = capsys.readouterr().out
    assert "**10% of the prompt**" in out
    assert "| rkv | 4/6 | 4/6 [" in out
    assert "| snapkv | 3/6 | 3/6 [" in out and "2 / 1, p = 1.00" in out


@pytest.mark.parametrize("packed", [False, True])
def test_paired_compares_two_runs_packed_or_not(tmp_path, capsys, packed):
    a = cell(tmp_path, "rkv-b64-s0", RIGHT["rkv"], packed=False)
    b = cell(tmp_path, "snapkv-b64-s0", RIGHT["snapkv"], packed=packed)
    assert main(["bench", "paired", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "rkv-b64-s0               n=   6  accuracy  66.7%" in out
    assert "snapkv-b64-s0            n=   6  accuracy  50.0%" in out
    # identical outputs: e0 and e1 (both right) and e5 (both wrong)
    assert ("only rkv-b64-s0 right 2, only snapkv-b64-s0 right 1; exact McNemar p = 1.000; identical outputs 3/6"
            in out)


def test_bench_tools_refuse_in_one_line(tmp_path, capsys):
    assert main(["bench", "grid", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip().endswith("is not a folder")
    (tmp_path / "empty").mkdir()
    assert main(["bench", "grid", str(tmp_path / "empty")]) == 2
    assert "holds no finished cells" in capsys.readouterr().err
    a = cell(tmp_path, "a", {"e0"}, packed=False)
    assert main(["bench", "paired", str(a), str(tmp_path / "empty")]) == 2
    assert "holds no records" in capsys.readouterr().err.strip()
    b = cell(tmp_path / "other", "b", {"e0"}, packed=False, n=0)
    assert main(["bench", "paired", str(a), str(b)]) == 2
