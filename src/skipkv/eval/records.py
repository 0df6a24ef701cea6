"""The run directory's records.jsonl: append-only, one JSON object per finished (id, sample), crash-safe.

    store = RecordStore(Path("runs/g/records.jsonl"))
    done = store.keys()            # {(id, sample), ...} already finished
    store.append({"id": "gsm8k-test-0000", "sample": 0, ...})   # written, flushed and fsynced before it returns

A process killed mid-write leaves at most one torn last line. Opening the store drops it (truncating the
file back to the last complete record), so the next append starts on a clean line and the interrupted
example simply runs again. A bad line anywhere else means the file was damaged by something else, and
is an error rather than a silent skip. A duplicate (id, sample) cannot arise through `append`, which
refuses keys it already holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from skipkv.errors import SkipKVError
from skipkv.files import count_lines, packed, parse_json, read_bytes, split_lines


def _key(record: dict[str, Any]) -> tuple[str, int]:
    return str(record["id"]), int(record.get("sample", 0))


class _Torn(Exception):
    """A line that is not JSON at all: at the end of the file, what a crash mid-write leaves."""


def _parse(line: bytes, path: Path, num: int, kind: str, schema: str | None = None) -> dict[str, Any]:
    """One line of records.jsonl or traces.jsonl; _Torn if it is not JSON, a FileError if it is JSON that does
    not fit the schema (that is damage wherever it is, never a torn write)."""
    from skipkv.files.schemas import validate

    try:
        value = parse_json(line, f"{path}:{num}", kind)
    except SkipKVError:
        raise _Torn() from None
    return validate(schema or kind, value, f"{path}:{num}")


class RecordStore:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._records: list[dict[str, Any]] = []
        self._keys: set[tuple[str, int]] = set()
        self.dropped_torn_line = False
        self._load()

    def _load(self) -> None:
        self._packed = not self.path.exists() and packed(self.path).exists()  # a finished run, `skipkv pack`ed
        if not self.path.exists() and not self._packed:
            return
        data = read_bytes(self.path, "records")
        if self._packed:  # written whole by `pack`: no torn tail to repair
            for num, _pos, line in split_lines(data):
                record = _parse(line, self.path, num, "records")
                self._keys.add(_key(record))
                self._records.append(record)
            return
        count_lines(data, self.path, "records")
        good_end = 0  # byte offset just past the last complete, valid line
        for num, pos, line in split_lines(data):
            try:
                record = _parse(line, self.path, num, "records")
            except _Torn:
                if data[pos + len(line):].strip():  # damage before the end: not a torn tail
                    raise SkipKVError(f"{self.path}:{num} is not a valid record; the file is damaged") from None
                break
            key = _key(record)
            if key not in self._keys:
                self._keys.add(key)
                self._records.append(record)
            good_end = pos + len(line) + 1
        good_end = min(good_end, len(data))
        if data[good_end:].strip():
            # Cut the torn tail so that the next append does not glue onto half a line.
            with open(self.path, "r+b") as f:
                f.truncate(good_end)
                f.flush()
                os.fsync(f.fileno())
            self.dropped_torn_line = True
        elif data and not data.endswith(b"\n"):
            # A complete record whose newline never made it: keep the record, finish its line.
            with open(self.path, "ab") as f:
                f.write(b"\n")
                f.flush()
                os.fsync(f.fileno())

    def records(self) -> list[dict[str, Any]]:
        return list(self._records)

    def keys(self) -> set[tuple[str, int]]:
        return set(self._keys)

    def __len__(self) -> int:
        return len(self._records)

    def append(self, record: dict[str, Any]) -> None:
        """Write one record as one line; returns once it is on disk."""
        key = _key(record)
        if key in self._keys:
            raise SkipKVError(f"record {key[0]!r} sample {key[1]} is already in {self.path}")
        if self._packed:
            self._unpack()
        line = json.dumps(record, ensure_ascii=False) + "\n"
        # One write call per line, opened in append mode: concurrent readers never see a partial record
        # except at a crash, which _load repairs.
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self._keys.add(key)
        self._records.append(record)


    def _unpack(self) -> None:
        """A packed run grows again (a larger --limit): its records go back to plain records.jsonl first."""
        data = read_bytes(self.path, "records")
        tmp = self.path.with_suffix(".unpack")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        packed(self.path).unlink()
        self._packed = False


class TraceFile:
    """The run directory's traces.jsonl (`skipkv eval --trace`): one line {id, sample, trace} per traced record.

    A trace line is written (flushed, fsynced) just before its record, so a crash in between leaves a trace
    whose record is missing; `prune(keys)` at the start of a run drops such lines (and a torn last line),
    so after a resume the file holds exactly one trace per traced record.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def prune(self, keys: set[tuple[str, int]]) -> None:
        """Keep only the last line of each (id, sample) in `keys`; rewrite the file only if something goes."""
        if not self.path.exists():
            return
        kept: dict[tuple[str, int], bytes] = {}
        dropped = False
        for num, _pos, line in split_lines(read_bytes(self.path, "traces")):
            try:
                key = _key(_parse(line, self.path, num, "traces", "records"))  # the key is all prune needs
            except (_Torn, SkipKVError):
                dropped = True
                continue
            dropped |= key not in keys or key in kept
            if key in keys:
                kept[key] = line
        if not dropped:
            return
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(line + b"\n" for line in kept.values()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def append(self, example_id: str, sample: int, trace: dict[str, Any]) -> None:
        line = json.dumps({"id": example_id, "sample": sample, "trace": trace}, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def read_traces(path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """{(id, sample): trace} from a traces.jsonl; a later line for the same key wins, a torn last line is skipped.
    Every line is checked by the "traces" schema (skipkv.files.schemas.TraceLine)."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    data = read_bytes(Path(path), "traces")
    count_lines(data, path, "traces")
    for num, pos, line in split_lines(data):
        try:
            row = _parse(line, Path(path), num, "traces")
        except _Torn:
            if data[pos + len(line):].strip():
                raise SkipKVError(f"{path}:{num} is not a valid trace line; the file is damaged") from None
            continue
        out[_key(row)] = row["trace"]
    return out
