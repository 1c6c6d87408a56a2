"""DeepSeek-V3 through the server (dynamic-cache batching) equals transformers' own ``generate``.

As ``test_greedy_equality.py`` does for the default model: a W4A16_NVFP4 ModelOpt export (its
dequantized weights are exactly what the experts compute with), served in float32, against the
same checkpoint in transformers with ModelOpt's weights dequantized into its own experts, run by
``model.generate`` in this process. Requests one at a time and all at once (padded into one batch).
The last test drives the engine in this process: requests that end early leave nothing behind.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig

PROMPTS = ["The quick brown fox", "Hello, world! How are you?", "Numbers 0 1 2 3 4 5",
           "Once upon a time there was a small model"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from moe_runtime.serve.default_model import make_default_model

    return make_default_model(tmp_path_factory.mktemp("ds-w4a16") / "tiny-deepseek",
                              quant="w4a16_nvfp4", arch="deepseek_v3")


@pytest.fixture(scope="module")
def server(model_dir, server_factory):
    proc = server_factory(["--model", str(model_dir)])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server, api_key):
    return openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(model_dir):
    """Greedy tokens of every prompt from transformers' ``generate``, in the server's dtype."""
    from moe_runtime.integration.transformers import load_model

    model = load_model(model_dir, dequantize_experts=True, dtype=torch.float32).model.eval()
    model.generation_config = GenerationConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 pad_token_id=model.generation_config.pad_token_id)
        out[prompt] = gen[0, len(ids):].tolist()
    return out


def _served(client, server, prompt) -> list[int]:
    out = client.completions.create(model=server.model, prompt=prompt, max_tokens=NEW_TOKENS,
                                    temperature=0, extra_body={"return_token_ids": True})
    return out.choices[0].model_extra["token_ids"]


def test_the_server_batches_deepseek_through_the_dynamic_cache(server):
    assert server.lines_with("batching: dynamic-cache batching")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_one_request_equals_generate(client, server, expected, prompt):
    assert _served(client, server, prompt) == expected[prompt]


def test_requests_batched_together_equal_generate(client, server, expected):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        served = list(pool.map(lambda p: _served(client, server, p), PROMPTS))
    assert served == [expected[p] for p in PROMPTS]


@pytest.fixture(scope="module")
def engine(model_dir):
    from moe_runtime.serve.engine import Engine
    from moe_runtime.serve.loading import load_for_serving

    eng = Engine(load_for_serving(model_dir, dtype="float32", progress=False), max_batch_size=3)
    eng.start()
    yield eng
    eng.shutdown()


def _pending(engine) -> dict:
    deadline = time.monotonic() + 5
    while True:
        state = {**engine._manager.pending, "slots": engine.sampler.open_slots}
        if not any(state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def test_cancelled_stopped_and_overflowing_requests_leave_nothing_in_the_cache_batcher(engine):
    from moe_runtime.serve.sampling import SamplingParams

    assert engine.batching.path == "dynamic"
    prompt = engine.encode_prompt("Once upon a time")
    greedy = SamplingParams(temperature=0.0)

    async def run():
        stream = engine.generate(prompt, max_tokens=200, sampling=SamplingParams(seed=1))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()
        full = await engine.complete(prompt, max_tokens=20, sampling=greedy)
        cut = await engine.complete(prompt, max_tokens=20, sampling=greedy, stop=[full.text[3:6]])
        assert cut.finish_reason == "stop" and len(cut.token_ids) < 20
        task = asyncio.ensure_future(engine.complete(prompt, max_tokens=200,
                                                     sampling=SamplingParams(seed=2)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # more requests than the batch holds (3): all finish, with their own budgets
        many = await asyncio.gather(*[
            engine.complete(engine.encode_prompt(f"request {i}"), max_tokens=2 + i % 4,
                            sampling=SamplingParams(seed=i)) for i in range(7)])
        for i, r in enumerate(many):
            assert 0 < len(r.token_ids) <= 2 + i % 4

    asyncio.run(run())
    assert _pending(engine) == {"running": 0, "queued": 0, "handlers": 0, "cancelled": 0,
                                "live": 0, "slots": 0}
    assert engine.healthy
