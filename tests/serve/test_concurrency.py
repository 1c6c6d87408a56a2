"""Concurrent clients are batched together and each still gets its own, correct result."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROMPTS = [
    "Hello, world!", "The quick brown fox", "Once upon a time", "Numbers 0 1 2 3",
    "A mixture of experts", "How are you today?", "one two three", "The server listens",
    "It is sunny", "What is the weather",
]


def _request(i: int) -> dict:
    """Request i: its own prompt, its own seed; every third one greedy, one chat, one streamed."""
    req = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 12 + i, "seed": 1000 + i,
           "temperature": 0.0 if i % 3 == 0 else 0.7 + 0.05 * i, "top_p": 0.9 if i % 2 else 1.0}
    return req


def _run(client, model: str, i: int, barrier: threading.Barrier | None = None) -> tuple:
    req = _request(i)
    if barrier is not None:
        barrier.wait()
    if i == 4:  # one chat request among them
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": req.pop("prompt")}], **req)
        return out.choices[0].message.content, out.usage.completion_tokens
    if i == 7:  # and one streamed completion
        chunks = list(client.completions.create(model=model, stream=True, **req))
        return "".join(c.choices[0].text for c in chunks), None
    out = client.completions.create(model=model, **req)
    return out.choices[0].text, out.usage.completion_tokens


def _wide_steps(http) -> float:
    """Forward steps so far that gave a token to more than one sequence."""
    family = next(f for f in text_string_to_metric_families(http.get("/metrics").text)
                  if f.name == "moe_runtime_batch_sequences")
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    return samples[(family.name + "_count", None)] - samples[(family.name + "_bucket", "1.0")]


def test_ten_concurrent_clients_get_the_results_they_get_alone(client, http, server):
    n = len(PROMPTS)
    alone = [_run(client, server.model, i) for i in range(n)]
    wide_before = _wide_steps(http)
    barrier = threading.Barrier(n)
    with ThreadPoolExecutor(n) as pool:
        together = list(pool.map(lambda i: _run(client, server.model, i, barrier), range(n)))
    assert _wide_steps(http) > wide_before  # they really were batched together
    assert together == alone
    # different prompts and seeds give different texts: nothing was shared between requests
    assert len({text for text, _ in together}) == n


def test_a_client_leaving_mid_stream_does_not_stop_the_others(client, http, server):
    background = []
    worker = threading.Thread(target=lambda: background.append(
        client.completions.create(model=server.model, prompt="keep going", max_tokens=40,
                                  temperature=0)))
    worker.start()
    body = {"model": server.model, "prompt": "a long story", "max_tokens": 900, "stream": True,
            "temperature": 0.8, "seed": 1}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                events += 1
            if events == 3:
                break  # leave mid-stream: the connection closes with the block
    worker.join(120)
    assert background and background[0].usage.completion_tokens > 0
    # the abandoned request was cancelled, not generated to its 900 tokens
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = http.get("/metrics").text
        if "moe_runtime_requests_in_progress 0.0" in metrics:
            break
        time.sleep(0.1)
    assert "moe_runtime_requests_in_progress 0.0" in metrics
    assert 'moe_runtime_request_finish_total{reason="abort"}' in metrics
    out = client.completions.create(model=server.model, prompt="after", max_tokens=3,
                                    temperature=0)
    assert out.usage.completion_tokens > 0


def test_health_stays_ok_under_load(client, server):
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.completions.create, model=server.model, prompt=p,
                               max_tokens=8, temperature=0) for p in PROMPTS[:4]]
        assert httpx.get(server.root + "/health", timeout=30).status_code == 200
        assert all(f.result().usage.completion_tokens > 0 for f in futures)
