"""File kinds and their limits, and the error every reader raises (the base of skipkv.files).

    python -c "from skipkv.files.limits import LIMITS; print(LIMITS['prompts'])"
"""

from __future__ import annotations

from dataclasses import dataclass

from skipkv.errors import SkipKVError

MiB = 1 << 20


class FileError(SkipKVError):
    """A file that cannot be used, in one line: `PATH:LINE: what is wrong`."""


@dataclass(frozen=True)
class Limits:
    """What one file kind may hold; `why` is said in the error when a size limit is hit."""

    file_bytes: int
    line_bytes: int
    why: str
    depth: int = 64  # nesting of lists/objects; the project's own files nest < 10 deep
    number_chars: int = 100  # digits of one number (2**128 has 39): Python's int() is quadratic in them
    lines: int = 1 << 20  # non-blank lines of a JSON-lines file: each becomes objects in memory


LIMITS: dict[str, Limits] = {
    # A prompt longer than any model context is refused anyway; 4 MiB is also the server's body cap.
    "prompts": Limits(256 * MiB, 4 * MiB, "a prompt longer than any model's context"),
    "data": Limits(512 * MiB, 4 * MiB, "an example longer than any model's context"),
    "records": Limits(4096 * MiB, 64 * MiB, "a record holds one prompt and one generation", lines=1 << 22),
    "traces": Limits(8192 * MiB, 64 * MiB, "a trace holds one request's tokens and evictions"),
    "sessions": Limits(256 * MiB, 4 * MiB, "a session line holds one machine description"),
    "config": Limits(16 * MiB, 16 * MiB, "a run's config.json"),
    "summary": Limits(16 * MiB, 16 * MiB, "a run's summary.json"),
    "sweep": Limits(1 * MiB, 1 * MiB, "a sweep config"),
    "safetensors_index": Limits(64 * MiB, 64 * MiB, "a weight map"),
    "steering_meta": Limits(16 * MiB, 16 * MiB, "a steering file's metadata"),
    "haystack": Limits(256 * MiB, 256 * MiB, "a haystack far beyond any model's context"),
}


def _limits(kind: str) -> Limits:
    if kind not in LIMITS:
        raise KeyError(f"no file kind {kind!r}")  # a bug in the caller, not a user error
    return LIMITS[kind]


def _size(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n} bytes"
