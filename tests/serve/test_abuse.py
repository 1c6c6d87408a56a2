"""A hostile client against the real server over loopback: every abusive request gets a 4xx in
OpenAI's error shape, client errors leave one log line and no traceback, well-behaved requests
keep being answered, and the server's memory plateaus over repeated rounds of abuse.

The module starts its own server, so that its log and its memory are this module's alone.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from moe_runtime.serve.protocol import MAX_JSON_DEPTH

ROUNDS = 6


@pytest.fixture(scope="module")
def target(server_factory):
    return server_factory(["--log-level", "info"])


@pytest.fixture(scope="module")
def http(target, api_key):
    with httpx.Client(base_url=target.root, timeout=60,
                      headers={"Authorization": f"Bearer {api_key}"}) as c:
        yield c


def assert_openai_error(response, status: int, code: str | None = None) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code


def post_raw(http, body: bytes, path: str = "/v1/completions"):
    return http.post(path, content=body, headers={"Content-Type": "application/json"})


def raw_socket(target, data: bytes, *, read: bool = True, pause: float = 0.0) -> bytes:
    host, port = target.root.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        if pause:
            time.sleep(pause)
        if not read:
            return b""
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def well_behaved(http, target) -> None:
    r = http.post("/v1/completions", json={"model": target.model, "prompt": "hello",
                                           "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0


# ------------------------------------------------------------------------------- the probes


def test_fifty_thousand_nested_brackets_are_a_400(http):
    assert_openai_error(post_raw(http, b"[" * 50_000), 400, "json_too_deep")
    assert_openai_error(post_raw(http, b'{"a": ' * 50_000 + b"1" + b"}" * 50_000), 400,
                        "json_too_deep")


def test_nesting_one_level_past_the_limit_is_a_400_and_at_the_limit_is_served(http, target):
    def body(depth: int) -> bytes:
        # the body object and the prediction object are two levels; its content adds the rest
        inner = "[" * (depth - 2) + "]" * (depth - 2)
        return (f'{{"model": "{target.model}", "prompt": "hi", "max_tokens": 1, '
                f'"prediction": {{"content": {inner}}}}}').encode()

    assert_openai_error(post_raw(http, body(MAX_JSON_DEPTH + 1)), 400, "json_too_deep")
    assert post_raw(http, body(MAX_JSON_DEPTH)).status_code == 200


def test_brackets_inside_strings_do_not_count_as_nesting(http, target):
    body = json.dumps({"model": target.model, "prompt": "{[" * (MAX_JSON_DEPTH + 1),
                       "max_tokens": 1})
    r = post_raw(http, body.encode())
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body", [
    b'{"prompt": "hi", "temperature": NaN}',
    b'{"prompt": "hi", "top_p": Infinity}',
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    b"\xff\xfe\x00garbage",
    b"",
    b'{"prompt": "\\udcff", "max_tokens": 1}',
    b'{"prompt": "\xed\xb3\xbf", "max_tokens": 1}',
], ids=["nan", "infinity", "5000-digit-integer", "not-utf8", "empty", "lone-surrogate-escape",
        "lone-surrogate-utf8"])
def test_json_python_would_accept_or_choke_on_is_a_400(http, body):
    assert_openai_error(post_raw(http, body), 400, "invalid_json")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-16-be"])
def test_a_body_in_another_unicode_encoding_is_a_400_asking_for_utf8(http, target, encoding):
    """JSON between systems is UTF-8 (RFC 8259 8.1), and docs/serve.md says the body is read as
    UTF-8: json.loads of bytes used to read UTF-16 and UTF-32 too, served as the JSON they spell."""
    body = json.dumps({"model": target.model, "prompt": "hi", "max_tokens": 1}).encode(encoding)
    r = post_raw(http, body)
    assert_openai_error(r, 400, "invalid_json")
    assert "send JSON as UTF-8" in r.json()["error"]["message"]


def test_a_utf8_body_with_a_byte_order_mark_is_served(http, target):
    body = json.dumps({"model": target.model, "prompt": "h\u00e9", "max_tokens": 1},
                      ensure_ascii=False).encode("utf-8-sig")
    assert post_raw(http, body).status_code == 200


def test_an_oversized_chunked_body_without_a_length_is_a_413(http):
    def chunks():
        for _ in range(40):
            yield b"x" * 65536

    r = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert_openai_error(r, 413, "request_too_large")


def test_garbage_instead_of_http_is_a_400(target):
    assert raw_socket(target, b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400")


# --------------------------------------------------------------------------- abuse rounds


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def abuse_round(http, target, api_key) -> list[int]:
    """One round of hostile requests; returns the statuses of the HTTP ones."""
    statuses = []
    post = lambda body: statuses.append(post_raw(http, body).status_code)  # noqa: E731
    post(b"[" * 50_000)
    post(b'{"model": 1, "prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}")
    post(b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}")
    post(json.dumps({"prompt": "x" * (2 << 20)}).encode())
    post(b'{"prompt": [1, 2, 1000000000], "max_tokens": 1}')
    post(b'{"prompt": "\\ud800", "max_tokens": 1}')
    post(b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}')
    statuses.append(http.post("/v1/chat/completions", content=b"[" * 50_000).status_code)
    statuses.append(http.get("/v1/models/" + "x" * 4000).status_code)
    statuses.append(httpx.post(f"{target.root}/v1/completions", json={"prompt": "x"},
                               headers={"Authorization": "Bearer wrong"}).status_code)
    # a client that leaves mid-body, one that never finishes its headers, one mid-stream
    raw_socket(target, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
               + api_key.encode() + b"\r\nContent-Type: application/json\r\n"
               b"Content-Length: 5000\r\n\r\n{\"prompt\": \"", read=False, pause=0.2)
    raw_socket(target, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", read=False, pause=0.2)
    raw_socket(target, b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
    with http.stream("POST", "/v1/completions",
                     json={"model": target.model, "prompt": "tell me", "max_tokens": 64,
                           "stream": True}) as r:
        for _line in r.iter_lines():
            break
    # and many at once
    with ThreadPoolExecutor(16) as pool:
        statuses += [r.status_code for r in pool.map(
            lambda i: post_raw(http, b"{" * (100 + i)), range(32))]
    return statuses


def test_abuse_rounds_get_4xx_lose_no_good_response_and_memory_plateaus(http, target, api_key):
    rss = []
    for _ in range(ROUNDS):
        statuses = abuse_round(http, target, api_key)
        assert all(400 <= s < 500 for s in statuses), statuses
        well_behaved(http, target)
        rss.append(_rss_bytes(target.proc.pid))
    growth = max(rss[3:]) - rss[2]
    # warm-up (allocator arenas, first requests) is allowed in the first rounds; after it the
    # resident set stays within a few MiB whatever the number of rounds
    assert growth < 16 << 20, [f"{r / 2**20:.0f} MiB" for r in rss]


def test_client_errors_leave_one_log_line_and_no_traceback(http, target, api_key):
    abuse_round(http, target, api_key)
    well_behaved(http, target)
    time.sleep(0.5)
    log = list(target.lines)
    assert not [line for line in log if "Traceback" in line], "\n".join(log[-60:])
    assert [line for line in log if " 400 " in line and "/v1/completions" in line]
    assert target.lines_with("client_disconnected") or target.lines_with("499")
    assert target.proc.poll() is None
