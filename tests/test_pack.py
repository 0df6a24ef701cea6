"""`skipkv pack`: finished run dirs' records slimmed (prompt -> sha256) and gzipped, and every reader of records
reads the packed file as it read the plain one: report's runs, eval's record store (resume, and growing again),
and the registered analyses (the same output)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from skipkv.cli import main
from skipkv.errors import SkipKVError
from skipkv.eval.records import RecordStore
from skipkv.report.pack import pack
from skipkv.report.runs import read_records

REC = {"id": "a", "sample": 0, "prompt": "Question: 2+2?\u2028 Answer:", "output": "4", "correct": True}


def run_dir(tmp: Path, n: int = 3, complete: bool = True) -> Path:
    d = tmp / "run"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model": "m"}))
    lines = [json.dumps({**REC, "id": f"e{i}", "prompt": REC["prompt"] + str(i)}, ensure_ascii=False) for i in range(n)]
    (d / "records.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    if complete:
        (d / "summary.json").write_text(json.dumps({"complete": True, "n": n}))
    return d


def test_pack_hashes_prompts_and_readers_see_the_same_records(tmp_path):
    d = run_dir(tmp_path)
    plain, _ = read_records(d / "records.jsonl")
    got = pack(d)
    assert got is not None and got.prompts == 3 and got.after < got.before
    assert not (d / "records.jsonl").exists() and (d / "records.jsonl.gz").exists()
    packed, notes = read_records(d / "records.jsonl")
    assert notes == [] and len(packed) == 3
    for a, b in zip(plain, packed):
        assert list(b) == [("prompt_sha256" if k == "prompt" else k) for k in a]  # same keys, same order
        assert b["prompt_sha256"] == hashlib.sha256(a["prompt"].encode()).hexdigest()
        assert {k: v for k, v in a.items() if k != "prompt"} == {k: v for k, v in b.items() if k != "prompt_sha256"}
    blob = (d / "records.jsonl.gz").read_bytes()
    assert pack(d) is None and (d / "records.jsonl.gz").read_bytes() == blob  # packed once; same bytes


def test_a_packed_run_resumes_and_grows(tmp_path):
    d = run_dir(tmp_path)
    pack(d)
    store = RecordStore(d / "records.jsonl")
    assert store.keys() == {("e0", 0), ("e1", 0), ("e2", 0)}  # nothing reruns
    store.append({**REC, "id": "e3"})  # a larger --limit: back to plain records, then appended
    assert (d / "records.jsonl").exists() and not (d / "records.jsonl.gz").exists()
    assert [r["id"] for r in RecordStore(d / "records.jsonl").records()] == ["e0", "e1", "e2", "e3"]


def test_only_finished_runs_are_packed(tmp_path, capsys):
    d = run_dir(tmp_path, complete=False)
    with pytest.raises(SkipKVError, match="not finished"):
        pack(d)
    assert main(["pack", str(tmp_path)]) == 0 and "skipped, not finished" in capsys.readouterr().out
    assert (d / "records.jsonl").exists()


def test_the_registered_analysis_reads_packed_records_alike(tmp_path):
    from skipkv.report import prereg_skipkv

    root = tmp_path / "grid"
    for block, cell in [("gsm8k-b1", "full-s0"), ("gsm8k-b1", "rkv-b64-s0")]:
        d = root / block / cell
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / "summary.json").write_text(json.dumps({"complete": True}))
        (d / "records.jsonl").write_text("".join(json.dumps({**REC, "id": f"x{i}", "correct": i % 2 == 0,
                                                             "generated_tokens": 10 + i}) + "\n" for i in range(4)))
    before = prereg_skipkv.load(root)
    assert main(["pack", str(root)]) == 0
    after = prereg_skipkv.load(root)
    def strip(g):
        return {s: {c: {k: {f: v for f, v in r.items() if not f.startswith("prompt")} for k, r in cell.items()}
                    for c, cell in cells.items()} for s, cells in g.items()}

    assert strip(before) == strip(after) and sum(len(c) for s in after.values() for c in s.values()) == 8
