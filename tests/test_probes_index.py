"""benchmarks/probes/README.md against the probes themselves: one row per script, each script's usage line naming
its own path, every result file the index names present under docs/results/ (no script is run)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBES = ROOT / "benchmarks" / "probes"


def index_rows() -> dict[str, str]:
    """Probe file name -> its table row in the index."""
    rows = {}
    for line in (PROBES / "README.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| `([a-z0-9_]+\.py)` \|", line)
        if m:
            rows[m.group(1)] = line
    return rows


def test_every_probe_has_one_row_and_every_row_a_probe():
    scripts = sorted(p.name for p in PROBES.glob("*.py"))
    assert scripts, "no probes found"
    assert sorted(index_rows()) == scripts


def test_each_probe_documents_its_own_path_and_takes_help():
    for path in sorted(PROBES.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        doc = ast.get_docstring(tree) or ""
        assert f"benchmarks/probes/{path.name}" in doc, f"{path.name}: its docstring's command names another path"
        calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        assert "ArgumentParser" in calls, f"{path.name}: no argparse parser, so --help would run the probe"


def test_commands_and_result_files_in_the_index_exist():
    for name, row in index_rows().items():
        assert f"python benchmarks/probes/{name}" in row, f"{name}: its row has no command for it"
        cells = row.split(" | ")
        for ref in re.findall(r"`([\w/.-]+\.json)`", cells[-1]):
            if not ref.startswith("..."):
                assert (ROOT / "docs" / "results" / ref).is_file(), f"{name}: docs/results/{ref} missing"
