"""Sampling through the engine on a CPU: a seeded request's tokens, alone and batched, on both paths."""

from __future__ import annotations

import asyncio

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
