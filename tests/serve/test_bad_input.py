"""Bad requests get a 4xx with an OpenAI-style error body, and the server keeps serving."""

from __future__ import annotations

import json

import openai
import pytest


def assert_error(response, status: int, *, code: str | None = None, param: str | None = None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


def test_malformed_json_is_a_400(http):
    r = http.post("/v1/completions", content=b'{"model": "x", "prompt": "hi"',
                  headers={"Content-Type": "application/json"})
    assert_error(r, 400, code="invalid_json")


def test_a_body_that_is_not_an_object_is_a_400(http, server):
    r = http.post("/v1/chat/completions", json=[{"model": server.model}])
    assert_error(r, 400)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "5"),
    ("max_tokens", 2.5),
    ("temperature", "hot"),
    ("top_p", [1]),
    ("seed", "42"),
    ("stream", "yes"),
    ("stop", 7),
    ("prompt", 12),
    ("model", 3),
])
def test_a_field_of_the_wrong_type_is_a_400_naming_it(http, server, field, value):
    body = {"model": server.model, "prompt": "hello", "max_tokens": 2, field: value}
    assert_error(http.post("/v1/completions", json=body), 400, param=field)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0),
    ("temperature", 3.0),
    ("top_p", 0.0),
    ("stop", [str(i) for i in range(17)]),  # protocol.MAX_STOP_SEQUENCES is 16
])
def test_a_value_out_of_range_is_a_400(http, server, field, value):
    body = {"model": server.model, "prompt": "hello", "max_tokens": 2, field: value}
    assert_error(http.post("/v1/completions", json=body), 400, param=field)


@pytest.mark.parametrize("route, body, param, accepted", [
    ("/v1/completions", {"prompt": "Hi", "stop": [1, 2]}, "stop", "accepted: str or list[str]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages.0.content", "accepted: str or list["),
])
def test_a_value_of_no_member_of_a_union_names_every_accepted_kind(http, server, route, body,
                                                                   param, accepted):
    # "Input should be a valid string" alone hid that a list is accepted as well
    err = assert_error(http.post(route, json={"model": server.model, **body}), 400,
                       param=param)
    assert accepted in err["message"], err["message"]


def test_too_many_stop_strings_are_a_400_saying_how_many_are_accepted(http, server):
    body = {"model": server.model, "prompt": "hello", "max_tokens": 2,
            "stop": [str(i) for i in range(17)]}
    err = assert_error(http.post("/v1/completions", json=body), 400, param="stop")
    assert err["message"].startswith("invalid value for 'stop': at most 16 stop sequences are "
                                     "accepted; this list has 17"), err  # no "Value error, "


@pytest.mark.parametrize("role", ["tool", "function"])
def test_a_tool_message_is_a_400_saying_there_is_no_tool_calling(http, server, role):
    body = {"model": server.model, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": role, "content": "42", "name": "f"}]}
    err = assert_error(http.post("/v1/chat/completions", json=body), 400,
                       param="messages.1.role")
    assert f"role '{role}' is not served" in err["message"] and "tool calling" in err["message"]


def test_chat_messages_of_the_wrong_type_are_a_400(http, server):
    body = {"model": server.model, "messages": "hello", "max_tokens": 2}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param="messages")
    body = {"model": server.model, "messages": [{"role": "wizard", "content": "hi"}]}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param="messages.0.role")


def test_unknown_fields_are_a_400_naming_them(http, server):
    body = {"model": server.model, "prompt": "hello", "max_tokens": 2, "temperature": 0,
            "some_vendor_field": {"nested": [1, 2]}}
    err = assert_error(http.post("/v1/completions", json=body), 400, code="unknown_field",
                       param="some_vendor_field")
    assert "'some_vendor_field'" in err["message"]


def test_an_omitted_model_means_the_served_one(http):
    r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("seed", [2**63, 2**64 - 1, -(2**63) - 1, 2**70],
                         ids=["2^63", "2^64-1", "-2^63-1", "2^70"])
def test_a_seed_outside_int64_is_a_400_naming_the_range(http, server, route, seed):
    """OpenAI's and vLLM's seed is an int64. Seeds of [2**63, 2**64) used to be served,
    drawing as the seed 2**64 below them (2**64 - 1 answered as -1 does)."""
    body = {"model": server.model, "max_tokens": 2, "seed": seed,
            **({"prompt": "hello"} if route == "/v1/completions" else
               {"messages": [{"role": "user", "content": "hello"}]})}
    err = assert_error(http.post(route, json=body), 400, param="seed", code="invalid_value")
    assert "64-bit" in err["message"], err
    assert f"[{-(2**63)}, {2**63 - 1}]" in err["message"], err


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), -1, 0])
def test_a_seed_within_int64_is_served(http, server, seed):
    body = {"model": server.model, "prompt": "hello", "max_tokens": 2, "seed": seed, "n": 2}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


