"""A client that leaves before its whole (not streamed) answer: the real server over loopback
cancels its generation, as it cancels a stream whose client left, counts it as finished
``abort`` and logs it 499 ``client_disconnected``, and serves the next request as before.

Without that, 16 clients that sent ``max_tokens=1000`` and closed their sockets had all their
tokens generated (logged 200 ``length``) while a normal request waited behind them.

The module starts its own server, so that its metrics and its log are this module's alone.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import uuid

import httpx
import pytest
from starlette.requests import ClientDisconnect

MAX_TOKENS = 1000  # with ignore_eos, seconds of work for the tiny model on a CPU
ROUTES = {
    "/v1/completions": {"prompt": "hello there"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello there"}]},
}


@pytest.fixture(scope="module")
def target(server_factory):
    return server_factory(["--log-level", "info"])


@pytest.fixture(scope="module")
def http(target, api_key):
    with httpx.Client(base_url=target.root, timeout=120,
                      headers={"Authorization": f"Bearer {api_key}"}) as c:
        yield c


def sample(http, name: str, labels: str = "") -> float:
    pattern = re.compile(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", re.M)
    m = pattern.search(http.get("/metrics").text)
    return float(m.group(1)) if m else 0.0


def finished(http) -> dict[str, float]:
    return {reason: sample(http, "moe_runtime_request_finish_total", f'{{reason="{reason}"}}')
            for reason in ("abort", "length", "stop")}


def greedy(http, target, route: str) -> dict:
    r = http.post(route, json={"model": target.model, **ROUTES[route], "max_tokens": 6,
                               "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 6
    assert body["choices"][0]["finish_reason"] == "length"
    return body["choices"][0]


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_whole_answer_whose_client_left_is_cancelled_and_the_next_is_served(
        http, target, api_key, route):
    before_answer = greedy(http, target, route)
    tokens_before = sample(http, "moe_runtime_generation_tokens_total")
    done_before = finished(http)
    request_id = f"leaves-{uuid.uuid4().hex}"
    body = json.dumps({"model": target.model, **ROUTES[route], "max_tokens": MAX_TOKENS,
                       "ignore_eos": True, "temperature": 0}).encode()
    head = (f"POST {route} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_key}\r\n"
            f"Content-Type: application/json\r\nx-request-id: {request_id}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    host, port = target.root.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head + body)
        deadline = time.monotonic() + 30
        while not sample(http, "vllm:num_requests_running", f'{{model_name="{target.model}"}}'):
            assert time.monotonic() < deadline, "the request never had a first token"
            time.sleep(0.01)
    # the socket is closed: the request ends (aborted, or before the fix at its max_tokens)
    deadline = time.monotonic() + 120
    while sum(finished(http).values()) == sum(done_before.values()):
        assert time.monotonic() < deadline, "the request never finished"
        time.sleep(0.02)
    done = finished(http)
    generated = sample(http, "moe_runtime_generation_tokens_total") - tokens_before
    assert done["abort"] - done_before["abort"] == 1, (done_before, done)
    assert done["length"] == done_before["length"], (done_before, done)
    assert generated < MAX_TOKENS, generated
    assert sample(http, "moe_runtime_requests_in_progress") == 0
    (line,) = target.lines_with(f"request_id={request_id}", timeout=10)
    assert f" {route} 499 " in line and "finish=abort" in line and "client_disconnected" in line
    # the next request is served, with the same answer as before
    assert greedy(http, target, route) == before_answer
    log = list(target.lines)
    assert not [line for line in log if "Traceback" in line], "\n".join(log[-40:])


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_stream_whose_client_left_is_logged_as_the_client_leaving(http, target, api_key, route):
    """The 200 and the first chunks were sent, so the status logged stays 200 (as nginx logs a
    response begun), but the access line says ``client_disconnected`` with ``finish=abort``, as a
    whole answer's 499 line does, where it used to read as a stream the server aborted."""
    done_before = finished(http)
    request_id = f"leaves-stream-{uuid.uuid4().hex}"
    body = json.dumps({"model": target.model, **ROUTES[route], "max_tokens": MAX_TOKENS,
                       "ignore_eos": True, "temperature": 0, "stream": True}).encode()
    head = (f"POST {route} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_key}\r\n"
            f"Content-Type: application/json\r\nx-request-id: {request_id}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    host, port = target.root.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head + body)
        received = b""
        while received.count(b"data: ") < 3:  # a few chunks: the generation is under way
            chunk = s.recv(65536)
            assert chunk, received
            received += chunk
        assert received.startswith(b"HTTP/1.1 200 ")
    (line,) = target.lines_with(f"request_id={request_id}", timeout=30)
    assert f" {route} 200 " in line, line
    assert "finish=abort" in line and "client_disconnected" in line, line
    deadline = time.monotonic() + 30
    while finished(http)["abort"] == done_before["abort"]:
        assert time.monotonic() < deadline, "the stream was never counted"
        time.sleep(0.02)
    assert finished(http)["length"] == done_before["length"]
    assert sample(http, "moe_runtime_requests_in_progress") == 0


# ---------------------------------------------------------------------- the watcher, in process


class _Receive:
    """An ASGI request whose body was read: ``receive`` blocks until ``leave`` is called."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    def leave(self) -> None:
        self.gone.set()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


def test_the_watcher_ends_with_an_answer_and_changes_nothing():
    from moe_runtime.serve.app import _unless_client_leaves

    async def main():
        client = _Receive()

        async def work():
            await asyncio.sleep(0.01)
            return "answer"

        assert await _unless_client_leaves(client, work()) == "answer"
        assert asyncio.all_tasks() == {asyncio.current_task()}  # no watcher left behind

        async def fails():
            raise ValueError("engine error")

        with pytest.raises(ValueError, match="engine error"):
            await _unless_client_leaves(client, fails())
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())


def test_the_work_is_cancelled_and_awaited_when_the_client_leaves():
    from moe_runtime.serve.app import _unless_client_leaves

    async def main():
        client = _Receive()
        cleaned = []

        async def work():
            try:
                await asyncio.sleep(60)
            finally:
                await asyncio.sleep(0)  # cleanup that awaits: done before the call returns
                cleaned.append(True)

        asyncio.get_running_loop().call_later(0.01, client.leave)
        with pytest.raises(ClientDisconnect):
            await _unless_client_leaves(client, work())
        assert cleaned == [True]
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())
