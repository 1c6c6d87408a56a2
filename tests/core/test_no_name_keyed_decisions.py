"""No decision anywhere is keyed on a checkpoint's quantization method name or a backend name.

The method names (``modelopt_fp4``...) may appear only where the checkpoint reader *reports* them.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METHOD_NAMES = ("modelopt_fp4", "modelopt_mixed", "modelopt_fp8", "modelopt_w4a16")
REPORTING = {"moe_runtime/checkpoint"}  # resolves and reports the method name, decides nothing


def _sources():
    for base in ("moe_runtime", "plugins"):
        for p in (ROOT / base).rglob("*.py"):
            rel = p.relative_to(ROOT).as_posix()
            if "/tests/" in rel or any(rel.startswith(r) for r in REPORTING):
                continue
            yield rel, p.read_text()


def test_method_names_appear_only_in_the_reporting_code():
    hits = [(rel, name) for rel, text in _sources() for name in METHOD_NAMES
            if re.search(rf"['\"]{name}['\"]", text)]
    assert hits == []


def test_no_comparison_with_a_backend_name_literal():
    pattern = re.compile(
        r"(==|!=|\bin\b)\s*[\(\[{]?\s*['\"](reference|triton|flashinfer_cutedsl|deepep|local|"
        r"torch_all_to_all)['\"]")
    hits = [(rel, m.group(0)) for rel, text in _sources() for m in pattern.finditer(text)
            if not rel.endswith("testing/harness.py")]
    assert hits == []


def test_the_matching_rule_is_written_once():
    """Only the declaration records test a problem against a declaration (Support.check and
    CommSupport.check); the planner, the suite and the plugins' guards call them."""
    membership = re.compile(
        r"(\bfor\s+\w+\s+)?\bin\s+[\w.]*\b(s|support|block|spec|mode|t)\."
        r"(formats|activations|layouts|payloads)\b")
    # iterating over what is declared is fine; so is the case generator listing the blocks that
    # declare a format (it enumerates declarations, it does not match problems against them)
    allowed = {("moe_runtime/testing/cases.py", "in t.formats")}
    hits = [(rel, m.group(0)) for rel, text in _sources() for m in membership.finditer(text)
            if rel != "moe_runtime/declarations.py" and not m.group(1)
            and (rel, m.group(0)) not in allowed]
    assert hits == []


def test_no_capability_from_a_format_name_prefix():
    prefix = re.compile(r"""\.startswith\(\s*['"](nvfp4|fp8|bf16|fp16|mxfp)""")
    hits = [(rel, m.group(0)) for rel, text in _sources() for m in prefix.finditer(text)]
    assert hits == []
