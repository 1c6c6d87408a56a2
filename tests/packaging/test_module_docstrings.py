"""Plugin and backend modules say what they do in a few lines; research notes and measurements
live in the plugin's README.md or in docs/, where they can be as long as they need."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 10
MODULES = sorted([*ROOT.glob("plugins/*/moe_runtime_*/*.py"), *ROOT.glob("moe_runtime/backends/*.py"),
                  *ROOT.glob("moe_runtime/plugin/*.py")])


def test_there_are_modules_to_check():
    assert len(MODULES) > 20


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_docstring_says_what_the_module_does_in_a_few_lines(path):
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    rel = path.relative_to(ROOT).as_posix()
    assert doc and doc.strip(), f"{rel} has no module docstring"
    lines = doc.strip().splitlines()
    assert len(lines) <= MAX_LINES, (
        f"{rel}: the module docstring has {len(lines)} lines; say what the module does in at most "
        f"{MAX_LINES} and move research notes or measurements to the plugin's README.md (or docs/)")
