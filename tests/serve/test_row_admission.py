"""A flood of sampled sequences, more than the sampler has rows, on a KV cache so small that
transformers' scheduler evicts running requests and restarts them later (each one keeps its sampler
row meanwhile): every request is answered, the server stays healthy and serves the next one.

Before requests waited for a row (``Engine._open_slot``), the batching thread's sampler ran out of
rows here, which transformers treats as a fatal error: the server answered 503 from then on.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serve.conftest import API_KEY

BATCH = 4
ROWS = 2 * BATCH + 16  # the engine's sampler rows for --max-batch-size 4


@pytest.fixture(scope="module")
def small(server_factory):
    proc = server_factory(["--max-batch-size", str(BATCH), "--max-model-len", "512",
                           "--kv-cache-tokens", "512"])
    with httpx.Client(base_url=proc.root, timeout=600,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield proc, client


def test_more_sampled_sequences_than_rows_are_all_served(small):
    proc, http = small
    requests = 16
    n = 4
    assert requests * n > 2 * ROWS

    def one(i: int):
        return http.post("/v1/completions", json={
            "model": proc.model, "prompt": [5 + i] * 8, "max_tokens": 200, "n": n,
            "temperature": 1.0, "seed": i, "ignore_eos": True})

    def greedy(i: int):
        return http.post("/v1/completions", json={
            "model": proc.model, "prompt": [7 + i] * 8, "max_tokens": 8, "temperature": 0})

    with ThreadPoolExecutor(requests + 4) as pool:
        sampled = [pool.submit(one, i) for i in range(requests)]
        plain = [pool.submit(greedy, i) for i in range(4)]
        results = [f.result() for f in sampled + plain]
    assert [r.status_code for r in results] == [200] * len(results), [
        r.text[:200] for r in results if r.status_code != 200]
    for r in results[:requests]:
        choices = r.json()["choices"]
        assert len(choices) == n and all(c["finish_reason"] == "length" for c in choices)
        assert r.json()["usage"]["completion_tokens"] == n * 200
    assert http.get("/health").status_code == 200
    after = http.post("/v1/completions", json={"model": proc.model, "prompt": "still there?",
                                               "max_tokens": 3, "temperature": 0.7})
    assert after.status_code == 200, after.text
    assert not [line for line in proc.lines if "Traceback" in line]
