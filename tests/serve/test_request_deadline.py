"""Slow clients against the real server (``--request-read-timeout 1``): a request that does not
arrive whole in time is answered 408 and its connection closed, hundreds of half-open
connections are all released, and requests that arrive whole (and their long answers) are not cut.

uvicorn alone keeps a connection that sent half a request line open for ever (its keep-alive
timer is cancelled by any byte), so a few thousand such clients exhaust the file descriptors.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

TIMEOUT = 1  # --request-read-timeout of this module's server


@pytest.fixture(scope="module")
def target(server_factory):
    return server_factory(["--request-read-timeout", str(TIMEOUT)])


@pytest.fixture(scope="module")
def http(target, api_key):
    with httpx.Client(base_url=target.root, timeout=60,
                      headers={"Authorization": f"Bearer {api_key}"}) as c:
        yield c


def connect(target) -> socket.socket:
    host, port = target.root.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (the socket's 30 s timeout fails the test)."""
    chunks = []
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def served(http, target) -> None:
    """A completion on a new connection: a kept-alive one left idle for the --request-read-timeout
    (1 s here) is closed by the server, and a client reusing it just then races that close (CI
    saw "Server disconnected without sending a response" so)."""
    with httpx.Client(base_url=target.root, timeout=60, headers=http.headers) as fresh:
        r = fresh.post("/v1/completions", json={"model": target.model, "prompt": "hello",
                                                "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_half_sent_headers_get_a_408_in_openai_shape_and_the_server_serves_on(http, target):
    with connect(target) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        reply = read_until_closed(s)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "request_timeout" and "--request-read-timeout" in error["message"]
    served(http, target)
    assert target.lines_with("no whole request headers within 1 s")


def test_a_header_trickle_does_not_keep_the_connection(target):
    """One byte at a time, each well within the timeout: the deadline is for the whole request."""
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    with connect(target) as s:
        sent = 0
        try:
            for i in range(len(request) - 4):  # never the end of the headers
                s.sendall(request[i:i + 1])
                sent += 1
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = read_until_closed(s)
    assert sent < len(request) - 4, "the server let a trickle run for ever"
    assert reply.startswith(b"HTTP/1.1 408"), reply


def test_a_late_body_is_cut_off_and_the_handler_sees_a_disconnect(http, target, api_key):
    with connect(target) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nAuthorization: Bearer " + api_key.encode() +
                  b"\r\nContent-Length: 200\r\n\r\n{\"prompt\": ")
        reply = read_until_closed(s)
    assert not reply.startswith(b"HTTP/1.1 200"), reply
    assert target.lines_with("the request body did not arrive within 1 s")
    served(http, target)


def test_hundreds_of_half_open_connections_are_all_released(http, target):
    pid = target.proc.pid
    served(http, target)
    before = open_fds(pid)
    socks = [connect(target) for _ in range(300)]
    for s in socks:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    served(http, target)  # while they hang
    replies = [read_until_closed(s) for s in socks]
    for s in socks:
        s.close()
    assert all(r.startswith(b"HTTP/1.1 408") for r in replies)
    served(http, target)
    assert open_fds(pid) <= before + 5, (before, open_fds(pid))


def test_an_idle_kept_alive_connection_is_closed_without_a_stray_408(target, api_key):
    with connect(target) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        rest = read_until_closed(s)  # nothing more sent: closed by a deadline, no bytes
    assert b"408" not in rest, rest


def test_requests_that_arrive_whole_are_answered_in_full(http, target):
    """Keep-alive requests more than the timeout apart, and an answer that streams past it."""
    for _ in range(2):
        assert http.get("/health").status_code == 200
        time.sleep(TIMEOUT * 0.6)
    r = http.post("/v1/completions", json={"model": target.model, "prompt": "hello",
                                           "max_tokens": 300, "ignore_eos": True,
                                           "temperature": 0, "stream": True,
                                           "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert r.status_code == 200
    assert chunks[-1]["usage"]["completion_tokens"] == 300
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert not target.lines_with("Traceback", timeout=0.1)


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_a_request_read_timeout_that_is_no_positive_number_is_exit_status_2(value):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "moe_runtime.serve", "--request-read-timeout",
                        value], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    assert "--request-read-timeout must be a positive number of seconds" in r.stderr


@pytest.mark.parametrize("raw, named", [
    (b"GARBAGE\r\n\r\n", "malformed HTTP request"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", "malformed HTTP request"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
     "malformed HTTP request"),
])
def test_a_request_that_is_not_http_gets_a_400_in_openai_shape_and_the_server_serves_on(
        http, target, raw, named):
    with connect(target) as s:
        s.sendall(raw)
        reply = read_until_closed(s)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), reply
    assert b"content-type: application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert named in error["message"] and "HTTP/1.1" in error["message"], error
    assert "unreadable" not in error["message"], error  # h11's own words name the problem
    assert error["code"] == "malformed_http_request" and error["type"] == "invalid_request_error"
    served(http, target)


def test_the_408_carries_a_request_id_and_has_its_access_line(http, target):
    with connect(target) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHo")
        head = read_until_closed(s).partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 408"), head
    (rid,) = [line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
              if line.lower().startswith(b"x-request-id:")]
    (line,) = target.lines_with(f"request_id={rid.decode()}")
    assert " 408 " in line and "request_timeout" in line, line
