"""Tiny ModelOpt exports shared by the execution tests (made once per session, on CPU).

``MOE_RUNTIME_TINY_CACHE=DIR`` keeps them in ``DIR`` across runs: a machine without
nvidia-modelopt (the GPU machine) reuses exports made elsewhere and carried there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    made: dict = {}
    cache = os.environ.get("MOE_RUNTIME_TINY_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("tiny")

    def get(arch: str, quant: str, **kw):
        key = (arch, quant, tuple(sorted(kw.items())))
        if key not in made:
            name = f"{arch}-{quant}-" + "-".join(f"{k}{v}" for k, v in sorted(kw.items()))
            out = root / name
            if not (out / "config.json").exists():
                from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

                make_tiny_checkpoint(out, arch=arch, quant=quant, **kw)
            made[key] = out
        return made[key]

    return get
