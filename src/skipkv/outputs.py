"""Output paths: checked before any work starts, created so that a refused run leaves nothing, written atomically.

    from skipkv.outputs import check_dir, check_file, made_dir, write_atomic
    check_file("docs/bench.json", "--out")         # a one-line SkipKVError now, not after an hour of work
    with made_dir(Path("runs/x")) as created: ...   # an exception inside removes the folders it created
    write_atomic(Path("runs/x/summary.json"), text) # readers see the old file or the new one, never half

`skipkv eval`, `bench decode` and `report` go through these, so `--out ''`, a file given as a folder, a
folder below a file and a place this process cannot write all fail the same way, before a model loads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from skipkv.errors import SkipKVError


def _nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists (the folder a mkdir -p would start from)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_writable_below(path: Path, what: str) -> None:
    base = _nearest_existing(path)
    if not base.is_dir():
        raise SkipKVError(f"{what} {path}: {base} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise SkipKVError(f"{what} {path}: {base} is not writable")


def _nonempty(path: str | os.PathLike, what: str) -> Path:
    text = os.fspath(path)
    if not isinstance(text, str) or not text.strip():
        # An empty --out would resolve to the working directory and write (and overwrite) files there.
        raise SkipKVError(f"{what} must name a path, got {text!r}")
    if "\0" in text:
        raise SkipKVError(f"{what} {text!r}: a path cannot contain a NUL byte")
    return Path(text)


def check_dir(path: str | os.PathLike, what: str = "--out") -> Path:
    """A folder that will be created (or reused) and written into: not empty, not a file, not below a file,
    and the nearest existing ancestor writable. Returns it as a Path; creates nothing."""
    p = _nonempty(path, what)
    if p.exists() and not p.is_dir():
        raise SkipKVError(f"{what} {p} is a file, not a folder")
    _check_writable_below(p, what)
    return p


def check_file(path: str | os.PathLike, what: str = "--out") -> Path:
    """A file that will be written at the end of a run: not a folder, and its folder creatable and writable."""
    p = _nonempty(path, what)
    if p.is_dir() or os.fspath(path).endswith(os.sep):
        raise SkipKVError(f"{what} {p} is a folder; give a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise SkipKVError(f"{what} {p} is not writable")
    _check_writable_below(p.parent if str(p.parent) else Path("."), what)
    return p


@contextlib.contextmanager
def made_dir(path: Path, what: str = "--out") -> Iterator[list[Path]]:
    """Create `path` (and missing parents); if the block raises, remove the folders this call created.

    Yields the list of created folders, outermost first; the block may empty it to keep them (once it has
    written something worth keeping). Only empty folders are removed (rmdir), so nothing else is ever lost.
    """
    path = check_dir(path, what)
    created = []
    p = Path(os.path.abspath(path))
    while not p.exists():
        created.append(p)
        p = p.parent
    created.reverse()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _remove_empty(created)
        raise SkipKVError(f"{what} {path}: cannot create it ({exc.strerror})") from None
    try:
        yield created
    except BaseException:
        _remove_empty(created)
        raise


def _remove_empty(created: list[Path]) -> None:
    for folder in reversed(created):
        with contextlib.suppress(OSError):
            folder.rmdir()


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, fsync it, then rename it over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise SkipKVError(f"cannot write {path}: {exc.strerror}") from None
