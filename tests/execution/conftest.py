"""Tiny ModelOpt exports shared by the execution tests (made once per session, on CPU)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    made: dict = {}
    root = tmp_path_factory.mktemp("tiny")

    def get(arch: str, quant: str, **kw):
        key = (arch, quant, tuple(sorted(kw.items())))
        if key not in made:
            name = f"{arch}-{quant}-" + "-".join(f"{k}{v}" for k, v in sorted(kw.items()))
            made[key] = make_tiny_checkpoint(root / name, arch=arch, quant=quant, **kw)
        return made[key]

    return get