def test_a_missing_required_field_is_a_400(http, server):
    assert_error(http.post("/v1/completions", json={"model": server.model}), 400,
                 param="prompt")


@pytest.mark.parametrize("prompt", ["", [], [""]])
def test_an_empty_prompt_is_a_400(http, server, prompt):
    body = {"model": server.model, "prompt": prompt, "max_tokens": 2}
    assert_error(http.post("/v1/completions", json=body), 400, param="prompt")


def test_empty_chat_messages_are_a_400(http, server):
    body = {"model": server.model, "messages": [], "max_tokens": 2}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param="messages")


def test_a_prompt_longer_than_the_context_is_a_400(http, server):
    context = http.get("/v1/models").json()["data"][0]["max_model_len"]
    body = {"model": server.model, "prompt": [5] * (context + 10), "max_tokens": 2}
    assert_error(http.post("/v1/completions", json=body), 400, code="context_length_exceeded")


def test_max_tokens_beyond_the_context_is_a_400(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt="hello", max_tokens=100_000)
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "max_tokens"


def test_token_ids_outside_the_vocabulary_are_a_400(http, server):
    body = {"model": server.model, "prompt": [1, 2, 10**9], "max_tokens": 2}
    assert_error(http.post("/v1/completions", json=body), 400, param="prompt")


def test_a_wrong_model_name_is_a_404(client, http):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found"
    assert_error(http.get("/v1/models/gpt-4"), 404, code="model_not_found")


def test_an_oversized_body_is_a_413(http, server):
    body = json.dumps({"model": server.model, "prompt": "x" * (2 << 20), "max_tokens": 2})
    r = http.post("/v1/completions", content=body.encode(),
                  headers={"Content-Type": "application/json"})
    assert_error(r, 413)


def test_unknown_routes_and_methods_get_error_bodies(http):
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/completions"), 405)


@pytest.mark.parametrize("method, path, allowed", [
    ("GET", "/v1/completions", "POST"), ("DELETE", "/v1/chat/completions", "POST"),
    ("POST", "/health", "GET, HEAD"), ("PUT", "/v1/models", "GET, HEAD"),
])
def test_a_405_names_the_methods_the_route_takes(http, method, path, allowed):
    """RFC 9110 15.5.6: a 405 carries Allow (the error handler used to drop Starlette's)."""
    r = http.request(method, path)
    err = assert_error(r, 405, code="method_not_allowed")
    assert r.headers.get("allow") == allowed
    assert err["message"] == f"no route {method} {path}; the route takes {allowed}"


def test_unsupported_options_are_refused_not_ignored(http, server):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 2, "logit_bias": {"5": 1.0}}
    assert_error(http.post("/v1/completions", json=body), 400, param="logit_bias")


def test_the_server_keeps_serving_after_bad_requests(client, http, server):
    http.post("/v1/completions", content=b"not json at all")
    http.post("/v1/chat/completions", json={"model": server.model, "messages": 5})
    out = client.completions.create(model=server.model, prompt="still here?", max_tokens=3,
                                    temperature=0)
    assert out.usage.completion_tokens > 0


@pytest.mark.parametrize("role", ["user", "assistant", "system"])
def test_a_tool_call_id_outside_a_tool_message_is_a_400_naming_it(http, server, role):
    """It belongs to role 'tool' (not served: no tool calling); it used to be dropped unread."""
    messages = [{"role": role, "content": "hello", "tool_call_id": "call_1"}]
    if role != "user":
        messages.append({"role": "user", "content": "hello"})
    err = assert_error(http.post("/v1/chat/completions", json={
        "model": server.model, "max_tokens": 2, "messages": messages}), 400,
        param="messages.0.tool_call_id")
    assert "'tool'" in err["message"] and f"'{role}' message" in err["message"], err


def test_a_null_tool_call_id_is_served(http, server):
    r = http.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hello", "tool_call_id": None}]})
    assert r.status_code == 200, r.text


def test_an_unknown_key_of_stream_options_has_the_unknown_field_code(http, server):
    """As an unknown top-level field and a message's unknown key have; it was invalid_value."""
    body = {"model": server.model, "prompt": "hi", "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True, "include_usge": True}}
    err = assert_error(http.post("/v1/completions", json=body), 400,
                       param="stream_options.include_usge", code="unknown_field")
    assert "include_usage, continuous_usage_stats, include_obfuscation" in err["message"]
