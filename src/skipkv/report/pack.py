"""Slim and compress finished run directories: each record's prompt text becomes its sha256, and records.jsonl
becomes records.jsonl.gz. Everything that reads records (report, show, sweep --status, eval's resume, the
registered analyses) reads the packed file as it read the plain one (`skipkv.files.read_bytes`).

    skipkv pack docs/results/runs/skipkv_prereg_b64          # every finished run dir at or below it
    skipkv pack RUN_DIR --dry-run                             # what it would do, and the bytes before and after

Why: a run dir's records repeat the rendered prompt of every example in every cell (a few-shot prompt of ~4 KB
per line), which nothing reads back; the prompt is a function of the dataset, the example and the prompt style,
all in config.json, and its hash still tells two prompts apart. Only finished runs are packed (summary.json says
`complete`), so no eval is appending meanwhile; a packed run that is extended later (a larger --limit) is unpacked
by eval's record store before its first new record. The gzip stream carries no name or time, so packing the same
records twice gives the same bytes.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from skipkv.errors import SkipKVError
from skipkv.files import packed, read_bytes, read_json, split_lines

RECORDS_FILE, SUMMARY_FILE = "records.jsonl", "summary.json"


@dataclass
class Packed:
    run_dir: Path
    before: int  # bytes of records.jsonl
    after: int  # bytes of records.jsonl.gz
    prompts: int  # records whose prompt became a hash


def slim_line(line: bytes) -> tuple[bytes, bool]:
    """One record line with its "prompt" replaced, in place, by "prompt_sha256" (the hex sha256 of its UTF-8)."""
    record = json.loads(line)
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        return line, False
    slim = {("prompt_sha256" if k == "prompt" else k): (hashlib.sha256(v.encode()).hexdigest() if k == "prompt"
                                                         else v) for k, v in record.items()}
    return json.dumps(slim, ensure_ascii=False).encode(), True


def finished(run_dir: Path) -> bool:
    summary = run_dir / SUMMARY_FILE
    return summary.is_file() and read_json(summary, "summary").get("complete") is True


def pack(run_dir: Path, dry_run: bool = False) -> Packed | None:
    """Pack one finished run dir; None if it is already packed. SkipKVError if it is not finished."""
    records = run_dir / RECORDS_FILE
    if not records.exists():
        if packed(records).exists():
            return None
        raise SkipKVError(f"pack: {run_dir} has no {RECORDS_FILE}")
    if not finished(run_dir):
        raise SkipKVError(f"pack: {run_dir} is not finished (summary.json does not say complete); "
                          "pack it when its eval has ended")
    data = read_bytes(records, "records")
    lines, slimmed = [], 0
    for _num, _pos, line in split_lines(data):
        if line.strip():
            out, changed = slim_line(line)
            lines.append(out)
            slimmed += changed
    body = b"".join(line + b"\n" for line in lines)
    blob = gzip.compress(body, compresslevel=9, mtime=0)
    if not dry_run:
        tmp = packed(records).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, packed(records))
        records.unlink()
    return Packed(run_dir, len(data), len(blob), slimmed)


def run_dirs(root: Path) -> list[Path]:
    """Run dirs (config.json beside records.jsonl or records.jsonl.gz) at or below `root`."""
    found = {p.parent for name in (RECORDS_FILE, RECORDS_FILE + ".gz") for p in root.rglob(name)}
    return sorted(d for d in found if (d / "config.json").is_file())
