"""Drift tests: every hook spec is documented with its exact signature, and has a test."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from moe_runtime.plugin import hookspecs

ROOT = Path(__file__).resolve().parents[2]
HOOKS = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
         if name.startswith("moe_runtime_")]


def test_there_are_hooks():
    assert HOOKS == ["moe_runtime_register_backends", "moe_runtime_register_formats"]


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_with_its_exact_signature(hook):
    sig = f"{hook}{inspect.signature(getattr(hookspecs, hook))}"
    assert f"## `{sig}`" in (ROOT / "docs" / "hooks.md").read_text()


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_docstring_with_params(hook):
    doc = getattr(hookspecs, hook).__doc__ or ""
    for param in inspect.signature(getattr(hookspecs, hook)).parameters:
        assert f":param {param}:" in doc


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_implemented_in_a_test(hook):
    sources = [p.read_text() for p in (ROOT / "tests").rglob("test_*.py")
               if p.name != "test_hook_docs.py"]
    assert any(f"def {hook}(" in s for s in sources), f"no test implements {hook}"


def test_no_hookspec_is_undocumented_in_the_docs_file():
    text = (ROOT / "docs" / "hooks.md").read_text()
    documented = {line.split("`")[1].split("(")[0] for line in text.splitlines()
                  if line.startswith("## `")}
    assert documented == set(HOOKS)
