"""One request of many prompts does not hold the whole queue: at most two batches of its
sequences are submitted at a time (``Engine.group_limit``), so a request that comes after it starts
once a batch's worth of them has ended, not after every one. A real server, real concurrent HTTP clients.

Before, every prompt of the big request was submitted at once; transformers' scheduler serves its
queue in order, so a later one-prompt request waited behind all of them (here: behind all 24).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.serve.conftest import API_KEY

BATCH = 2
PROMPTS = 24
TOKENS = 48


@pytest.fixture(scope="module")
def small(server_factory):
    proc = server_factory(["--max-batch-size", str(BATCH)])
    with httpx.Client(base_url=proc.root, timeout=600,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield proc, client


def _stream_big(proc, finished: list, first_token: threading.Event, errors: list) -> None:
    """Stream a request of PROMPTS prompts; note the time each choice finishes."""
    body = {"model": proc.model, "prompt": [[5 + i] * 6 for i in range(PROMPTS)],
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=proc.root, timeout=600,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as client, \
                client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                errors.append(f"{r.status_code}: {r.read()[:300]!r}")
                return
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    first_token.set()
                    if choice.get("finish_reason"):
                        finished.append((time.monotonic(), choice["index"]))
    except Exception as exc:  # reported by the test, not lost in the thread
        errors.append(repr(exc))
    finally:
        first_token.set()


def test_a_request_after_a_big_one_starts_when_the_first_of_its_sequences_ends(small):
    proc, http = small
    finished: list = []
    first_token = threading.Event()
    errors: list = []
    big = threading.Thread(target=_stream_big, args=(proc, finished, first_token, errors))
    big.start()
    assert first_token.wait(300), "the big request produced no token"
    r = http.post("/v1/completions", json={"model": proc.model, "prompt": "a small one",
                                           "max_tokens": 4, "temperature": 0})
    small_done = time.monotonic()
    big.join(600)
    assert not errors, errors
    assert r.status_code == 200, r.text
    assert sorted(i for _, i in finished) == list(range(PROMPTS))  # every prompt answered
    before = sum(1 for t, _ in finished if t < small_done)
    # a batch running and a batch queued of the big one: the small request enters once the
    # queued ones have: a few of the big one's sequences finish before it, not nearly all
    assert before <= 3 * BATCH, (
        f"{before} of the big request's {PROMPTS} sequences finished before the small request")


def test_the_big_requests_answers_are_what_each_prompt_gets_alone(small):
    proc, http = small
    prompts = [[5 + i] * 6 for i in range(3 * BATCH + 1)]
    r = http.post("/v1/completions", json={"model": proc.model, "prompt": prompts,
                                           "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    texts = {c["index"]: c["text"] for c in r.json()["choices"]}
    assert sorted(texts) == list(range(len(prompts)))
    for i in (0, len(prompts) - 1):
        alone = http.post("/v1/completions", json={"model": proc.model, "prompt": prompts[i],
                                                   "max_tokens": 8, "temperature": 0})
        assert alone.json()["choices"][0]["text"] == texts[i]
