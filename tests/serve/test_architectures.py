"""Every family the architecture table marks as served is served end to end.

Per family: a tiny ModelOpt export with tokenizer files (the default model's recipe in that
architecture), a real ``moe-runtime serve`` process on loopback, and the official ``openai`` client
completing and streaming. The families are read from the table, so a family marked as served
without a tiny maker or a working server fails here.
"""

from __future__ import annotations

import openai
import pytest

from moe_runtime.checkpoint.architectures import served_families
from moe_runtime.checkpoint.tiny import ARCHS

TINY = {name: key for key, name in ARCHS.items()}
# One export per family, spread over ModelOpt's formats (DeepSeek-V3 as in issue 18: MIXED).
QUANT = {"qwen3_moe": "nvfp4", "qwen2_moe": "fp8", "mixtral": "nvfp4", "deepseek_v3": "mixed"}
SERVED = [name for names in served_families().values() for name in names]


def test_every_served_architecture_has_a_tiny_export():
    assert SERVED, "the table serves no family"
    assert [n for n in SERVED if n not in TINY] == []


@pytest.fixture(scope="module", params=SERVED)
def served(request, tmp_path_factory, server_factory, api_key):
    from moe_runtime.serve.default_model import make_default_model

    arch = TINY[request.param]
    folder = make_default_model(tmp_path_factory.mktemp(arch) / f"tiny-{arch}",
                                quant=QUANT[arch], arch=arch)
    server = server_factory(["--model", str(folder)])
    client = openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=120)
    yield request.param, server, client
    server.stop()  # one family's server at a time


def test_the_family_completes_and_streams_through_the_openai_client(served):
    name, server, client = served
    whole = client.completions.create(model=server.model, prompt="The quick brown fox",
                                      max_tokens=6, temperature=0)
    assert whole.usage.completion_tokens > 0 and whole.choices[0].finish_reason in ("length",
                                                                                    "stop")
    chunks = list(client.completions.create(model=server.model, prompt="The quick brown fox",
                                            max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    chat = list(client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
        temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason in ("length", "stop")


def test_start_up_reports_the_batching_path_chosen_from_the_config(served):
    name, server, _ = served
    [line] = server.lines_with("batching: ")
    assert name in line
    # MLA writes keys and values of different head sizes, which the paged cache cannot hold
    if name == "DeepseekV3ForCausalLM":
        assert "dynamic-cache batching" in line and "keys of 4 heads x 32 and values" in line
    else:
        assert "continuous batching" in line
    assert server.lines_with("ready: the first token took")
