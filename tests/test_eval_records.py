"""records.jsonl store: durable appends, a torn last line repaired on open, damage elsewhere refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skipkv.errors import SkipKVError
from skipkv.eval.records import RecordStore


def rec(i: int, sample: int = 0) -> dict:
    return {"id": f"ex-{i}", "sample": sample, "output": f"answer {i}\nwith a newline", "correct": i % 2 == 0}


def test_append_and_reload(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    store = RecordStore(path)
    for i in range(3):
        store.append(rec(i))
    store.append(rec(0, sample=1))
    again = RecordStore(path)
    assert again.records() == [rec(0), rec(1), rec(2), rec(0, 1)]
    assert again.keys() == {("ex-0", 0), ("ex-1", 0), ("ex-2", 0), ("ex-0", 1)}
    assert len(path.read_text().splitlines()) == 4  # newlines inside strings stay escaped: one line a record
    with pytest.raises(SkipKVError, match="already"):
        again.append(rec(1))


def test_torn_last_line_is_dropped_and_the_next_append_is_clean(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    store = RecordStore(path)
    store.append(rec(0))
    store.append(rec(1))
    whole = path.read_bytes()
    line = (json.dumps(rec(2)) + "\n").encode()
    path.write_bytes(whole + line[: len(line) // 2])  # killed in the middle of a write
    store = RecordStore(path)
    assert store.dropped_torn_line
    assert [r["id"] for r in store.records()] == ["ex-0", "ex-1"]
    assert path.read_bytes() == whole  # truncated back to the last whole record
    store.append(rec(2))
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["ex-0", "ex-1", "ex-2"]


def test_complete_record_missing_its_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(rec(0)) + "\n" + json.dumps(rec(1)))
    store = RecordStore(path)
    assert not store.dropped_torn_line and len(store) == 2
    store.append(rec(2))
    assert len(RecordStore(path)) == 3


def test_damage_before_the_end_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(rec(0)) + "\n{garbage\n" + json.dumps(rec(1)) + "\n")
    with pytest.raises(SkipKVError, match=":2 is not a valid record"):
        RecordStore(path)


def test_duplicates_on_disk_are_counted_once(tmp_path: Path) -> None:
    # Not produced by append, but a hand-merged file must not double-count an example.
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(rec(0)) + "\n" + json.dumps({**rec(0), "output": "later"}) + "\n")
    store = RecordStore(path)
    assert len(store) == 1 and store.records()[0]["output"] == rec(0)["output"]
