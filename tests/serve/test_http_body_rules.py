"""What a request body must be, against the real server and real clients: JSON by its
``Content-Type`` (or no ``Content-Type``, as ``vllm serve`` reads it, unless a web page sent it),
anything else a 415 naming the type received and the one accepted; and a JSON object holding a key twice
is a 400 ``duplicate_key`` naming the key and where it is, never "the last one wins". The
server serves on after each refusal, on the same kept-alive connection too."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from urllib.parse import urlsplit

import openai
import pytest

from tests.serve.test_bounded_errors import error_of, served

COMPLETION = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
ROUTES = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]


def post(http, route: str, body: bytes, content_type: str | None):
    headers = {} if content_type is None else {"Content-Type": content_type}
    return http.post(route, content=body, headers=headers)


# ------------------------------------------------------------------------------ Content-Type


@pytest.mark.parametrize("content_type", [
    "application/json", "Application/JSON", "application/json; charset=utf-8",
    "application/json;charset=UTF-8", "application/json ; charset=\"utf-8\"",
    "application/vnd.api+json", "application/merge-patch+json; charset=utf-8",
])
@pytest.mark.parametrize("route, body", ROUTES)
def test_json_content_types_are_served(http, route, body, content_type):
    r = post(http, route, json.dumps(body).encode(), content_type)
    assert r.status_code == 200, r.text
    assert r.json()["choices"]


@pytest.mark.parametrize("route, body", ROUTES)
def test_no_content_type_is_read_as_json(http, server, route, body):
    """As FastAPI (vLLM, SGLang) reads it: a client that sends JSON without saying so is served;
    what it sends must still be JSON."""
    r = post(http, route, json.dumps(body).encode(), None)
    assert "content-type" not in r.request.headers
    assert r.status_code == 200, r.text
    err = error_of(post(http, route, b"prompt=hello", None), 400, "invalid_json")
    assert "not valid JSON" in err["message"]
    served(http, server)


@pytest.mark.parametrize("route, body", ROUTES)
def test_no_content_type_from_a_web_page_is_a_415(http, server, route, body):
    """A page may POST a body without a type to localhost with no CORS preflight (FastAPI 0.132
    refuses a missing type for that reason): with an Origin header, a browser's, it is refused."""
    r = http.post(route, content=json.dumps(body).encode(),
                  headers={"Origin": "https://evil.example"})
    err = error_of(r, 415, "unsupported_content_type")
    assert "Origin" in err["message"] and "'application/json'" in err["message"]
    ok = http.post(route, json=body, headers={"Origin": "https://app.example"})
    assert ok.status_code == 200, ok.text
    served(http, server)


