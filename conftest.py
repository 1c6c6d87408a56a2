"""Repository-wide pytest set-up (the only conftest that may declare ``pytest_plugins``)."""

import os

import torch

# Triton kernels run in Triton's interpreter on machines without CUDA. The variable must be set
# before anything imports triton (transformers may, early in a full run), so it is set here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["pytester", "moe_runtime.testing.plugin"]
