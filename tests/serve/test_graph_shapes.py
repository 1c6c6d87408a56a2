"""KV reads of graph-replayed varlen steps are padded to powers of two, not to the whole cache;
opted in, prefill steps replay graphs too, their query tokens padded to geometric buckets."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from moe_runtime.serve.batching import CONTINUOUS, choose_cuda_graphs
from moe_runtime.serve.engine import DECODE_PADDING, Engine, _GraphPolicy
from moe_runtime.serve.graph_shapes import (
    KV_FLOOR,
    PREFILL_ENV,
    bucket_kv_reads,
    bucket_prefill_queries,
    kv_bucket,
    kv_buckets,
    prefer_replanning_free_attention,
    prefill_graph_bound,
    prefill_graphs_requested,
    query_bucket,
    query_buckets,
    seqlen_k_buckets,
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


# ------------------------------------------------------------- prefill steps (opt-in graphs)

@pytest.mark.parametrize(("tokens", "want"), [
    (0, 8), (1, 8), (8, 8), (9, 16), (15, 16), (16, 16),  # up to the decode batch: multiples of 8
    (17, 32), (33, 64), (300, 512), (1025, 2048), (2048, 2048),  # above: powers of two
])
def test_query_bucket(tokens, want):
    assert query_bucket(tokens, cap=2048, dense_up_to=16) == want


def test_query_bucket_is_never_below_the_step_and_never_above_the_cap_unless_the_step_is():
    for dense in (0, 7, 16, 64):
        for t in range(0, 3000):
            size = query_bucket(t, cap=2048, dense_up_to=dense)
            assert size >= t
            assert size <= 2048 or size == t
            if t > dense and t > 8:
                assert size < 2 * t  # at most twice the real tokens above the decode batch
    # the decode batch keeps the padding of today's decode graphs: multiples of 8
    assert [query_bucket(t, 2048, 64) for t in (20, 24, 57, 64)] == [24, 24, 64, 64]
    assert query_bucket(100, cap=96, dense_up_to=16) == 100  # a cap below it does not cut it


def test_query_buckets_count_the_shapes():
    assert query_buckets(2048, 64) == [8, 16, 24, 32, 40, 48, 56, 64, 128, 256, 512, 1024, 2048]
    assert query_buckets(2048, 16) == [8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert query_buckets(300, 20) == [8, 16, 24, 32, 64, 128, 256, 300]
    # transformers' own padding (multiples of 8) would give 256 query shapes for 2048 tokens
    assert len(query_buckets(2048, 64)) == 13


def test_kv_and_key_length_buckets():
    assert kv_buckets(10304) == [256, 512, 1024, 2048, 4096, 8192, 10304]
    assert {kv_bucket(t, 10304) for t in range(10305)} == set(kv_buckets(10304))
    assert seqlen_k_buckets(10304, 640) == [1024]
    assert seqlen_k_buckets(262144, 4096) == [1024, 2048, 4096]
    assert seqlen_k_buckets(3000, 4096) == [1024, 2048, 3000]
    assert seqlen_k_buckets(500, 100) == [500]


def test_prefill_graph_bound_is_the_product_of_the_sizes():
    # the H200 bench shape: 16 clients, 2048-token chunks, 20 blocks of 32 a sequence each
    bound = prefill_graph_bound(2048, 16, 16 * 640, 640)
    assert bound["graphs"] == 9 * 7 * 1 == 63
    wide = prefill_graph_bound(2048, 64, 64 * 4096, 4096)
    assert wide["graphs"] == len(wide["query"]) * len(wide["kv"]) * len(wide["seqlen_k"]) == 429


def test_prefill_graphs_are_on_by_default_and_0_turns_them_off(monkeypatch):
    monkeypatch.delenv(PREFILL_ENV, raising=False)
    assert prefill_graphs_requested() is True
    assert prefill_graphs_requested(False) is False  # the engine's keyword wins
    monkeypatch.setenv(PREFILL_ENV, "")
    assert prefill_graphs_requested() is True
    monkeypatch.setenv(PREFILL_ENV, "1")
    assert prefill_graphs_requested() is True
    assert prefill_graphs_requested(False) is False
    monkeypatch.setenv(PREFILL_ENV, "0")
    assert prefill_graphs_requested() is False
    assert prefill_graphs_requested(True) is True  # the engine's keyword wins
    for bad in ("yes", "on", "2"):
        monkeypatch.setenv(PREFILL_ENV, bad)
        with pytest.raises(ValueError, match=f"{PREFILL_ENV}='{bad}': expected 1 or unset "
                                             r"\(graph prefill steps, the default\) or 0"):
            prefill_graphs_requested()


def test_the_graph_choice_says_whether_prefill_is_graphed():
    off = choose_cuda_graphs("cuda:0", CONTINUOUS, 16, "max_batch_size")
    assert not off.prefill and off.max_graphs is None
    assert ("; prefill eager (turned off by MOE_RUNTIME_GRAPH_PREFILL=0 or the engine's "
            "graph_prefill=False)") in off.describe()
    bound = prefill_graph_bound(2048, 16, 16 * 640, 640)
    on = choose_cuda_graphs("cuda:0", CONTINUOUS, 16, "max_batch_size", prefill=bound)
    assert on.on and on.prefill and on.max_graphs == 63 and on.max_tokens == 16
    assert ("prefill and mixed steps graphed too (MOE_RUNTIME_GRAPH_PREFILL=0 makes them eager): "
            "query tokens padded to multiples of 8 up to 16, then powers of two up to 2048, at "
            "most 63 varlen graphs (9 query x 7 KV-read x 1 key-length sizes)") in on.describe()
    fell_back = choose_cuda_graphs("cuda:0", CONTINUOUS, 16, "max_batch_size",
                                   prefill_eager_because="its capture failed at warm-up: X")
    assert fell_back.on and not fell_back.prefill
    assert "; prefill eager (its capture failed at warm-up: X)" in fell_back.describe()
    # graphs off: nothing is graphed, prefill asked for or not
    assert not choose_cuda_graphs("cpu", CONTINUOUS, 16, "x", prefill=bound).prefill
    assert not choose_cuda_graphs("cuda:0", CONTINUOUS, 16, "x", False, prefill=bound).on


def test_graphs_stay_off_while_an_experts_backend_of_the_plan_does_not_declare_them():
    off = choose_cuda_graphs("cuda:0", CONTINUOUS, 16, "max_batch_size",
                             blockers=("example_bmm", "reference"))
    assert not off.on and off.max_tokens is None
    assert ("experts backend example_bmm, reference of the plan does not declare "
            "cuda_graphs=True") in off.describe()
    assert choose_cuda_graphs("cuda:0", CONTINUOUS, 16, "max_batch_size", blockers=()).on


def test_a_loaded_model_names_the_experts_backends_that_keep_graphs_off(model_dir):
    from moe_runtime.plugin.registry import Registry

    loaded = load_for_serving(model_dir, dtype="float32", progress=False)
    registry = Registry.load()
    held = {name for lp in loaded.plan.layers for name in lp.experts_backends}
    assert held  # the CPU plan's backends (reference, cpu_dequantized) promise no capture
    assert set(loaded.graph_blockers) == {n for n in held if not registry.experts_spec(n).cuda_graphs}
    assert set(loaded.graph_blockers) == held
    # the GPU backends promise it (and the suite proves it on a CUDA device)
    assert registry.experts_spec("triton").cuda_graphs


@pytest.fixture
def cpu_processor(model_dir):
    """transformers' own batch processor, made on CPU, its runner set as CUDA graphs set it
    (padding on, both paths graphed) so its choices can be read without a GPU."""
    engine = Engine(load_for_serving(model_dir, dtype="float32", progress=False),
                    max_batch_size=4, max_model_len=600, cuda_graphs=False)
    engine.start()
    try:
        processor = engine._manager.batch_processor
        runner = getattr(processor, "model_runner", None)
        needed = ("maybe_pad_inputs", "_get_forward_fn", "use_cuda_graph_varlen",
                  "use_cuda_graph_decode", "pad_inputs")
        if runner is None or not all(hasattr(runner, n) for n in needed):
            pytest.skip("this transformers' runner lacks " + ", ".join(
                n for n in needed if not hasattr(runner, n)))
        runner.pad_inputs = True
        runner.use_cuda_graph_varlen = runner.use_cuda_graph_decode = True
        runner.cb_config.q_padding_interval_size = DECODE_PADDING  # as the engine sets it
        yield processor
    finally:
        engine.shutdown()


def _step(processor, *groups):
    """Fill ``processor``'s inputs as transformers does for a varlen step of ``groups``
    ((requests, status, query tokens each, cached tokens each)); returns whether it is graphed
    and the padded query tokens."""
    from transformers.generation.continuous_batching.requests import RequestStatus
    from transformers.generation.continuous_batching.utils import create_warmup_future_states

    runner, io = processor.model_runner, processor.inputs_and_outputs
    states = []
    for n, status, q, kv in groups:
        made = create_warmup_future_states(n, getattr(RequestStatus, status), q, kv, runner.cache)
        assert len(made) == n
        states += made
    try:
        q_tokens = sum(s.query_length for s in states)
        kv_read = max(s.state.position_offset for s in states)
        padded_q, padded_kv = runner.maybe_pad_inputs(q_tokens, kv_read, False)
        io.prepare_batch_tensors(states, processor.model_runner.logit_processor, False,
                                 padded_q, padded_kv, use_padding=True)
        return runner._get_forward_fn(io.use_block_table)[1], padded_q
    finally:
        for s in states:
            runner.cache.free_blocks(s.state.request_id)


def test_policy_off_graphs_decode_steps_only(cpu_processor):
    """Prefill graphing off (the default): exactly the steps of one token per request replay
    graphs, and the query padding stays transformers' (multiples of 8)."""
    policy = _GraphPolicy.install(cpu_processor, prefill=False)
    assert policy is not None and not policy.prefill
    assert _step(cpu_processor, (3, "DECODING", 1, 20)) == (True, 8)
    assert _step(cpu_processor, (1, "PREFILLING", 40, 0)) == (False, 40)
    assert _step(cpu_processor, (3, "DECODING", 1, 20), (1, "PREFILLING", 300, 0)) == (False, 304)


