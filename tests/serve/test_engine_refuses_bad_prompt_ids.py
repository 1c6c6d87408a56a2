"""No request can hand the batching thread a prompt it cannot take: one that did (a chat
template call returning nested lists, audit of 2026-12-07) stopped transformers' continuous
batching, and every later request of every client was answered 503."""

from __future__ import annotations

import asyncio

import pytest
from starlette.testclient import TestClient

from moe_runtime.serve.app import create_app
from moe_runtime.serve.engine import Engine, EngineError, prompt_ids_problem
from moe_runtime.serve.loading import load_for_serving
from moe_runtime.serve.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from moe_runtime.serve.default_model import make_default_model

    folder = make_default_model(tmp_path_factory.mktemp("ids") / "tiny")
    engine = Engine(load_for_serving(folder, dtype="float32", progress=False), max_batch_size=2)
    engine.start()
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("ids, said", [
    ([[1, 2], [3]], "not a flat list of token ids: item 0 is a list"),
    ([], "empty"),
    ([1, True], "item 1 is a bool"),
    ([1, 2.0], "item 1 is a float"),
    ([1, -3], "token id -3 at 1, outside the vocabulary"),
    ("12", "a str, not a list"),
    ({"input_ids": [1]}, "a dict, not a list"),
])
def test_prompt_ids_problem_names_what_is_wrong(ids, said):
    problem = prompt_ids_problem(ids, 512)
    assert problem is not None and said in problem
    assert prompt_ids_problem([0, 5, 511], 512) is None
    assert "token id 512 at 0" in prompt_ids_problem([512], 512)


def test_generate_refuses_a_bad_prompt_and_the_engine_serves_on(engine):
    async def run(ids):
        return await engine.complete(ids, max_tokens=2, sampling=SamplingParams(temperature=0))

    with pytest.raises(EngineError, match="not a flat list of token ids"):
        asyncio.run(run([[1, 2], [3]]))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        asyncio.run(run([10**6]))
    assert engine.healthy
    assert len(asyncio.run(run([1, 2, 3])).token_ids) == 2


def test_a_chat_template_returning_nested_ids_is_a_400_and_the_engine_serves_on(engine,
                                                                               monkeypatch):
    original = engine.tokenizer.apply_chat_template

    def overflowing(*args, **kwargs):  # what return_overflowing_tokens made of its output
        ids = original(*args, **kwargs)
        return [list(ids), list(ids)[:2]]

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with TestClient(create_app(engine, manage_engine=False)) as http:
        monkeypatch.setattr(engine.tokenizer, "apply_chat_template", overflowing)
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        assert "chat template call returned not a flat list of token ids" in r.json()["error"][
            "message"]
        monkeypatch.setattr(engine.tokenizer, "apply_chat_template", original)
        assert http.get("/health").json() == {"status": "ok"}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_text_prompt_encoded_past_the_vocabulary_is_the_clients_400(engine, monkeypatch):
    """A tokenizer with ids beyond the model's rows (a text prompt's fault, not the server's):
    400 invalid_prompt naming the id, streamed or not, and the engine serves on."""
    with TestClient(create_app(engine, manage_engine=False)) as http:
        monkeypatch.setattr(engine, "encode_prompt", lambda text, **kw: [1, 10**6])
        body = {"prompt": "hi", "max_tokens": 2}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_prompt" and err["param"] == "prompt"
        assert "token id 1000000 at 1, outside the vocabulary" in err["message"]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert '"invalid_prompt"' in events[-1]
        monkeypatch.undo()
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
