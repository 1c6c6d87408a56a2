"""The engine in this process: requests that end early leave nothing behind in the batcher."""

from __future__ import annotations

import asyncio
import time

import pytest

from moe_runtime.serve.engine import Engine
from moe_runtime.serve.loading import load_for_serving
from moe_runtime.serve.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = Engine(load_for_serving(model_dir, dtype="float32", progress=False), max_batch_size=4)
    eng.start()
    yield eng
    eng.shutdown()


def _leftovers(engine) -> dict:
    manager = engine._manager
    deadline = time.monotonic() + 5
    while True:
        scheduler = manager.batch_processor.scheduler
        state = {
            "active": len(scheduler.active_requests),
            "waiting": len(scheduler.waiting_requests),
            "handlers": len(manager.output_router.result_handlers),
            "slots": engine.sampler.open_slots,
        }
        if not any(state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def test_cancelled_and_stopped_requests_leave_nothing_behind(engine):
    prompt = engine.encode_prompt("Once upon a time")

    async def run():
        # one client leaves after two deltas
        stream = engine.generate(prompt, max_tokens=500, sampling=SamplingParams(seed=1))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()
        # one request ends on a stop string
        greedy = SamplingParams(temperature=0.0)
        full = await engine.complete(prompt, max_tokens=30, sampling=greedy)
        cut = await engine.complete(prompt, max_tokens=30, sampling=greedy, stop=[full.text[4:7]])
        assert cut.finish_reason == "stop" and len(cut.token_ids) < 30
        # and one task is cancelled outright, as a dropped HTTP connection is
        task = asyncio.ensure_future(engine.complete(prompt, max_tokens=500,
                                                     sampling=SamplingParams(seed=2)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert _leftovers(engine) == {"active": 0, "waiting": 0, "handlers": 0, "slots": 0}
    assert engine._manager.output_router.output_queue.qsize() <= 1
    assert engine.healthy


def test_more_requests_than_the_batch_holds_all_finish(engine):
    prompts = [engine.encode_prompt(f"request number {i}") for i in range(10)]

    async def run():
        return await asyncio.gather(*[
            engine.complete(p, max_tokens=6, sampling=SamplingParams(seed=i))
            for i, p in enumerate(prompts)])

    results = asyncio.run(run())
    for r in results:
        assert 0 < len(r.token_ids) <= 6
        assert r.finish_reason == "stop" or len(r.token_ids) == 6
    assert _leftovers(engine)["active"] == 0
