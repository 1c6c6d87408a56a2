"""DeepEP itself, on several GPUs: skipped with the reason wherever that is not available.

Nothing in this file has run yet: the machines this plugin was written on have no GPU, and the
GPU machines lent to its session had one GPU each (DeepEP needs a group of at least 2).
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.gpu


def _why_not() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device here (DeepEP needs at least 2 GPUs of compute capability 9.0+)"
    count = torch.cuda.device_count()
    if count < 2:
        return f"{count} CUDA device here; DeepEP needs an expert-parallel group of at least 2"
    caps = {torch.cuda.get_device_capability(i) for i in range(count)}
    if min(caps) < (9, 0):
        return f"compute capabilities {sorted(caps)}; DeepEP is declared for 9.0+"
    if importlib.util.find_spec("deep_ep") is None:
        return "deep_ep is not importable (see README.md, 'Installing DeepEP')"
    return None


@pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))
@pytest.mark.parametrize("world", [2, 4, 8])
def test_deepep_on_gpus_against_the_references(world):
    import torch

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    import deepep_workers as W
    from deepep_dist import RankPool

    pool = RankPool(world, backend="nccl")
    try:
        results = pool.run(W.gpu_against_reference, [37, 5, 64, 1, 12, 2, 128, 3][:world], 128,
                           timeout=300)
    finally:
        pool.close()
    assert all(r == {"normal": True, "low_latency": True} for r in results)
