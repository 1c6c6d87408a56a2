"""Repository-wide pytest set-up (the only conftest that may declare ``pytest_plugins``)."""

import os
import sys
from pathlib import Path

import torch

# Test modules are imported as ``tests.execution.test_x`` (``--import-mode=importlib``), and the
# tests that spawn worker processes pickle functions of those modules by that name: the children
# (which inherit this sys.path) find the ``tests`` namespace only with the repository root on it.
# ``python -m pytest`` from the root puts it there; a bare ``pytest`` does not.
ROOT = str(Path(__file__).resolve().parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Triton kernels run in Triton's interpreter on machines without CUDA. The variable must be set
# before anything imports triton (transformers may, early in a full run), so it is set here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["pytester", "moe_runtime.testing.plugin"]
