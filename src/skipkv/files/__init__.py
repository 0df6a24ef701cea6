"""One reader for every file skipkv loads: JSON, JSON lines, YAML and safetensors metadata, under limits.

    from skipkv.files import read_json, read_jsonl, read_yaml
    config = read_json(Path("runs/g/config.json"), "config")     # a dict, checked by the "config" schema
    for num, row in read_jsonl(Path("prompts.jsonl"), "prompts"):  # (line number, value), checked per line
        ...
    python -c "from skipkv.files import LIMITS; print(LIMITS['prompts'])"

Every problem is a `FileError` (a SkipKVError: one line on stderr, exit 2) naming the file, the line and what
is wrong. Each file kind has limits (`LIMITS`: file size, line length, nesting depth, digits of a number),
checked before the text is parsed, so no file can exhaust memory or the stack, and a schema
(`schemas.py`). What the project writes it reads back: JSON lines are split only at "\\n" (a U+2028 or
U+0085 inside a string is text) and decoded as strict UTF-8. YAML goes through a safe loader that refuses
anchors and aliases (no alias bomb), merge keys and a key given twice. Text is checked once, here: a lone
surrogate (a `\\ud800` escape) is refused, since no tokenizer can encode it.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from skipkv.files.limits import LIMITS, FileError, Limits, _limits, _size
from skipkv.files.schemas import validate
from skipkv.files.text import check_text, walk_text
from skipkv.files.yaml_loader import load_yaml

__all__ = ["LIMITS", "FileError", "Limits", "check_text", "exists", "packed", "parse_json", "parse_json_line",
           "read_bytes",
           "count_lines", "read_json", "read_jsonl", "read_text", "read_yaml", "split_lines"]

def packed(path: Path) -> Path:
    """Where a finished run keeps `path` compressed (`skipkv pack`): the same name with ".gz" added."""
    path = Path(path)
    return path.with_name(path.name + ".gz")


def exists(path: Path) -> bool:
    """Whether `path` exists as it is or compressed (`packed`)."""
    return Path(path).exists() or packed(path).exists()


def read_bytes(path: Path, kind: str) -> bytes:
    """The whole file, refused past its kind's size limit before it is read. A file that exists only compressed
    (`packed(path)`, gzip) is read through gzip, the limit applying to what it holds."""
    lim = _limits(kind)
    path = Path(path)
    opener: Any = open
    if not path.exists() and packed(path).exists():
        path, opener = packed(path), gzip.open
    try:
        with opener(path, "rb") as f:
            data = f.read(lim.file_bytes + 1)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise FileError(f"{path}: not a complete gzip file ({exc})") from None
    except IsADirectoryError:
        raise FileError(f"{path}: is a folder, not a file") from None
    except OSError as exc:
        raise FileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > lim.file_bytes:
        raise FileError(f"{path}: larger than {_size(lim.file_bytes)}, the limit for {kind} files ({lim.why})")
    return data


# A JSON string literal; removed before the brackets are counted (a "[" inside a string is text).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _check_depth(raw: bytes, where: str, lim: Limits) -> None:
    """Refuse nesting deeper than lim.depth before json (a recursive parser) sees it."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if len(brackets) <= lim.depth:
        return
    depth = 0
    for c in brackets:
        depth += 1 if c in (0x5B, 0x7B) else -1
        if depth > lim.depth:
            raise FileError(f"{where}: nested deeper than {lim.depth} levels")


def _number(lim: Limits, where: str, cast: type):
    def parse(text: str) -> Any:
        if len(text) > lim.number_chars:
            raise FileError(f"{where}: a number of {len(text)} characters (at most {lim.number_chars})")
        return cast(text)
    return parse


def _pairs(where: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise FileError(f"{where}: key {dup[:80]!r} is given twice")
        return out
    return hook


def parse_json(raw: bytes | str, where: str, kind: str) -> Any:
    """One JSON document (a file, a line, a metadata value) under `kind`'s limits; strict UTF-8, no lone
    surrogates, no duplicate keys. `where` ("path:line") starts every error message."""
    lim = _limits(kind)
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if len(data) > lim.line_bytes:
        raise FileError(f"{where}: longer than {_size(lim.line_bytes)}, the limit for one {kind} entry ({lim.why})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileError(f"{where}: not UTF-8 text (byte {exc.start})") from None
    _check_depth(data, where, lim)
    try:
        value = json.loads(text, parse_int=_number(lim, where, int), parse_float=_number(lim, where, float),
                           object_pairs_hook=_pairs(where))
    except json.JSONDecodeError as exc:
        raise FileError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:  # a backstop: _check_depth keeps the nesting far below the interpreter's limit
        raise FileError(f"{where}: nested too deeply") from None
    if _SURROGATE_ESCAPE.search(data):  # only a \\udXXX escape can put a lone surrogate into parsed text
        walk_text(value, where)
    return value


def count_lines(data: bytes, path: Path | str, kind: str) -> None:
    """Refuse a JSON-lines file of more lines than its kind allows, before any line is parsed."""
    lim = _limits(kind)
    if data.count(b"\n") > lim.lines and sum(1 for _ in split_lines(data)) > lim.lines:
        raise FileError(f"{path}: more than {lim.lines} lines, the limit for {kind} files")


def split_lines(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    """(line number from 1, byte offset, line without its "\\n") for every non-blank line; split at "\\n" only."""
    pos, num = 0, 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        end = len(data) if nl < 0 else nl
        num += 1
        line = data[pos:end]
        if line.strip():
            yield num, pos, line
        pos = end + 1


def parse_json_line(line: bytes, path: Path | str, num: int, kind: str, schema: str | None = None) -> Any:
    """One JSON line under `kind`'s limits, checked by `schema` (default: the kind's own)."""
    where = f"{path}:{num}"
    return validate(schema or kind, parse_json(line, where, kind), where)


def read_jsonl(path: Path, kind: str, schema: str | None = None) -> list[tuple[int, Any]]:
    """[(line number, value)] of a JSON-lines file under `kind`'s limits, every line checked by `schema`
    (default: the kind's own)."""
    data = read_bytes(path, kind)
    count_lines(data, path, kind)
    return [(num, parse_json_line(line, path, num, kind, schema)) for num, _, line in split_lines(data)]


def read_text(path: Path, kind: str) -> str:
    """A UTF-8 text file under `kind`'s size limit."""
    data = read_bytes(path, kind)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise FileError(f"{path}:{line}: not UTF-8 text (byte {exc.start})") from None


def read_json(path: Path, kind: str) -> Any:
    """A JSON file checked by `kind`'s schema."""
    return validate(kind, parse_json(read_bytes(path, kind), str(path), kind), str(path))


def read_yaml(path: Path, kind: str) -> Any:
    """A YAML file through the strict safe loader (yaml_loader.py), checked by `kind`'s schema."""
    data = read_bytes(path, kind)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise FileError(f"{path}:{line}: not UTF-8 text (byte {exc.start})") from None
    value = load_yaml(text, str(path), _limits(kind))
    walk_text(value, str(path))
    return validate(kind, value, str(path))

