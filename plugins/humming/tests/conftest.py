"""The tests import the package from this checkout also under ``--import-mode=importlib``; on a
machine without CUDA, the triton plugin's routing kernels (where installed) run in Triton's
interpreter (``TRITON_INTERPRET`` set before anything imports triton)."""

import os
import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
