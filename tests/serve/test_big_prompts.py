"""Prompts of a megabyte do not hold the server: one whose length alone says it cannot fit the
context is refused before it is tokenized, and tokenizing runs on a worker thread, so /health and
other clients are answered meanwhile. The shared real server, real concurrent HTTP clients.

Before, each such prompt was tokenized on the event loop (0.6 s for 1 MB on this machine's
tokenizer): eight clients sending them kept /health waiting 3-6 s and a small completion 10-15 s.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serve.conftest import API_KEY


def test_a_prompt_too_long_by_its_length_is_refused_untokenized(http, server):
    text = "hello " * 170_000  # about 1 MB: 680,000 tokens
    started = time.perf_counter()
    r = http.post("/v1/completions", json={"model": server.model, "prompt": text,
                                           "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "maximum context length is" in err["message"] and "it was not tokenized" in err["message"]
    assert time.perf_counter() - started < 0.3  # tokenizing it alone takes about 0.6 s here


def test_a_prompt_just_long_enough_to_need_tokenizing_still_gets_the_exact_count(http, server):
    # past the context, but not by so much that its length proves it: counted by the tokenizer
    text = "hello " * 1500
    r = http.post("/v1/completions", json={"model": server.model, "prompt": text,
                                           "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert "it was not tokenized" not in r.json()["error"]["message"]
    assert "the prompt has" in r.json()["error"]["message"]
    messages = [{"role": "user", "content": text}]
    r = http.post("/v1/chat/completions", json={"model": server.model, "messages": messages,
                                                "max_tokens": 2})
    assert r.status_code == 400 and "the prompt has" in r.json()["error"]["message"], r.text
    # refused with the server's own error, and transformers' warning that "running this sequence
    # through the model will result in indexing errors" is not logged beside it
    assert server.lines_with("POST /v1/chat/completions 400", timeout=5)
    assert not server.lines_with("Token indices sequence length", timeout=0.5)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_health_and_a_small_request_are_answered_during_a_flood_of_big_prompts(
        http, server, route):
    import httpx

    # 400 KB each: under the proof-by-length bound on the chat route, tokenized there in full
    text = "hello " * 70_000
    body = ({"prompt": text} if route == "/v1/completions"
            else {"messages": [{"role": "user", "content": text}]})

    def big(_):
        with httpx.Client(base_url=server.root, timeout=300,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            return c.post(route, json={"model": server.model, "max_tokens": 2, **body})

    with ThreadPoolExecutor(8) as pool:
        flood = [pool.submit(big, i) for i in range(24)]
        time.sleep(0.3)
        health, small = [], []
        while not all(f.done() for f in flood) and len(health) < 20:
            t = time.perf_counter()
            assert http.get("/health").status_code == 200
            health.append(time.perf_counter() - t)
            t = time.perf_counter()
            r = http.post("/v1/completions", json={"model": server.model, "prompt": "hi",
                                                   "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            small.append(time.perf_counter() - t)
        statuses = [f.result().status_code for f in flood]
    assert statuses == [400] * len(flood)
    assert health, "the flood ended before a probe"
    health.sort()
    small.sort()
    # medians: two cores share the tokenizing threads, the engine and this client
    assert health[len(health) // 2] < 1.0, health
    assert small[len(small) // 2] < 2.0, small
