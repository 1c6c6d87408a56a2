"""Shared fixtures of the DeepEP plugin's tests.

The helper modules (``deepep_sim``, ``deepep_dist``, ``deepep_workers``) sit beside the tests and
are imported by name; spawned processes inherit this ``sys.path``.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def _pools():
    pools: dict = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture
def ranks(_pools):
    """``ranks(world)``: a live pool of ``world`` gloo processes (see ``deepep_dist.RankPool``)."""
    from deepep_dist import RankPool

    def get(world: int):
        pool = _pools.get(world)
        if pool is None or not pool.alive:
            pool = _pools[world] = RankPool(world)
        return pool

    return get
