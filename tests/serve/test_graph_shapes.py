"""KV reads of graph-replayed varlen steps are padded to powers of two, not to the whole cache."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.serve.engine import Engine
from moe_runtime.serve.graph_shapes import (
    KV_FLOOR,
    bucket_kv_reads,
    kv_bucket,
    prefer_replanning_free_attention,
)
from moe_runtime.serve.loading import load_for_serving


@pytest.mark.parametrize(("tokens", "cap", "want"), [
    (0, 10304, KV_FLOOR), (1, 10304, KV_FLOOR), (KV_FLOOR, 10304, KV_FLOOR),
    (KV_FLOOR + 1, 10304, 2 * KV_FLOOR), (5000, 10304, 8192), (9000, 10304, 10304),
    (10304, 10304, 10304), (300, 200, 300),  # never below what the step reads
])
def test_kv_bucket(tokens, cap, want):
    assert kv_bucket(tokens, cap) == want


def test_kv_bucket_bounds_the_waste_and_the_shapes():
    sizes = {kv_bucket(t, 10304) for t in range(0, 10305)}
    assert len(sizes) <= 8  # 256 ... 8192, and the cap
    assert all(kv_bucket(t, 10304) < 2 * t for t in range(KV_FLOOR + 1, 10305))


@pytest.mark.parametrize("bad", [(-1, 10), (5, 0), (5, 10, 0)])
def test_kv_bucket_refuses_bad_arguments(bad):
    with pytest.raises(ValueError, match="kv_bucket"):
        kv_bucket(*bad[:2], *(bad[2:] and [bad[2]]))


def test_wrapped_runner_pads_kv_to_a_bucket(model_dir):
    """On transformers' own batch processor (made on CPU, with padding forced on as CUDA graphs
    would set it): a varlen step's KV read goes to the bucket, the query padding stays
    transformers', a decode fast-path step is untouched."""
    engine = Engine(load_for_serving(model_dir, dtype="float32", progress=False),
                    max_batch_size=4, max_model_len=600, cuda_graphs=False)
    engine.start()  # the probe makes the batch processor on the batching thread
    try:
        processor = engine._manager.batch_processor
        runner = getattr(processor, "model_runner", processor)
        if not hasattr(runner, "maybe_pad_inputs"):
            pytest.skip("this transformers has no maybe_pad_inputs")
        runner.pad_inputs = True
        for name in ("_pad_inputs",):
            if hasattr(runner, name):
                setattr(runner, name, True)
        q_before, kv_before = runner.maybe_pad_inputs(5, 160, False)
        assert bucket_kv_reads(processor)
        q_after, kv_after = runner.maybe_pad_inputs(5, 160, False)
        assert q_after == q_before
        assert kv_before > 160  # transformers pads to its interval, capped at the cache
        assert kv_after == min(kv_before, KV_FLOOR)
        assert runner.maybe_pad_inputs(5, 500, False)[1] == min(kv_before, 512)
    finally:
        engine.shutdown()


def test_cudnn_attention_left_alone_off_cuda():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert prefer_replanning_free_attention("cpu") is None
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
