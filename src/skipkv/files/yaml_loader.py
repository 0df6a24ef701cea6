"""The strict YAML loader behind `skipkv.files.read_yaml`: PyYAML's safe loader with anchors and aliases allowed
only while the document they expand to stays small (an alias bomb expands a few hundred bytes into gigabytes; a
config naming one list twice, as benchmarks/results_skipkv_prereg.yaml does, is valid YAML and is read), without
merge keys, refusing a key given twice (YAML says keys are unique; PyYAML silently keeps the last), a nesting
deeper than the limit and an over-long number. Errors name the file and line.

    python -c "from skipkv.files.yaml_loader import load_yaml; from skipkv.files import LIMITS; \\
        print(load_yaml('a: 1', 'x.yaml', LIMITS['sweep']))"
"""

from __future__ import annotations

from typing import Any

import yaml

from skipkv.errors import SkipKVError
from skipkv.files.limits import FileError, Limits


def _error(where: str, mark: Any, what: str) -> SkipKVError:
    line = f":{mark.line + 1}" if mark is not None else ""
    return FileError(f"{where}{line}: {what}")


class _StrictLoader(yaml.SafeLoader):
    where = "?"
    limits: Limits

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > self.limits.depth:
                raise _error(self.where, event.start_mark, f"nested deeper than {self.limits.depth} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise _error(self.where, key_node.start_mark, "merge keys (<<) are not allowed")
            key = self.construct_object(key_node, deep=True)
            try:
                dup = key in seen
            except TypeError:
                raise _error(self.where, key_node.start_mark, "a mapping key must be a plain value") from None
            if dup:
                raise _error(self.where, key_node.start_mark, f"key {str(key)[:80]!r} is given twice")
            seen.add(key)
        return super().construct_mapping(node, deep)

    def _number(self, node: Any, base: Any) -> Any:
        if len(str(node.value)) > self.limits.number_chars:
            raise _error(self.where, node.start_mark,
                         f"a number of {len(str(node.value))} characters (at most {self.limits.number_chars})")
        return base(self, node)


def _int(loader: _StrictLoader, node: Any) -> Any:
    return loader._number(node, yaml.SafeLoader.construct_yaml_int)


def _float(loader: _StrictLoader, node: Any) -> Any:
    return loader._number(node, yaml.SafeLoader.construct_yaml_float)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _int)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _float)


# Nodes a document may expand to with every alias replaced by what it names (a sweep config has a few hundred).
MAX_EXPANDED_NODES = 100_000


def _expanded(node: Any, memo: dict[int, int]) -> int:
    """Nodes of `node` with every alias expanded, counted without expanding: an alias is the same node object
    wherever it appears, so each distinct node is sized once. (Recursion: bounded by the nesting limit.)"""
    if id(node) in memo:
        return memo[id(node)]
    n = 1
    if isinstance(node, yaml.SequenceNode):
        n += sum(_expanded(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        n += sum(_expanded(k, memo) + _expanded(v, memo) for k, v in node.value)
    memo[id(node)] = n
    return n


def load_yaml(text: str, where: str, limits: Limits) -> Any:
    """One YAML document from `text` (`where` names it in errors)."""
    loader = None
    try:
        loader = _StrictLoader(text)  # the reader refuses unprintable characters here already
        loader.where, loader.limits = where, limits
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded(node, {})
        if size > MAX_EXPANDED_NODES:
            raise _error(where, None, f"its anchors and aliases expand to {size:,} nodes (at most "
                                      f"{MAX_EXPANDED_NODES:,}: an alias bomb would exhaust memory)")
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        raise _error(where, exc.problem_mark, f"not valid YAML ({exc.problem})") from None
    except yaml.YAMLError as exc:
        raise _error(where, None, f"not valid YAML ({str(exc).splitlines()[0][:120]})") from None
    except RecursionError:  # a backstop: compose_node bounds the nesting well below the interpreter's limit
        raise _error(where, None, "nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()
