"""Continuous batching with CUDA graphs: the choice, and (on a GPU) the same greedy tokens as eager."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from moe_runtime.serve.batching import (
    ASYNC_ENV,
    CONTINUOUS,
    DYNAMIC,
    choose_cuda_graphs,
    choose_overlap,
    plan_token_bound,
)
from moe_runtime.serve.sampling import SamplingParams


def test_graphs_stay_off_on_a_cpu_and_say_why():
    off = choose_cuda_graphs("cpu", CONTINUOUS, 8, "max_batch_size")
    assert not off.on and "runs on cpu" in off.describe()
    assert not choose_cuda_graphs("cuda:0", DYNAMIC, 8, "max_batch_size").on
    assert not choose_cuda_graphs("cuda:0", CONTINUOUS, 8, "x", requested=False).on
    on = choose_cuda_graphs("cuda:0", CONTINUOUS, 8, "the plan's deployment max_tokens_per_rank")
    assert on.on and on.max_tokens == 8 and "at most 8 tokens" in on.describe()


def test_overlap_is_opt_in_and_only_for_continuous_batching_on_cuda(monkeypatch):
    monkeypatch.delenv(ASYNC_ENV, raising=False)
    default = choose_overlap("cuda:0", CONTINUOUS)  # opt-in: its measured gain was mixed
    assert not default.on and f"{ASYNC_ENV}=1" in default.describe()
    on = choose_overlap("cuda:0", CONTINUOUS, requested=True)
    assert on.on and "launched while the current one runs" in on.describe()
    monkeypatch.setenv(ASYNC_ENV, "1")
    assert choose_overlap("cuda:0", CONTINUOUS).on
    cpu = choose_overlap("cpu", CONTINUOUS, requested=True)
    assert not cpu.on and "runs on cpu" in cpu.describe()
    assert not choose_overlap("cuda:0", DYNAMIC).on
    off = choose_overlap("cuda:0", CONTINUOUS, requested=False)
    assert not off.on and "async_batching=False" in off.describe()
    monkeypatch.setenv(ASYNC_ENV, "0")
    env_off = choose_overlap("cuda:0", CONTINUOUS)
    assert not env_off.on and f"{ASYNC_ENV}=0" in env_off.describe()
    assert choose_overlap("cuda:0", CONTINUOUS, requested=True).on  # the argument wins
    monkeypatch.setenv(ASYNC_ENV, "yes")
    with pytest.raises(ValueError, match=f"{ASYNC_ENV}='yes': expected 1"):
        choose_overlap("cuda:0", CONTINUOUS)


def test_the_token_bound_is_the_smallest_the_plan_declares():
    plan = {"deployment": {"max_tokens_per_rank": 4096},
            "layers": [{"layer": "model.layers.0.mlp", "communication": "deepep",
                        "modes": [{"max_tokens_per_rank": 128}, {"max_tokens_per_rank": 1024}]},
                       {"layer": "model.layers.1.mlp", "communication": "local",
                        "modes": [{"max_tokens_per_rank": None}]}]}
    assert plan_token_bound(plan) == (1024, "layer model.layers.0.mlp's deepep modes")
    assert plan_token_bound({"deployment": {"max_tokens_per_rank": 64}, "layers": []})[0] == 64
    assert plan_token_bound(None)[0] is None
    assert plan_token_bound({"layers": []})[0] is None


def test_an_engine_on_a_cpu_reports_graphs_off(model_dir):
    from moe_runtime.serve.engine import Engine
    from moe_runtime.serve.loading import load_for_serving

    loaded = load_for_serving(model_dir, dtype="float32", progress=False)
    engine = Engine(loaded, max_batch_size=4)
    assert "CUDA graphs off: the model runs on cpu" in engine.batching.describe()
    assert "host/device overlap off: the model runs on cpu" in engine.batching.describe()
    assert not engine.sampler.static
    # a bound below the batch caps both the decode batch and the prefill chunk
    capped = Engine(loaded, max_batch_size=8, max_tokens_per_forward=4)
    assert (capped.batch_cap, capped.max_batch_tokens, capped.sampler.max_batch) == (4, 4, 4)


# ------------------------------------------------------------------------------------ on a GPU

def _gpu_model(tmp: Path) -> Path:
    """The embedded default recipe, NVFP4 experts where nvidia-modelopt can export them (else bf16):
    ``MOE_RUNTIME_GRAPH_MODEL`` may name a checkpoint made elsewhere."""
    given = os.environ.get("MOE_RUNTIME_GRAPH_MODEL")
    if given:
        return Path(given)
    from moe_runtime.serve.default_model import make_default_model

    try:
        import modelopt.torch.export  # noqa: F401
        quant = "w4a16_nvfp4"
    except ImportError:
        quant = "bf16"
    return make_default_model(tmp / quant, quant=quant)


def _captured(engine) -> set:
    """The padded shapes transformers captured graphs for (both IO pairs when overlapped)."""
    io = engine._manager.batch_processor.inputs_and_outputs
    stores = [p.device_io for p in io.io_pairs] if hasattr(io, "io_pairs") else [io]
    return {key for store in stores for key in store.graphs._storage}


async def _greedy_batch(engine, prompts, max_tokens):
    greedy = SamplingParams(temperature=0.0)
    results = await asyncio.gather(*[engine.complete(p, max_tokens=max_tokens, sampling=greedy)
                                     for p in prompts])
    return [r.token_ids for r in results]


async def _seeded(engine, prompts, max_tokens):
    """Request 0 sampled with a fixed seed, the others greedy or with their own seeds."""
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1234)] + [
        SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=0.8, seed=i)
        for i in range(1, len(prompts))]
    results = await asyncio.gather(*[engine.complete(p, max_tokens=max_tokens, sampling=s)
                                     for p, s in zip(prompts, params, strict=True)])
    return [r.token_ids for r in results]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graphs are "
                                                            "captured only there)")
def test_gpu_graph_replayed_decode_gives_the_eager_greedy_tokens(tmp_path):
    from moe_runtime.serve.engine import Engine
    from moe_runtime.serve.loading import load_for_serving

    # float32: a padded graph batch and an unpadded eager one then round alike (in bf16 the
    # GEMMs of the two shapes differ in their last bits, enough to flip a near-tie argmax)
    loaded = load_for_serving(_gpu_model(tmp_path), device="cuda", dtype="float32",
                              progress=False)
    tokens = {}
    for graphs in (False, None):
        # prefill graphed is the default: off here, so that only decode shapes are captured
        engine = Engine(loaded, max_batch_size=8, max_model_len=256, cuda_graphs=graphs,
                        batching="continuous", graph_prefill=False)
        assert engine.batching.graphs.on is (graphs is None), engine.batching.describe()
        assert not engine.batching.graphs.prefill, engine.batching.describe()
        engine.start()
        try:
            prompts = [engine.encode_prompt(f"request {i}: once upon a time") for i in range(6)]
            tokens[graphs] = asyncio.run(_greedy_batch(engine, prompts, 24))
            # a seeded request draws the same tokens alone and batched, graphs or not
            tokens[graphs, "alone"] = asyncio.run(_seeded(engine, prompts[:1], 24))[0]
            tokens[graphs, "batched"] = asyncio.run(_seeded(engine, prompts, 24))[0]
            if graphs is None:  # transformers keeps its captured graphs by padded shape
                captured = _captured(engine)
                assert captured, "no graph was captured"
                # decode batches only (6 requests, padded to 8): no prefill shape was captured
                assert all(key[0] <= 8 for key in captured), sorted(captured)
        finally:
            engine.shutdown()
    assert all(len(t) == 24 for t in tokens[False])
    assert tokens[None] == tokens[False]
    assert tokens[False, "alone"] == tokens[False, "batched"] == tokens[None, "batched"] \
        == tokens[None, "alone"]


async def _stopping(engine, prompt, max_tokens):
    """Greedy tokens EOS ignored; then a stop token from them, and min_tokens holding it off,
    in one batch with sampled requests (so the graph runs every sampler stage)."""
    plain = await engine.complete(prompt, max_tokens=max_tokens,
                                  sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    ids = list(plain.token_ids)
    stop = next(t for k, t in enumerate(ids) if k >= 2 and t not in ids[:k])
    at = ids.index(stop)
    runs = [engine.complete(prompt, max_tokens=max_tokens, ignore_eos=True,
                            stop_token_ids=[stop], sampling=SamplingParams(temperature=0.0)),
            engine.complete(prompt, max_tokens=max_tokens, ignore_eos=True,
                            stop_token_ids=[stop], sampling=SamplingParams(
                                temperature=0.0, min_tokens=at + 4)),
            *[engine.complete(prompt, max_tokens=max_tokens, ignore_eos=True,
                              sampling=SamplingParams(temperature=0.9, seed=s))
              for s in range(3)]]
    cut, held, *_ = await asyncio.gather(*runs)
    assert list(cut.token_ids) == ids[:at + 1] and cut.finish_reason == "stop"
    assert stop not in held.token_ids[:at + 4] and len(held.token_ids) >= at + 4
    return ids, list(held.token_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graphs are "
                                                            "captured only there)")
def test_gpu_graph_replayed_decode_honours_stop_tokens_and_min_tokens(tmp_path):
    from moe_runtime.serve.engine import Engine
    from moe_runtime.serve.loading import load_for_serving

    loaded = load_for_serving(_gpu_model(tmp_path), device="cuda", dtype="float32",
                              progress=False)
    got = {}
    for graphs in (False, None):
        engine = Engine(loaded, max_batch_size=8, max_model_len=256, cuda_graphs=graphs,
                        batching="continuous")
        assert engine.batching.graphs.on is (graphs is None), engine.batching.describe()
        engine.start()
        try:
            got[graphs] = asyncio.run(_stopping(engine, engine.encode_prompt("Once upon"), 24))
        finally:
            engine.shutdown()
    assert got[None] == got[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graphs are "
                                                            "captured only there)")
def test_gpu_graph_replayed_prefill_gives_the_eager_greedy_tokens(tmp_path):
    """Graphed prefill (the default; MOE_RUNTIME_GRAPH_PREFILL=0 turns it off), asked for
    explicitly here: prompts of mixed lengths, prefilled in graphed steps
    (query tokens padded to buckets), give eager's greedy float32 tokens; a second identical
    batch replays the graphs the first captured."""
    from moe_runtime.serve.engine import Engine
    from moe_runtime.serve.loading import load_for_serving

    loaded = load_for_serving(_gpu_model(tmp_path), device="cuda", dtype="float32",
                              progress=False)
    words = "the quick brown fox jumps over a lazy dog while it rains".split()
    tokens = {}
    for graphs, prefill in ((False, False), (None, True)):
        engine = Engine(loaded, max_batch_size=8, max_model_len=256, cuda_graphs=graphs,
                        batching="continuous", graph_prefill=prefill)
        assert engine.batching.graphs.prefill is prefill, engine.batching.describe()
        engine.start()
        try:
            prompts = [engine.encode_prompt(" ".join(words[:1 + (7 * i) % len(words)] * (1 + i)))
                       for i in range(7)]
            assert len({len(p) for p in prompts}) >= 5, [len(p) for p in prompts]
            tokens[prefill] = asyncio.run(_greedy_batch(engine, prompts, 16))
            if prefill:
                captured = _captured(engine)
                # more query tokens than the decode batch (8): a prefill step was graphed
                assert any(key[0] > 8 for key in captured), sorted(captured)
                assert engine.batching.graphs.prefill, "prefill graphing fell back to eager"
                tokens["again"] = asyncio.run(_greedy_batch(engine, prompts, 16))
                assert tokens["again"] == tokens[prefill]
                alone = [asyncio.run(_greedy_batch(engine, [p], 16))[0] for p in prompts[:3]]
                assert alone == tokens[prefill][:3]
        finally:
            engine.shutdown()
    assert all(len(t) == 16 for t in tokens[False])
    assert tokens[True] == tokens[False]


def test_prefill_graphing_is_read_from_the_environment(model_dir, monkeypatch):
    from moe_runtime.serve.engine import Engine
    from moe_runtime.serve.graph_shapes import PREFILL_ENV
    from moe_runtime.serve.loading import load_for_serving

    loaded = load_for_serving(model_dir, dtype="float32", progress=False)
    monkeypatch.setenv(PREFILL_ENV, "on")
    with pytest.raises(ValueError, match=PREFILL_ENV):
        Engine(loaded, max_batch_size=4)
    # unset (prefill graphed by default) and 1 alike: on a CPU nothing is graphed, prefill or not,
    # and the reason given is the device, not the variable
    for value in (None, "1", "0"):
        if value is None:
            monkeypatch.delenv(PREFILL_ENV, raising=False)
        else:
            monkeypatch.setenv(PREFILL_ENV, value)
        graphs = Engine(loaded, max_batch_size=4).batching.graphs
        assert not graphs.on and not graphs.prefill and graphs.max_graphs is None
        assert graphs.describe() == ("CUDA graphs off: the model runs on cpu; CUDA graphs need a "
                                     "CUDA device"), graphs.describe()
    assert Engine(loaded, max_batch_size=4, graph_prefill=False).batching.graphs.prefill is False
    monkeypatch.delenv(PREFILL_ENV, raising=False)
    assert Engine(loaded, max_batch_size=4, graph_prefill=True).batching.graphs.prefill is False


async def _with_logprobs(engine, prompts, max_tokens):
    """Greedy and seeded requests in one batch, each asking for log-probabilities."""
    params = [SamplingParams(temperature=0.0, logprobs=3) if i % 2 else
              SamplingParams(temperature=0.9, top_p=0.95, seed=40 + i, logprobs=2)
              for i in range(len(prompts))]
    results = await asyncio.gather(*[engine.complete(p, max_tokens=max_tokens, sampling=s)
                                     for p, s in zip(prompts, params, strict=True)])
    return [(list(r.token_ids), [(lp.token, round(lp.logprob, 4), tuple(t for t, _ in lp.top))
                                 for lp in r.logprobs]) for r in results]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (overlapped "
                                                            "batching runs on CUDA streams)")
def test_gpu_overlapped_steps_give_the_one_at_a_time_tokens_and_logprobs(tmp_path):
    """Asynchronous batching launches step N+1 before step N's tokens reach the host: the tokens,
    seeded draws and log-probabilities must be those of one step at a time, graphs on."""
    from moe_runtime.serve.engine import Engine
    from moe_runtime.serve.loading import load_for_serving

    loaded = load_for_serving(_gpu_model(tmp_path), device="cuda", dtype="float32",
                              progress=False)
    got = {}
    for overlap in (False, True):
        engine = Engine(loaded, max_batch_size=8, max_model_len=256, batching="continuous",
                        async_batching=overlap)
        assert engine.batching.overlap.on is overlap, engine.batching.describe()
        assert engine.batching.graphs.on, engine.batching.describe()
        engine.start()
        try:
            prompts = [engine.encode_prompt(f"request {i}: in a land far away") for i in range(6)]
            got[overlap] = (asyncio.run(_greedy_batch(engine, prompts, 20)),
                            asyncio.run(_with_logprobs(engine, prompts, 20)),
                            asyncio.run(_seeded(engine, prompts, 20)))
            if overlap:
                io = engine._manager.batch_processor.inputs_and_outputs
                assert hasattr(io, "io_pairs"), type(io).__name__
                assert _captured(engine), "no graph was captured"
        finally:
            engine.shutdown()
    greedy, logprobs, seeded = got[True]
    assert all(len(t) == 20 for t in greedy)
    assert greedy == got[False][0]
    assert all(len(records) == 20 for _, records in logprobs)
    assert logprobs == got[False][1]
    assert seeded == got[False][2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graphs are "
                                                            "captured only there)")
def test_gpu_grouped_query_attention_gives_transformers_greedy_tokens_graph_replayed(tmp_path):
    """moe_runtime/serve/paged_attention.py under CUDA graphs (decode and prefill graphed):
    float32 greedy tokens equal those of transformers' paged|sdpa, and decode steps took it."""
    from moe_runtime.serve import paged_attention
    from moe_runtime.serve.engine import Engine
    from moe_runtime.serve.loading import load_for_serving

    loaded = load_for_serving(_gpu_model(tmp_path), device="cuda", dtype="float32",
                              progress=False)
    tokens = {}
    for gqa in (False, True):
        before = paged_attention.calls()["gqa"]
        engine = Engine(loaded, max_batch_size=8, max_model_len=256, batching="continuous",
                        gqa_attention=gqa)
        assert engine.batching.graphs.on, engine.batching.describe()
        engine.start()
        try:
            prompts = [engine.encode_prompt(f"request {i}: once upon a time" * (1 + i % 3))
                       for i in range(6)]
            tokens[gqa] = asyncio.run(_greedy_batch(engine, prompts, 24))
            tokens[gqa, "seeded"] = asyncio.run(_seeded(engine, prompts, 24))
        finally:
            engine.shutdown()
        # graph capture runs the Python function once per captured shape: it was taken
        assert (paged_attention.calls()["gqa"] > before) is gqa
    assert all(len(t) == 24 for t in tokens[False])
    assert tokens[True] == tokens[False]
    assert tokens[True, "seeded"] == tokens[False, "seeded"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graphs are "
                                                            "captured only there)")
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_gpu_a_failed_capture_leaves_the_engine_and_the_process_serving(tmp_path, caplog, kind):
    """A step whose capture fails (here: the model synchronizes with the host while a step of
    that kind is captured) is served from transformers' eager run, later steps of that kind
    (every step, for decode) run eagerly with eager's greedy tokens, and the process is left
    usable: CUDA random draws work and the next engine captures and serves (on 2026-12-07 one
    invalidated capture made every later capture and CUDA draw of the process fail)."""
    import logging

    from moe_runtime.serve.engine import Engine
    from moe_runtime.serve.loading import load_for_serving

    loaded = load_for_serving(_gpu_model(tmp_path), device="cuda", dtype="float32",
                              progress=False)
    batch = 8
    failed = []

    def sync_while_capturing(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        tokens = ids.shape[-1] if ids is not None else 0
        if torch.cuda.is_current_stream_capturing() and (tokens > batch) == (kind == "prefill"):
            failed.append(tokens)
            torch.cuda.synchronize()  # not allowed during a capture: it invalidates it

    words = "the quick brown fox jumps over a lazy dog while it rains".split()
    tokens = {}
    for graphs in (False, None):
        engine = Engine(loaded, max_batch_size=batch, max_model_len=256, cuda_graphs=graphs,
                        batching="continuous", graph_prefill=True)
        hook = loaded.model.register_forward_pre_hook(sync_while_capturing, with_kwargs=True)
        try:
            with caplog.at_level(logging.WARNING, logger="moe_runtime.serve"):
                engine.start()
                prompts = [engine.encode_prompt(" ".join(words[:1 + (5 * i) % len(words)]
                                                         * (1 + i))) for i in range(6)]
                tokens[graphs] = asyncio.run(_greedy_batch(engine, prompts, 16))
                tokens[graphs, "again"] = asyncio.run(_greedy_batch(engine, prompts, 16))
            assert engine.healthy
        finally:
            hook.remove()
            engine.shutdown()
    assert failed, f"no {kind} step was captured"
    assert f"capturing a {kind} step failed" in caplog.text
    assert all(len(t) == 16 for t in tokens[False])
    assert tokens[None] == tokens[False] == tokens[None, "again"]
    # the process: an eager CUDA draw, then a fresh engine that captures and serves
    assert torch.randint(0, 10, (4,), device="cuda").shape == (4,)
    engine = Engine(loaded, max_batch_size=batch, max_model_len=256, batching="continuous",
                    graph_prefill=False)
    engine.start()
    try:
        again = asyncio.run(_greedy_batch(engine, prompts, 16))
        assert _captured(engine), "the next engine captured no graph"
    finally:
        engine.shutdown()
    assert again == tokens[False]