def test_policy_on_graphs_prefill_steps_in_query_buckets(cpu_processor):
    policy = _GraphPolicy.install(cpu_processor, prefill=True)
    assert bucket_prefill_queries(cpu_processor, cap=512, dense_up_to=4)
    assert _step(cpu_processor, (3, "DECODING", 1, 20)) == (True, 8)  # as with the flag off
    assert _step(cpu_processor, (1, "PREFILLING", 40, 0)) == (True, 64)
    assert _step(cpu_processor, (3, "DECODING", 1, 20), (1, "PREFILLING", 300, 0)) == (True, 512)
    assert _step(cpu_processor, (2, "PREFILLING", 5, 0)) == (True, 16)
    # the decode fast path is transformers' own (no KV read, powers of two)
    runner = cpu_processor.model_runner
    assert runner.maybe_pad_inputs(3, 0, True)[0] == 4
    policy.prefill = False  # a capture failed at warm-up: back to eager for prefill steps
    assert _step(cpu_processor, (1, "PREFILLING", 40, 0))[0] is False


def test_a_failed_prefill_capture_sends_prefill_back_to_eager(cpu_processor):
    """A prefill step whose capture fails after transformers' eager run of it (which computes
    its outputs) is served, and the policy runs later prefill steps eagerly rather than
    failing each one (transformers 5.17 stops the batching loop on an error there); decode
    steps keep their graphs."""
    runner = cpu_processor.model_runner
    ran = []

    def capture_fails(forward_fn, stream, *args):  # transformers' order: eager run, capture
        forward_fn(*args)
        raise RuntimeError("operation not permitted when stream is capturing")

    def step(*args):
        ran.append(args)

    runner._capture_graph = capture_fails
    policy = _GraphPolicy.install(cpu_processor, prefill=True)
    assert _step(cpu_processor, (1, "PREFILLING", 40, 0))[0] is True
    assert runner._capture_graph(step, None, "prefill") is None  # served from the eager run
    assert ran == [("prefill",)]
    assert not policy.prefill and policy.decode and not policy.decode_failed
    assert policy.capture_failures == ["RuntimeError: operation not permitted when stream is "
                                       "capturing"]
    assert _step(cpu_processor, (1, "PREFILLING", 40, 0))[0] is False
    assert _step(cpu_processor, (3, "DECODING", 1, 20))[0] is True


