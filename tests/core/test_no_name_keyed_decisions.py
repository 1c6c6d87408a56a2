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
