"""A request that frames its body twice, with both ``Content-Length`` and ``Transfer-Encoding``,
against the real server over a raw socket: RFC 9112 section 6.1 calls it a request-smuggling risk
(a proxy in front may read the body by the other header) and asks the server to close the
connection after it. It is answered 400 ``malformed_http_request`` naming both headers, nothing
after it on the connection is read, the connection is closed, and a fresh one is served.

h11 alone reads such a request as chunked, serves it and keeps the connection alive.
"""

from __future__ import annotations

import json
import re
import socket
import time
import uuid

import pytest

from tests.serve.test_bounded_errors import served

BODY = json.dumps({"prompt": "hello", "max_tokens": 2, "temperature": 0}).encode()
CHUNKED = f"{len(BODY):x}\r\n".encode() + BODY + b"\r\n0\r\n\r\n"
SMUGGLED = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"  # what a proxy would call more body


def connect(server) -> socket.socket:
    host, port = server.root.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def request(api_key: str, framing: list[str]) -> bytes:
    head = ["POST /v1/completions HTTP/1.1", "Host: x", f"Authorization: Bearer {api_key}",
            "Content-Type: application/json", *framing]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + CHUNKED + SMUGGLED


@pytest.mark.parametrize("framing", [
    [f"Content-Length: {len(CHUNKED)}", "Transfer-Encoding: chunked"],
    ["Transfer-Encoding: chunked", f"Content-Length: {len(CHUNKED)}"],
    [f"content-length: {len(BODY)}", "TRANSFER-ENCODING: Chunked"],
    ["Content-Length: 0", "Transfer-Encoding: chunked"],
], ids=["length-first", "chunked-first", "odd-case", "zero-length"])
def test_content_length_with_transfer_encoding_is_a_400_and_the_connection_closes(
        server, http, api_key, framing):
    with connect(server) as s:
        s.settimeout(3)  # the keep-alive timeout is 5 s: the close must come before it
        s.sendall(request(api_key, framing))
        chunks = []
        started = time.monotonic()
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                kept = b"".join(chunks)[:400]
                raise AssertionError(f"the connection was kept open: {kept!r}") from None
            if not chunk:
                break
            chunks.append(chunk)
        assert time.monotonic() - started < 3
    answer = b"".join(chunks)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer[:400]
    assert b"connection: close" in head.lower().split(b"\r\n")
    assert answer.count(b"HTTP/1.1 ") == 1, answer  # the smuggled request was never answered
    err = json.loads(body)["error"]
    assert err["code"] == "malformed_http_request" and err["type"] == "invalid_request_error"
    assert "Content-Length" in err["message"] and "Transfer-Encoding" in err["message"]
    served(http, server)  # a fresh connection is served


def test_each_framing_alone_is_served_on_a_kept_alive_connection(server, api_key):
    def ask(s: socket.socket, framing: list[str], body: bytes) -> bytes:
        head = ["POST /v1/completions HTTP/1.1", "Host: x", f"Authorization: Bearer {api_key}",
                "Content-Type: application/json", *framing]
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += s.recv(65536)
        head_bytes, _, rest = answer.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head_bytes.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(rest) < length:
            rest += s.recv(65536)
        assert head_bytes.startswith(b"HTTP/1.1 200 "), answer[:400]
        return rest

    with connect(server) as s:
        for _ in range(2):  # the same connection serves both, twice
            assert json.loads(ask(s, [f"Content-Length: {len(BODY)}"], BODY))["choices"]
            assert json.loads(ask(s, ["Transfer-Encoding: chunked"], CHUNKED))["choices"]


def _answer(s: socket.socket) -> bytes:
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


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def _requests_counted(http, status: int, route: str) -> float:
    pattern = re.compile(rf'^moe_runtime_requests_total{{route="{re.escape(route)}",'
                         rf'status="{status}"}} (\S+)$', re.M)
    m = pattern.search(http.get("/metrics").text)
    return float(m.group(1)) if m else 0.0


def test_the_framing_400_carries_the_clients_request_id_and_has_its_access_line(
        server, http, api_key):
    """Like every other response: the header, one access line, and a count in the metrics
    (the protocol answers it before any app sees the request, and used to do so silently)."""
    counted = _requests_counted(http, 400, "/v1/completions")
    rid = f"smuggle-{uuid.uuid4().hex}"
    with connect(server) as s:
        s.sendall(request(api_key, [f"Content-Length: {len(CHUNKED)}", "Transfer-Encoding: chunked",
                                    f"x-request-id: {rid}"]))
        head = _answer(s).partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 400 "), head
    assert _header(head, b"x-request-id") == rid.encode()
    (line,) = server.lines_with(f"request_id={rid}")
    assert " POST /v1/completions 400 " in line and "malformed_http_request" in line, line
    assert _requests_counted(http, 400, "/v1/completions") == counted + 1


def test_a_request_h11_cannot_parse_gets_a_request_id_and_an_access_line(server, http):
    counted = _requests_counted(http, 400, "other")
    with connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
        head = _answer(s).partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 400 "), head
    rid = _header(head, b"x-request-id")
    assert rid, head
    (line,) = server.lines_with(f"request_id={rid.decode()}")
    assert " 400 " in line and "malformed_http_request" in line, line
    assert _requests_counted(http, 400, "other") == counted + 1


def test_a_bad_chunk_in_the_body_is_logged_as_the_400_sent(server, api_key):
    """The app has the request when its body breaks HTTP: its one access line says 400
    (the status sent), not 499, and has the same request id as the response."""
    rid = f"badchunk-{uuid.uuid4().hex}"
    with connect(server) as s:
        s.sendall(request(api_key, ["Transfer-Encoding: chunked", f"x-request-id: {rid}"])
                  .replace(CHUNKED, b"zz\r\n"))
        head = _answer(s).partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 400 "), head
    assert _header(head, b"x-request-id") == rid.encode()
    (line,) = server.lines_with(f"request_id={rid}")
    assert " POST /v1/completions 400 " in line and "malformed_http_request" in line, line


@pytest.mark.parametrize("target", [b"http://example.invalid/v1/completions",
                                    b"HTTP://127.0.0.1:1/v1/completions?x=1"])
def test_an_absolute_form_target_is_served_as_its_path(server, api_key, target):
    """RFC 9112 3.2.2: a server must accept it (a client set to use this server as a proxy
    sends it); uvicorn took the whole URL for the path, a 404 for '/http://...'."""
    with connect(server) as s:
        s.sendall(b"POST " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  + f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY)
        head, _, body = _answer(s).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head + body
    assert json.loads(body)["choices"]


def test_the_refused_request_line_is_quoted_as_sent_not_as_a_python_bytearray(server):
    with connect(server) as s:
        s.sendall(b"GET  /health HTTP/1.1\r\nHost: x\r\n\r\n")  # two spaces: not HTTP/1.1
        body = _answer(s).partition(b"\r\n\r\n")[2]
    message = json.loads(body)["error"]["message"]
    assert "illegal request line: b'GET  /health HTTP/1.1';" in message, message
    assert "bytearray" not in message
