"""Where a sweep stands, read from its cells' run dirs without touching them: `skipkv sweep CONFIG --status`.

    from skipkv.sweep import load_sweep
    from skipkv.sweep.status import cell_status, lock_holders
    raw, cells = load_sweep("benchmarks/results_skipkv_prereg.yaml")
    [cell_status(c, limit=50, samples=1, holders=lock_holders()) for c in cells]

Per cell: the (example, sample) records finished, out of `limit` × `samples` when the cell has a limit; whether
summary.json calls the run complete; and whether a process holds the run dir's lock now (it is writing there).
Nothing here takes the lock or repairs a torn last line (the eval runner does both when it resumes), so a status
read beside running sweeps cannot make one of them skip a cell or cut a record being written. No accuracy is
shown: a sweep runs blind (sweep/run.py).

Which process holds a lock comes from /proc/locks (Linux: flock locks by device and inode); where that file
cannot be read, no cell shows as being written and a partial one shows as partial.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from skipkv.errors import SkipKVError
from skipkv.eval.rundir import LOCK_FILE, RECORDS_FILE, SUMMARY_FILE
from skipkv.report.runs import read_records
from skipkv.sweep.spec import Cell

PROC_LOCKS = Path("/proc/locks")


@dataclass(frozen=True)
class CellStatus:
    name: str
    out_dir: str
    done: int  # distinct (id, sample) records on disk
    target: int | None  # limit x samples, None without a limit (complete then comes from summary.json alone)
    complete: bool
    writer: int | None  # pid of the process holding the run dir's lock now, if any
    damaged: str | None = None  # records.jsonl has a bad line before its end (the runner refuses to resume it)

    @property
    def state(self) -> str:
        if self.damaged is not None:
            return f"damaged: {self.damaged}"
        if self.complete:
            return "complete"
        if self.writer is not None:
            return f"running (pid {self.writer})"
        return "partial" if self.done else "not started"


def lock_holders(path: Path = PROC_LOCKS) -> dict[tuple[int, int, int], int]:
    """{(major, minor, inode): pid} of every FLOCK lock in /proc/locks; {} where it cannot be read.

    A line reads `1: FLOCK  ADVISORY  WRITE 12988 fe:00:5351085 0 EOF` (major and minor in hex, the inode in
    decimal); a waiting request (`->`) holds nothing and is left out.
    """
    try:
        text = path.read_text()
    except OSError:
        return {}
    holders: dict[tuple[int, int, int], int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            holders[(int(major, 16), int(minor, 16), int(inode))] = int(fields[4])
        except ValueError:
            continue
    return holders


def _writer(out: Path, holders: Mapping[tuple[int, int, int], int]) -> int | None:
    try:
        st = os.stat(out / LOCK_FILE)
    except OSError:
        return None
    return holders.get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))


def _summary_complete(out: Path) -> tuple[bool, int | None]:
    """(summary.json's `complete`, its `n`); (False, None) when it is missing or unreadable."""
    from skipkv.files import read_json

    try:
        summary = read_json(out / SUMMARY_FILE, "summary")
    except SkipKVError:
        return False, None
    if not isinstance(summary, dict):
        return False, None
    n = summary.get("n")
    return summary.get("complete") is True, n if isinstance(n, int) else None


def cell_status(cell: Cell, limit: int | None, samples: int,
                holders: Mapping[tuple[int, int, int], int]) -> CellStatus:
    """The status of one cell (its run dir `cell["out_dir"]`); `limit` and `samples` are its eval config's."""
    out = Path(cell["out_dir"])
    try:
        records, _ = read_records(out / RECORDS_FILE)  # read-only: a torn last line is skipped, not cut
    except SkipKVError as exc:
        return CellStatus(cell["name"], cell["out_dir"], 0, None, False, _writer(out, holders), str(exc))
    done = len(records)
    target = None if limit is None else limit * samples
    complete, summary_n = _summary_complete(out)
    # summary.json is written when a run ends; records added since (a resumed run at work) are newer than it.
    complete = complete and (summary_n is None or summary_n == done)
    if target is not None and done >= target:
        complete = True
    return CellStatus(cell["name"], cell["out_dir"], done, target, complete, _writer(out, holders))
