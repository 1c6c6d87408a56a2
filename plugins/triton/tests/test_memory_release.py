"""Nothing of the plugin keeps a layer's weights alive once their owner lets them go: the
backend's config caches are per backend (a class-level ``lru_cache`` on a method held every
backend it had seen, and so every layer's prepared weights, after the model was deleted), and
the TMA views kept with the prepared weights do not point back at them strongly (a reference
cycle that only the cyclic collector frees: until then the views' interleaved copy stays
allocated). No kernel launched (the TMA views on the GPU where there is one)."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch
from moe_runtime_triton import ops
from moe_runtime_triton.backend import TritonExperts
from test_kernels import make_weights


@pytest.fixture
def no_cyclic_gc():
    """What plain reference counting frees (the cyclic collector off for the test)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _backend(E, K, run_as):
    be = TritonExperts.__new__(TritonExperts)  # the setup's checks are the planner's business
    be.setup = types.SimpleNamespace(num_local_experts=E, runs_as=run_as,
                                     problem=types.SimpleNamespace(name="l", top_k=K))
    return be


def test_a_backend_and_its_weights_are_freed_after_config_lookups(monkeypatch):
    monkeypatch.setattr(ops, "TMA_MODE", "0")
    E, H, I, K = 4, 64, 32, 2
    w = make_weights("bf16", E, H, I, device="cpu", seed=1)
    be = _backend(E, K, "bf16")
    be.prepare(w)
    cfg = be._config(16, K)
    assert be._config(16, K) is cfg  # still cached per backend
    be._config(1, K)
    be._masked_config(8)
    gone_backend, gone_w13 = weakref.ref(be), weakref.ref(be.weights.w13)
    del be, w
    gc.collect()
    assert gone_backend() is None, "a cache keeps the backend (and its layer's weights) alive"
    assert gone_w13() is None


def test_tma_views_kept_with_the_weights_do_not_keep_them_alive(monkeypatch, no_cyclic_gc):
    E, H, I = 4, 64, 32
    # on a CUDA machine without the interpreter, CPU weights are prepared as float32, which
    # has no TMA path (the 2026-12-07 H100 run of this test): the views are made on the GPU
    device = "cuda" if torch.cuda.is_available() and not ops.INTERPRET else "cpu"
    pw = ops.prepare_weights(make_weights("bf16", E, H, I, device=device, seed=2))
    tw = ops.tma_weights(pw, True)  # the interleaved copy of w13
    assert ops.tma_weights(pw, True) is tw and tw.pw.num_experts == E
    gone_pw, gone_copy = weakref.ref(pw), weakref.ref(tw.w13)
    del pw, tw
    assert gone_pw() is None, "the prepared weights wait for the cyclic collector"
    assert gone_copy() is None
