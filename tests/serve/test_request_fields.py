"""Every request field is implemented, accepted where it changes nothing, refused at a value this
server does not implement (a 400 naming the field, the value and what is accepted), or unknown (a
400 naming it, with the field meant when it looks like a typo): none is dropped without a word."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from moe_runtime.serve.protocol import UNSUPPORTED


def _post(http, path: str, **body):
    base = ({"prompt": "hello"} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hello"}]})
    return http.post(path, json={"max_tokens": 2, "temperature": 0, **base, **body})


def _error(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize("path, field, value, words", [
    ("/v1/completions", "use_beam_search", True, "beam search"),
    ("/v1/completions", "logit_bias", {"5": 1.0}, "bias"),
    ("/v1/completions", "guided_json", {"type": "object"}, "constrained decoding"),
    ("/v1/completions", "prompt_logprobs", 1, "echo and logprobs"),
    ("/v1/completions", "length_penalty", 0.5, "beam search"),
    ("/v1/completions", "priority", 3, "first come"),
    ("/v1/completions", "spaces_between_special_tokens", False, "true"),
    ("/v1/completions", "best_of", 3, "n (1)"),
    ("/v1/completions", "suffix", "tail", "fill in the middle"),
    ("/v1/completions", "response_format", {"type": "json_object"}, "'text'"),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}],
     "tool calling"),
    ("/v1/chat/completions", "tool_choice", "required", "'none' or 'auto'"),
    ("/v1/chat/completions", "reasoning_effort", "low", "chat_template_kwargs"),
    ("/v1/chat/completions", "echo", True, "/v1/completions echoes"),
    ("/v1/chat/completions", "modalities", ["text", "audio"], "text only"),
    ("/v1/chat/completions", "store", True, "stores no completions"),
    ("/v1/chat/completions", "add_special_tokens", True, "chat template"),
])
def test_an_unimplemented_value_is_a_400_naming_field_value_and_what_is_accepted(
        http, path, field, value, words):
    err = _error(_post(http, path, **{field: value}))
    assert err["param"] == field
    assert field in err["message"] and words in err["message"]
    if field in UNSUPPORTED:
        assert json.dumps(value)[:40] in err["message"] and "accepted: " in err["message"]


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "use_beam_search", False),
    ("/v1/completions", "logit_bias", {}),
    ("/v1/completions", "length_penalty", 1.0),
    ("/v1/completions", "best_of", 1),
    ("/v1/completions", "suffix", ""),
    ("/v1/completions", "guided_json", None),
    ("/v1/completions", "user", "someone"),
    ("/v1/completions", "cache_salt", "abc"),
    ("/v1/chat/completions", "tools", []),
    ("/v1/chat/completions", "tool_choice", "none"),
    ("/v1/chat/completions", "parallel_tool_calls", False),
    ("/v1/chat/completions", "metadata", {"k": "v"}),
    ("/v1/chat/completions", "service_tier", "auto"),
    ("/v1/chat/completions", "store", False),
    ("/v1/chat/completions", "modalities", ["text"]),
    ("/v1/chat/completions", "prompt_cache_key", "x"),
    ("/v1/chat/completions", "safety_identifier", "x"),
])
def test_values_that_change_nothing_are_served(http, path, field, value):
    assert _post(http, path, **{field: value}).status_code == 200


def test_an_unknown_field_is_a_400_naming_it_and_the_field_meant(http):
    err = _error(_post(http, "/v1/completions", temprature=0.5))
    assert err["param"] == "temprature" and err["code"] == "unknown_field"
    assert "'temprature'" in err["message"] and "did you mean 'temperature'" in err["message"]
    err = _error(_post(http, "/v1/completions", tools=[]))
    assert "a field of /v1/chat/completions" in err["message"]
    err = _error(_post(http, "/v1/chat/completions", some_vendor_field={"nested": [1]}))
    assert err["param"] == "some_vendor_field" and "docs/serve.md" in err["message"]


def test_stream_options_keys_are_checked_and_continuous_usage_is_served(http, server):
    err = _error(_post(http, "/v1/completions", stream=True,
                       stream_options={"include_usage": True, "usage_every": 1}))
    assert err["param"] == "stream_options.usage_every"
    assert "include_usage, continuous_usage_stats" in err["message"]
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True,
                               "include_obfuscation": False}}
    chunks = []
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    assert all(c["usage"] is not None for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1]["choices"] == []


def test_max_completion_tokens_works_on_completions_and_must_agree(http, server):
    out = _post(http, "/v1/completions", max_tokens=None, max_completion_tokens=7,
                ignore_eos=True).json()
    assert out["usage"]["completion_tokens"] == 7
    err = _error(_post(http, "/v1/completions", max_tokens=3, max_completion_tokens=7))
    assert err["param"] == "max_completion_tokens"


def test_request_id_names_the_response(http):
    out = _post(http, "/v1/chat/completions", request_id="abc-1").json()
    assert out["id"] == "chatcmpl-abc-1"
    # several at once with one id do not collide inside the engine
    with ThreadPoolExecutor(4) as pool:
        same = list(pool.map(lambda _: _post(http, "/v1/completions", request_id="abc-1",
                                             max_tokens=6, ignore_eos=True), range(4)))
    assert [r.json()["id"] for r in same] == ["cmpl-abc-1"] * 4
    assert {r.json()["choices"][0]["text"] for r in same} == {same[0].json()["choices"][0]["text"]}
    err = _error(_post(http, "/v1/completions", request_id="two\nlines"))
    assert err["param"] == "request_id"


def test_chat_template_controls(http):
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi"}]
    usage = {}
    for name, extra in [("default", {}), ("no_prompt", {"add_generation_prompt": False}),
                        ("continue", {"add_generation_prompt": False,
                                      "continue_final_message": True})]:
        r = _post(http, "/v1/chat/completions", messages=messages, **extra)
        assert r.status_code == 200, r.text
        usage[name] = r.json()["usage"]["prompt_tokens"]
    # ChatML: the generation prompt opens an assistant turn; continuing leaves the last one open
    assert usage["default"] > usage["no_prompt"] > usage["continue"]
    err = _error(_post(http, "/v1/chat/completions", messages=messages,
                       continue_final_message=True))
    assert err["param"] == "continue_final_message"


def test_messages_carried_back_from_an_answer_are_accepted(http):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None,
                 "function_call": None, "audio": None, "annotations": []},
                {"role": "user", "content": "again"}]
    assert _post(http, "/v1/chat/completions", messages=messages).status_code == 200
    messages[1]["tool_calls"] = [{"id": "c", "type": "function",
                                  "function": {"name": "f", "arguments": "{}"}}]
    assert _error(_post(http, "/v1/chat/completions", messages=messages))["param"] == (
        "messages.1.tool_calls")


def test_the_openai_client_sends_what_it_is_given(client, server):
    """The official client sends only the fields set: plain calls, extra_body and streams pass."""
    out = client.chat.completions.create(
        model=server.model, max_completion_tokens=3, temperature=0.5, top_p=0.9, seed=1,
        stop=["\n\n"], n=2, user="u", messages=[{"role": "user", "content": "hi"}],
        extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": True, "min_tokens": 2,
                    "skip_special_tokens": True})
    assert [c.index for c in out.choices] == [0, 1]
    stream = client.completions.create(model=server.model, prompt="hi", max_tokens=3,
                                       stream=True, stream_options={"include_usage": True})
    assert [c for c in stream][-1].usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt="hi", max_tokens=3,
                                  extra_body={"top_a": 0.5})
    assert info.value.param == "top_a" and info.value.code == "unknown_field"


def test_the_two_routes_logprobs_are_told_apart(http):
    err = _error(_post(http, "/v1/completions", logprobs=True))
    assert err["param"] == "logprobs" and "number of alternatives" in err["message"]
    err = _error(_post(http, "/v1/chat/completions", logprobs=3))
    assert err["param"] == "logprobs" and "top_logprobs" in err["message"]
    err = _error(_post(http, "/v1/completions", top_logprobs=2))
    assert err["param"] == "top_logprobs" and "did you mean 'logprobs'" in err["message"]
    out = _post(http, "/v1/chat/completions", logprobs=True, top_logprobs=2).json()
    assert len(out["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
