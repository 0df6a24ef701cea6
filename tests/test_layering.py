"""The import structure of src/skipkv, checked against DESIGN.md's layers (held here as data).

    python -m pytest tests/test_layering.py -q

Every module's imports are read with `ast` (module level, inside functions, under TYPE_CHECKING, relative
imports, and `importlib.import_module("skipkv...")` with a literal name) and mapped to packages: the first
name under `skipkv` (`skipkv.eval.runner` -> `eval`); the package root `skipkv/__init__.py` is its own entry,
the public facade. A package may import itself, any package of an earlier layer, and a package listed
before it in its own layer: so every arrow points down (or left), and no circle is possible; the circle
check below says which packages close one when the order is broken. Modules are checked for circles too.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "skipkv"

# DESIGN.md "Layering", bottom up; within a layer, a package may use those listed before it.
LAYERS: tuple[tuple[str, ...], ...] = (
    # 1. pure foundations: no model run, no policy
    ("errors", "files", "version", "config", "registry", "kernels", "hardware", "plan", "outputs", "models", "cache",
     "scoring", "sentences"),
    # 2. what one forward observes and changes: the attention backend, the steering hook and gate, the policies
    ("attention", "steering", "policies"),
    # 3. requests, scheduler, KV memory, the step loop
    ("engine",),
    # 4. drivers of the engine: evaluation (and the steering build driver, which generates text), servers, benchmarks
    ("eval", "serve", "bench", "llm", "press", "press_pipeline"),
    # 5. readers of records and the entry points; `skipkv` is the package root (lazy re-exports for users)
    ("report", "sweep", "cli", "skipkv"),
)
ORDER = {pkg: i for i, pkg in enumerate(p for layer in LAYERS for p in layer)}
LAYER_OF = {pkg: n for n, layer in enumerate(LAYERS, 1) for pkg in layer}


def module_name(path: Path, root: Path) -> str:
    parts = ("skipkv", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "skipkv"


def imported_modules(path: Path, root: Path) -> list[tuple[str, int]]:
    """(module imported, line) for every skipkv import in the file, wherever it sits."""
    me = module_name(path, root)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from skipkv import engine` names the submodule, not the root
            if target == "skipkv":
                found += [(f"skipkv.{a.name}", node.lineno) for a in node.names]
            else:
                found.append((target, node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.args[0].value, node.lineno))
    return [(m, line) for m, line in found if m == "skipkv" or m.startswith("skipkv.")]


def import_edges(root: Path) -> list[tuple[str, str, str, int]]:
    """(from package, to package, file, line) for every import between two different packages."""
    edges = []
    for path in sorted(root.rglob("*.py")):
        src = package_of(module_name(path, root))
        for target, line in imported_modules(path, root):
            dst = package_of(target)
            if not ((root / dst).is_dir() or (root / f"{dst}.py").is_file()):
                dst = "skipkv"  # `from skipkv import __version__`: a name of the root, not a submodule
            if dst != src:
                edges.append((src, dst, str(path.relative_to(root.parent)), line))
    return edges


def module_edges(root: Path) -> list[tuple[str, str, str, int]]:
    """(from module, to module, file, line) for imports between two modules (the target is the longest
    existing module its dotted name starts with: `from skipkv.eval.data import Example` -> skipkv.eval.data)."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    edges = []
    for name, path in sorted(modules.items()):
        for target, line in imported_modules(path, root):
            parts = target.split(".")
            while ".".join(parts) not in modules:
                parts.pop()
            if ".".join(parts) != name:
                edges.append((name, ".".join(parts), str(path.relative_to(root.parent)), line))
    return edges


def unplaced(root: Path) -> list[str]:
    """Packages under root that LAYERS does not place (a new package must be given a layer)."""
    names = {package_of(module_name(p, root)) for p in root.rglob("*.py")}
    return sorted(names - set(ORDER))


def upward(edges) -> list[str]:
    return [f"{f}:{line}: {a} (layer {LAYER_OF.get(a)}) imports {b} (layer {LAYER_OF.get(b)})"
            for a, b, f, line in edges if a in ORDER and b in ORDER and ORDER[b] > ORDER[a]]


def circles(edges) -> list[list[str]]:
    """Strongly connected groups of more than one package (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b, _, _ in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_every_package_has_a_layer():
    assert unplaced(SRC) == []


def test_no_upward_import():
    assert upward(import_edges(SRC)) == []


def test_no_import_circle_between_packages():
    assert circles(import_edges(SRC)) == []


def test_no_import_circle_between_modules():
    """Also inside a package: no two modules import each other, even lazily (such a pair hides which one
    is the base; the dataset registry moved to eval/data.py to open datasets.py <-> longctx.py)."""
    assert circles(module_edges(SRC)) == []


def test_the_reader_sees_lazy_relative_and_importlib_imports(tmp_path):
    """The parser finds imports hidden in functions, relative ones and importlib calls."""
    root = tmp_path / "skipkv"
    (root / "cache").mkdir(parents=True)
    (root / "cache" / "__init__.py").write_text("")
    (root / "cache" / "x.py").write_text(
        "import importlib\n"
        "def f():\n    from skipkv.engine import Engine\n"
        "def g():\n    from ..eval import runner\n"
        "def h():\n    return importlib.import_module('skipkv.report')\n")
    got = {m for m, _ in imported_modules(root / "cache" / "x.py", root)}
    assert got == {"skipkv.engine", "skipkv.eval", "skipkv.report"}


@pytest.mark.parametrize("lazy", [False, True])
def test_a_planted_upward_import_fails(tmp_path, lazy):
    """Copy the real tree, add one upward import (cache -> engine), and the checks report it as an upward
    arrow and as the circle it closes (engine imports cache)."""
    root = tmp_path / "skipkv"
    shutil.copytree(SRC, root, ignore=shutil.ignore_patterns("__pycache__"))
    assert upward(import_edges(root)) == [] and circles(import_edges(root)) == []
    store = root / "cache" / "store.py"
    plant = ("\n\ndef _planted():\n    from skipkv.engine import Engine\n    return Engine\n" if lazy
             else "\nfrom skipkv.engine import Engine  # noqa\n")
    store.write_text(store.read_text(encoding="utf-8") + plant, encoding="utf-8")
    found = upward(import_edges(root))
    assert len(found) == 1 and "cache/store.py" in found[0] and "cache (layer 1) imports engine (layer 3)" in found[0]
    assert any({"cache", "engine"} <= set(group) for group in circles(import_edges(root)))


def test_a_new_package_must_be_placed(tmp_path):
    root = tmp_path / "skipkv"
    shutil.copytree(SRC, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "newthing").mkdir()
    (root / "newthing" / "__init__.py").write_text("")
    assert unplaced(root) == ["newthing"]