@pytest.mark.parametrize("prefill", [True, False])
def test_a_failed_decode_capture_is_served_and_turns_every_graph_off(cpu_processor, prefill):
    """A decode step whose capture fails is served from transformers' eager run of it, and
    from then on no step replays or captures a graph (a decode batch that cannot be captured
    would fail again at every size); with prefill graphing off as well as on."""
    runner = cpu_processor.model_runner
    ran = []

    def capture_fails(forward_fn, stream, *args):
        forward_fn(*args)
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    runner._capture_graph = capture_fails
    policy = _GraphPolicy.install(cpu_processor, prefill=prefill)
    assert _step(cpu_processor, (3, "DECODING", 1, 20))[0] is True
    assert runner._capture_graph(lambda *a: ran.append(a), None, "decode") is None
    assert ran == [("decode",)]
    assert not policy.decode and not policy.prefill
    assert "previous error during capture" in policy.decode_failed
    assert _step(cpu_processor, (3, "DECODING", 1, 20))[0] is False
    assert _step(cpu_processor, (1, "PREFILLING", 40, 0))[0] is False


def test_graphs_report_a_failed_decode_capture():
    """The batching description says graphs are off and why when a decode capture failed."""
    from moe_runtime.serve.batching import CONTINUOUS, choose_cuda_graphs

    choice = choose_cuda_graphs("cuda", CONTINUOUS, 64, "max_batch_size",
                                failed="RuntimeError: boom")
    assert not choice.on
    assert "capturing a decode step failed at warm-up (RuntimeError: boom)" in choice.reason


