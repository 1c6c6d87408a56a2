"""Sampling through the engine on a CPU: a seeded request's tokens, alone and batched, on both paths."""

from __future__ import annotations

import asyncio
import time

import pytest

from moe_runtime.serve.engine import Engine
from moe_runtime.serve.loading import load_for_serving
from moe_runtime.serve.sampling import SamplingParams


@pytest.fixture(scope="module")
def loaded(model_dir):
    # float32: a CPU's bf16 matmuls round differently with the batch's shape
    return load_for_serving(model_dir, dtype="float32", progress=False)


async def _run(engine, jobs, max_tokens=12):
    results = await asyncio.gather(*[engine.complete(p, max_tokens=max_tokens, sampling=s)
                                     for p, s in jobs])
    return [r.token_ids for r in results]


@pytest.mark.parametrize("batching", ["continuous", "dynamic"])
def test_a_seeded_request_draws_alike_alone_and_among_others(loaded, batching):
    engine = Engine(loaded, max_batch_size=4, batching=batching)
    engine.start()
    try:
        prompt = engine.encode_prompt("Once upon a time")
        mine = SamplingParams(temperature=1.0, top_k=50, min_p=0.02, seed=77,
                              presence_penalty=0.3, repetition_penalty=1.2)
        alone = asyncio.run(_run(engine, [(prompt, mine)]))[0]
        others = [(engine.encode_prompt(f"another prompt {i}"),
                   SamplingParams(temperature=0.0) if i % 2 else SamplingParams(seed=i))
                  for i in range(3)]
        batched = asyncio.run(_run(engine, [others[0], (prompt, mine), *others[1:]]))[1]
        other_seed = asyncio.run(_run(engine, [(prompt, SamplingParams(
            temperature=1.0, top_k=50, min_p=0.02, seed=78, presence_penalty=0.3,
            repetition_penalty=1.2))]))[0]
    finally:
        engine.shutdown()
    assert len(alone) == 12
    assert batched == alone
    assert other_seed != alone
    assert engine.sampler.open_slots == 0


def test_dynamic_batching_prefills_within_the_token_bound(loaded, model_dir):
    # the model refuses a forward over its bound: prompts longer than it are prefilled in chunks
    bounded = load_for_serving(model_dir, dtype="float32", progress=False,
                               max_tokens_per_forward=4)
    greedy = SamplingParams(temperature=0.0)
    texts = ["Once upon a time, in a land far away", "A much longer prompt than four tokens"]
    results = {}
    for name, model, bound in (("free", loaded, None), ("bounded", bounded, 4)):
        engine = Engine(model, max_batch_size=2, batching="dynamic", max_tokens_per_forward=bound)
        engine.start()
        try:
            prompts = [engine.encode_prompt(t) for t in texts]
            assert min(len(p) for p in prompts) > 4
            results[name] = asyncio.run(_run(engine, [(p, greedy) for p in prompts], 6))
            scored = asyncio.run(engine.prompt_logprobs(prompts[0], 2))  # echo with logprobs
            results[name + " scored"] = [(r.token, round(r.logprob, 4)) for r in scored[1:]]
        finally:
            engine.shutdown()
    assert results["bounded"] == results["free"]
    assert results["bounded scored"] == results["free scored"]


def test_prompt_scoring_leaves_no_live_entry_and_a_shutdown_abort_ends_it(loaded):
    # each scoring request's entry for abort_all stayed behind after it ended; an abort reaching
    # it raised AttributeError (the abort has no .error) instead of EngineUnavailable
    from moe_runtime.serve.engine import EngineUnavailable

    engine = Engine(loaded, max_batch_size=2, batching="dynamic")
    engine.start()
    try:
        prompt = engine.encode_prompt("Once upon a time")
        for _ in range(3):
            assert len(asyncio.run(engine.prompt_logprobs(prompt, 1))) == len(prompt)
        assert engine._live == {}

        async def aborted():
            task = asyncio.ensure_future(engine.prompt_logprobs(prompt, 1))
            while not engine._live and not task.done():
                await asyncio.sleep(0)
            engine.abort_all("the server is shutting down")
            return await task

        try:
            asyncio.run(aborted())
        except EngineUnavailable as exc:
            assert "shutting down" in str(exc)
        # (a forward that finished before the abort arrived answers normally)
        assert engine._live == {}
    finally:
        engine.shutdown()


@pytest.mark.parametrize("batching", ["continuous", "dynamic"])
def test_finished_requests_free_their_rows_while_the_event_loop_is_busy(loaded, batching):
    # each sampled request holds a sampler row from its first token; the batching thread must not
    # run out of rows when requests finish faster than the event loop closes them
    engine = Engine(loaded, max_batch_size=2, batching=batching)
    engine.start()
    n = engine.sampler.max_slots + 6

    async def main():
        prompt = engine.encode_prompt("Once upon a time")
        tasks = [asyncio.ensure_future(engine.complete(
            prompt, max_tokens=1, sampling=SamplingParams(temperature=1.0, seed=i)))
            for i in range(n)]
        while len(engine._held) + sum(t.done() for t in tasks) < n:
            await asyncio.sleep(0.01)  # until every request is submitted
        time.sleep(5)  # the loop is blocked: no request is closed, the batch runs on
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(main())
        assert engine.healthy
    finally:
        engine.shutdown()
    assert [len(r.token_ids) for r in results] == [1] * n
    assert engine.sampler.open_slots == 0
