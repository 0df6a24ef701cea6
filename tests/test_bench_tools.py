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


# Outputs split at blank lines; steps after the first: e0 execution + reflection ("Wait"), e1 transition
# ("Alternatively") + execution, e2 execution only.
OUTPUTS = ["Start.\n\nAdd 2 and 2.\n\nWait, check it.", "Start.\n\nAlternatively, count.\n\nSo 4.", "Start.\n\nSo 4."]


def reflective_run(root: Path, name: str, packed: bool) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model": "m"}))
    rows = [{"id": f"e{i}", "sample": 0, "prompt": "q", "output": out, "correct": i == 0,
             "generated_tokens": 30 * (i + 1), "redundant_sentences": i} for i, out in enumerate(OUTPUTS)]
    (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"complete": True, "n": 3}))
    if packed:
        assert pack(d) is not None
    return d


@pytest.mark.parametrize("packed", [False, True])
def test_reflection_tables_count_seal_step_classes(tmp_path, capsys, packed):
    d = reflective_run(tmp_path, "chat-f0", packed)
    assert main(["bench", "reflection-rate", str(d)]) == 0
    assert f"| {d} | 3 | 5 | 3 | 1 | 1 | 2 |" in capsys.readouterr().out
    assert main(["bench", "testbed-calibration", str(d)]) == 0
    assert "| chat-f0 | 3 | 0.33 | 60 | 0.33 | 0.33 | 2/3 | 1.00 |" in capsys.readouterr().out
    assert main(["bench", "reflection-rate", str(tmp_path / "missing")]) == 2
    assert "is not a run folder" in capsys.readouterr().err


def test_paper_tables_from_summaries(tmp_path, capsys):
    for name, acc, gen in (("full-s0", 0.5, 300.0), ("rkv-b64-s0", 0.25, 250.0), ("rkv-b128-s0", 0.4, 280.0)):
        d = tmp_path / "gsm8k" / name
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"n": 4, "accuracy": acc, "mean_generated_tokens": gen,
                                                    "complete": name != "rkv-b128-s0"}))
    assert main(["bench", "paper-tables", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| budget 64 | budget 128 |" in out
    assert "| FullKV | 50.0 | 50.0 |" in out and "| R-KV | 25.0 | 40.0* |" in out  # * still running
    assert "| FullKV | 300 | 300 |" in out and "| R-KV | 250 | 280* |" in out
    assert main(["bench", "paper-tables", str(tmp_path / "missing")]) == 2


def test_shared_prefill_never_deletes_a_folder_it_did_not_make(tmp_path, capsys):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    assert main(["bench", "shared-prefill", "--model", "random:qwen2", "--out", str(foreign)]) == 2
    assert "is not an earlier output of this tool" in capsys.readouterr().err
    assert (foreign / "thesis.tex").read_text() == "years of work"
    a_file = tmp_path / "f.json"
    a_file.write_text("{}")
    assert main(["bench", "shared-prefill", "--model", "random:qwen2", "--out", str(a_file)]) == 2
    assert a_file.exists()


def test_profile_step_runs_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["bench", "profile-step", "--model", "random:qwen2", "--steps", "2", "--warmup", "2",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["steps"] == 2 and report["rows_ms"] and report["step_ms_plain_median"] > 0
