"""Text checked once, at the edge: a lone surrogate cannot be encoded (UTF-8, or any tokenizer), so it is
refused where it enters (a file, an argument), in one line, instead of as a tokenizer traceback later.

    from skipkv.files.text import check_text
    check_text("a\\udcffb", "prompt 0")   # SkipKVError: prompt 0: character 1 is U+DCFF, a lone surrogate ...
"""

from __future__ import annotations

import re
from typing import Any

from skipkv.errors import SkipKVError

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, where: str) -> str:
    """`text` itself when it is encodable Unicode; else a one-line SkipKVError naming `where` and the character."""
    m = _SURROGATE.search(text)
    if m is not None:
        # Typically a byte that is not UTF-8, smuggled in by surrogateescape (a shell argument), or a "\\udXXX"
        # escape in JSON without its pair.
        raise SkipKVError(f"{where}: character {m.start()} is U+{ord(m.group()):04X}, a lone surrogate "
                          "(not valid Unicode text; is the input UTF-8?)")
    return text


def walk_text(value: Any, where: str) -> None:
    """check_text on every string (keys included) inside parsed JSON/YAML."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            check_text(v, where)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set)):
            stack.extend(v)
