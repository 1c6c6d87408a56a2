"""Error messages about the shape of a request body, against the real server (found by an
outside user): they say what was sent and what is accepted, in the client's terms."""

from __future__ import annotations

import pytest


def post_raw(http, body: bytes):
    return http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})


def test_a_5000_digit_integer_is_named_without_python_advice(http):
    r = post_raw(http, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}")
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_json"
    assert "more than 4300 digits" in error["message"]
    assert "accepted: numbers of at most 4300 digits" in error["message"]
    assert "sys." not in error["message"] and "set_int_max_str_digits" not in error["message"]


@pytest.mark.parametrize("body, kind", [(b"[1, 2]", "an array"), (b'"hi"', "a string"),
                                        (b"null", "null"), (b"7", "a number"),
                                        (b"true", "a boolean")])
def test_a_body_that_is_no_object_says_what_it_is(http, body, kind):
    r = post_raw(http, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_type"
    assert "must be a JSON object" in error["message"] and f"got {kind}" in error["message"]
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "", "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": [10**9]},
     "stop_token_ids"),
    ("/v1/completions", {"prompt": ["hi"] * 65, "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 1}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}], "max_tokens": 1},
     "messages.0.content"),
])
def test_every_400_has_a_code(http, route, body, param):
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["code"] in ({"empty_array"} if body.get("messages") == [] else {"invalid_value"})


def test_the_openai_client_sees_the_code_of_an_empty_prompt(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=client.models.list().data[0].id, prompt="", max_tokens=1)
    assert info.value.code == "invalid_value"


@pytest.mark.parametrize("stop", ["", [""], ["\n", ""]])
def test_an_empty_stop_string_is_refused_naming_the_field(http, client, stop):
    import openai

    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stop": stop})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "stop" and error["code"] == "invalid_value"
    assert "empty string" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=1,
                                       messages=[{"role": "user", "content": "hi"}], stop=stop)
    assert info.value.param == "stop"


@pytest.mark.parametrize("path", ["/v1/completions/", "/v1/chat/completions/"])
def test_a_trailing_slash_is_a_404_not_a_redirect_to_the_host_header(http, path):
    r = http.post(path, json={"prompt": "hi", "max_tokens": 1},
                  headers={"Host": "evil.example"}, follow_redirects=False)
    assert r.status_code == 404, r.text
    assert "location" not in r.headers
    error = r.json()["error"]
    assert error["code"] == "not_found" and f"no route POST {path}" in error["message"]


def test_an_unknown_key_in_a_message_is_refused_naming_it(http, client):
    body = {"messages": [{"role": "user", "content": "x", "foo": 1}], "max_tokens": 1}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "unknown_field" and error["param"] == "messages.0.foo"
    assert "'foo'" in error["message"] and "role, content, name" in error["message"]
    # what the openai client sends back of its own answer is still accepted
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(model=model, max_tokens=2,
                                            messages=[{"role": "user", "content": "hi"}])
    back = answer.choices[0].message.model_dump()
    again = client.chat.completions.create(model=model, max_tokens=1, messages=[
        {"role": "user", "content": "hi"}, back, {"role": "user", "content": "more"}])
    assert again.choices
