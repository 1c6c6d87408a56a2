"""Tests run on CPU through Triton's interpreter unless a CUDA device is present.

``TRITON_INTERPRET`` must be set before triton is imported, so it is set here, first.
"""

import os
import sys
from pathlib import Path

import pytest

# The tests import the package from this checkout (and any sibling helper module) also under
# ``--import-mode=importlib`` (the repository root's setting). The conformance suite's pytest plugin
# is declared by the repository root's conftest, or by ``-p`` in this distribution's pyproject.
_HERE = Path(__file__).resolve().parent
for _p in (_HERE, _HERE.parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none present; CPU runs use the interpreter)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return "cuda" if _HAS_CUDA else "cpu"


@pytest.fixture
def tuned_table(tmp_path, monkeypatch):
    """A tuned table of the test's own at ``MOE_TRITON_CONFIGS`` (the path it yields, written by
    the test), read afresh; the plugin's own table again afterwards."""
    from moe_runtime_triton import ops

    path = tmp_path / "configs.json"
    monkeypatch.setenv("MOE_TRITON_CONFIGS", str(path))
    ops._tuned_table.cache_clear()
    ops._table_applies.cache_clear()
    yield path
    monkeypatch.delenv("MOE_TRITON_CONFIGS")
    ops._tuned_table.cache_clear()
    ops._table_applies.cache_clear()
