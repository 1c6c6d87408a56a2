"""DeepSeek-V3 through the server (dynamic-cache batching) equals transformers' own ``generate``.

As ``test_greedy_equality.py`` does for the default model: a W4A16_NVFP4 ModelOpt export (its
dequantized weights are exactly what the experts compute with), served in float32, against the
same checkpoint in transformers with ModelOpt's weights dequantized into its own experts, run by
``model.generate`` in this process. Requests one at a time and all at once (padded into one batch).
"""

from __future__ import annotations

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
