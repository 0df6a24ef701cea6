"""A new policy is one file: discovered from policies/, its contract-test knobs declared by itself, its README
row generated (`skipkv policies --markdown`) and checked here against README.md.

    python -m pytest tests/test_policy_registry.py -q
"""

from __future__ import annotations

import filecmp
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from skipkv.policies import POLICIES, markdown_table

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "skipkv"
TABLE = re.compile(r"<!-- policy table:[^\n]*-->\n(.*?)<!-- end policy table -->\n", re.S)

# A complete policy, written as a user would: this file and nothing else.
TOY = '''"""Toy policy (tests/test_policy_registry.py): keeps the tokens with the largest key norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skipkv.policies import POLICIES
from skipkv.policies.base import Observation, Policy


@POLICIES.register("toy_keynorm")
@dataclass(frozen=True)
class ToyKeyNorm(Policy):
    paper = "none (a test)"
    keeps = "newest `window` + the largest key norms"
    contract_knobs = {"window": 2}

    def score(self, obs: Observation) -> torch.Tensor:
        return obs.keys.float().norm(dim=-1)  # [b, H, n]
'''


def readme_table(text: str) -> str:
    found = TABLE.search(text)
    assert found, "README.md lacks the generated policy table markers"
    return found.group(1)


def test_readme_table_is_the_registry():
    """Fails when README.md and the registry differ: regenerate with `skipkv policies --markdown`."""
    assert readme_table((ROOT / "README.md").read_text(encoding="utf-8")) == markdown_table()


def test_every_policy_declares_its_row():
    for name in POLICIES.names():
        cls = POLICIES.get(name)
        assert cls.paper and cls.keeps, f"policy {name!r} lacks `paper` or `keeps` (its README row)"
        assert set(cls.contract_knobs) <= {k for k, *_ in cls.knobs()}, f"{name}: contract_knobs names no knob"


def test_a_policy_added_in_one_file_is_discovered_and_runs_the_contract(tmp_path):
    """Copy the package, add one file (policies/toy_keynorm.py), and the unchanged contract test runs the new
    policy; the CLI lists it, and the README check reports the row still to be generated."""
    tree = tmp_path / "src" / "skipkv"
    shutil.copytree(SRC, tree, ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "policies" / "toy_keynorm.py").write_text(TOY, encoding="utf-8")
    # The whole diff against the package: one added file.
    cmp = filecmp.dircmp(SRC / "policies", tree / "policies", ignore=["__pycache__"])
    assert cmp.right_only == ["toy_keynorm.py"] and not cmp.left_only and not cmp.diff_files

    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src")}
    listed = subprocess.run([sys.executable, "-m", "skipkv.cli", "policies", "--markdown"], env=env, cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    assert "| `toy_keynorm` | none (a test) |" in listed and listed != markdown_table()
    assert readme_table((ROOT / "README.md").read_text(encoding="utf-8")) != listed  # the README check would fail

    run = subprocess.run([sys.executable, "-m", "pytest", "tests/test_policies.py", "-k", "toy_keynorm", "-q",
                          "-p", "no:cacheprovider"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    # batch == singles, budget and protected tokens, big budget == full, deterministic under a seed, protected prompt
    assert re.search(r"\b5 passed\b", run.stdout), run.stdout[-1500:]