def test_a_prefill_step_that_fails_before_its_eager_run_completes_raises(cpu_processor):
    runner = cpu_processor.model_runner

    def step(*args):
        raise ValueError("the forward itself failed")

    runner._capture_graph = lambda forward_fn, stream, *args: forward_fn(*args)
    policy = _GraphPolicy.install(cpu_processor, prefill=True)
    _step(cpu_processor, (1, "PREFILLING", 40, 0))
    with pytest.raises(ValueError, match="the forward itself failed"):
        runner._capture_graph(step, None)
    assert not policy.prefill and policy.capture_failures


def test_captures_are_counted_apart_at_warm_up_and_while_serving(cpu_processor, caplog):
    """Every successful capture is counted with its time, at warm-up and (once the engine set
    ``serving``) while serving, where each one is logged with the step's shape: a shape that
    warm-up did not reach stalls its batch once, and the server's log says so. A failed
    capture is not counted as a graph."""
    runner = cpu_processor.model_runner

    def capture(forward_fn, stream, *args):
        forward_fn(*args)
        return "graph"

    runner._capture_graph = capture
    policy = _GraphPolicy.install(cpu_processor, prefill=True)
    _step(cpu_processor, (3, "DECODING", 1, 20))
    assert runner._capture_graph(lambda *a: None, None) == "graph"
    assert policy.captures == {"warmup": 1, "serving": 0}
    policy.serving = True
    _step(cpu_processor, (1, "PREFILLING", 40, 0))
    with caplog.at_level(logging.INFO, logger="moe_runtime.serve"):
        assert runner._capture_graph(lambda *a: time.sleep(0.02), None) == "graph"
    assert policy.captures == {"warmup": 1, "serving": 1}
    assert policy.capture_seconds["serving"] >= 0.02
    line = next(r.getMessage() for r in caplog.records if "first seen while serving" in r.getMessage())
    assert "prefill step shape" in line and "1 captured while serving" in line

    def capture_fails(forward_fn, stream, *args):
        forward_fn(*args)
        raise RuntimeError("capture failed")

    runner._capture_graph = capture_fails
    policy = _GraphPolicy.install(cpu_processor, prefill=True)
    policy.serving = True
    _step(cpu_processor, (1, "PREFILLING", 40, 0))
    assert runner._capture_graph(lambda *a: None, None) is None
    assert policy.captures == {"warmup": 0, "serving": 0}