def test_urllib_without_a_content_type_sends_the_form_type_and_is_told(server, api_key):
    import urllib.error
    import urllib.request

    body = json.dumps({"model": server.model, **COMPLETION}).encode()
    auth = {"Authorization": f"Bearer {api_key}"}
    request = urllib.request.Request(server.root + "/v1/completions", data=body, headers=auth)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=120)
    assert info.value.code == 415
    err = json.loads(info.value.read())["error"]
    assert err["code"] == "unsupported_content_type"
    assert "'application/x-www-form-urlencoded'" in err["message"]
    request = urllib.request.Request(server.root + "/v1/completions", data=body,
                                     headers={**auth, "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert json.loads(answer.read())["choices"]


def test_an_empty_content_type_header_counts_as_none(http, server):
    host, port = urlsplit(server.root).hostname, urlsplit(server.root).port
    body = json.dumps(COMPLETION).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            f"{http.headers['authorization'].split()[1]}\r\nContent-Type:\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection((host, port), timeout=60) as s:
        s.sendall(head + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


@pytest.mark.parametrize("content_type", [
    "text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", "text/json", "application/jsonx", "application/xml",
    "json", "*/*",
])
@pytest.mark.parametrize("route, body", ROUTES)
def test_another_content_type_is_a_415_naming_it_and_the_server_serves_on(
        http, server, route, body, content_type):
    r = post(http, route, json.dumps(body).encode(), content_type)
    err = error_of(r, 415, "unsupported_content_type")
    assert err["type"] == "invalid_request_error" and err["param"] == "Content-Type"
    assert repr(content_type) in err["message"]
    assert "'application/json'" in err["message"]
    served(http, server)  # on the same pooled connection


def test_a_huge_content_type_is_echoed_bounded(http, server):
    r = post(http, "/v1/completions", json.dumps(COMPLETION).encode(), "text/" + "x" * 6000)
    err = error_of(r, 415, "unsupported_content_type")
    assert len(err["message"]) < 1000 and "(6005 characters)" in err["message"]
    served(http, server)


def test_a_415_comes_before_the_body_is_read_as_json(http, server):
    r = post(http, "/v1/completions", b"not json at all", "text/plain")
    error_of(r, 415, "unsupported_content_type")
    served(http, server)


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl_d_without_a_content_type_is_told_what_to_add(server, api_key):
    """curl -d sends application/x-www-form-urlencoded: refused, saying the header to add; the
    same command with -H 'Content-Type: application/json' is served."""
    body = json.dumps({"model": server.model, **COMPLETION})
    base = ["curl", "-s", "-H", f"Authorization: Bearer {api_key}", "-w", "\n%{http_code}",
            f"{server.root}/v1/completions", "-d", body]
    out = subprocess.run(base, capture_output=True, text=True, timeout=120).stdout
    text, status = out.rsplit("\n", 1)
    assert status == "415", out
    err = json.loads(text)["error"]
    assert err["code"] == "unsupported_content_type"
    assert "'application/x-www-form-urlencoded'" in err["message"]
    assert "-H 'Content-Type: application/json'" in err["message"]
    out = subprocess.run([*base, "-H", "Content-Type: application/json"], capture_output=True,
                         text=True, timeout=120).stdout
    text, status = out.rsplit("\n", 1)
    assert status == "200", out
    assert json.loads(text)["choices"]


def test_the_openai_client_sends_json_and_is_served(client):
    model = client.models.list().data[0].id
    assert client.completions.create(model=model, prompt="hi", max_tokens=1).choices
    assert client.chat.completions.create(
        model=model, max_tokens=1, messages=[{"role": "user", "content": "hi"}]).choices


def test_the_openai_client_sees_the_415(server, api_key):
    import httpx

    def as_text(request: httpx.Request) -> None:
        request.headers["Content-Type"] = "text/plain"

    with httpx.Client(event_hooks={"request": [as_text]}) as raw:
        c = openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0,
                          http_client=raw)
        with pytest.raises(openai.APIStatusError) as info:
            c.completions.create(model=server.model, prompt="hi", max_tokens=1)
    assert info.value.status_code == 415
    assert info.value.code == "unsupported_content_type"


# ---------------------------------------------------------------------------- duplicate keys


@pytest.mark.parametrize("route, body, key, where, param", [
    ("/v1/completions", b'{"model": "a", "model": "b", "prompt": "hi", "max_tokens": 1}',
     "model", "in the request body", "model"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1, "max_tokens": 2}',
     "max_tokens", "in the request body", "max_tokens"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "role": "system", "content": "hi"}], "max_tokens": 1}',
     "role", "in messages[0] (at messages[0].role)", "messages.0.role"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b", '
     b'"content": "c"}], "max_tokens": 1}',
     "content", "in messages[1] (at messages[1].content)", "messages.1.content"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "text": "b"}]}],'
     b' "max_tokens": 1}',
     "text", "in messages[0].content[0] (at messages[0].content[0].text)",
     "messages.0.content.0.text"),
    ("/v1/completions",
     b'{"prompt": "hi", "max_tokens": 1, "stream": true, '
     b'"stream_options": {"include_usage": true, "include_usage": false}}',
     "include_usage", "in stream_options (at stream_options.include_usage)",
     "stream_options.include_usage"),
    ("/v1/completions",
     b'{"prompt": "hi", "max_tokens": 1, "metadata": {"k": "1", "k": "1"}}',
     "k", "in metadata (at metadata.k)", "metadata.k"),
])
def test_a_duplicate_key_is_a_400_naming_it_and_where(http, server, route, body, key, where,
                                                      param):
    r = post(http, route, body, "application/json")
    err = error_of(r, 400, "duplicate_key")
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert f"duplicate key {key!r} {where}" in err["message"], err["message"]
    served(http, server)


def test_the_first_duplicate_in_the_body_is_named(http, server):
    body = (b'{"messages": [{"role": "user", "content": "a", "content": "b"}], '
            b'"max_tokens": 1, "max_tokens": 2}')
    err = error_of(post(http, "/v1/chat/completions", body, "application/json"), 400,
                   "duplicate_key")
    assert err["param"] == "messages.0.content"
    served(http, server)


def test_a_huge_duplicated_key_is_echoed_bounded(http, server):
    key = "k" * 5000
    body = ('{"prompt": "hi", "max_tokens": 1, "metadata": {"%s": "1", "%s": "2"}}'
            % (key, key)).encode()
    err = error_of(post(http, "/v1/completions", body, "application/json"), 400,
                   "duplicate_key")
    assert len(err["message"]) < 1200 and "(5000 characters)" in err["message"]
    assert len(err["param"]) <= 400
    served(http, server)


def test_the_same_key_in_two_objects_is_no_duplicate(http):
    body = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "c"}], "max_tokens": 1,
            "metadata": {"role": "x", "content": "y"}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


def test_the_openai_client_sees_the_duplicate_key(server, api_key):
    import httpx

    def duplicate_model(request: httpx.Request) -> None:
        body = request.content
        assert body.startswith(b"{")
        request.stream = httpx.ByteStream(b'{"model": "other",' + body[1:])
        request._content = b'{"model": "other",' + body[1:]
        request.headers["Content-Length"] = str(len(request._content))

    with httpx.Client(event_hooks={"request": [duplicate_model]}) as raw:
        c = openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0,
                          http_client=raw)
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model=server.model, prompt="hi", max_tokens=1)
    assert info.value.code == "duplicate_key" and info.value.param == "model"
