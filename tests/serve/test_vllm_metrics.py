"""/metrics carries the series a vLLM dashboard reads, under vLLM's names and ``model_name`` label,
and answers without the API key."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

VLLM_SERIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
}


def _families(server) -> dict:
    text = httpx.get(server.root + "/metrics").text  # no key: a scraper holds none
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(family, suffix="", **labels) -> float:
    return sum(s.value for s in family.samples
               if s.name == family.name + suffix and all(s.labels.get(k) == v
                                                         for k, v in labels.items()))


def test_the_vllm_series_exist_with_the_model_name_label(server, client):
    client.completions.create(model=server.model, prompt="warm up", max_tokens=3, temperature=0)
    families = _families(server)
    for name, kind in VLLM_SERIES.items():
        assert name in families, name
        assert families[name].type == kind, name
        assert {s.labels.get("model_name") for s in families[name].samples} == {server.model}


def test_token_counts_latencies_and_reasons_follow_a_request(server, client):
    before = _families(server)
    out = client.completions.create(model=server.model, prompt="count these tokens",
                                    max_tokens=6, temperature=0)
    after = _families(server)
    m = {"model_name": server.model}

    def grew(name, suffix, **labels):
        return _value(after[name], suffix, **m, **labels) - _value(before[name], suffix, **m,
                                                                    **labels)

    assert grew("vllm:prompt_tokens", "_total") == out.usage.prompt_tokens
    assert grew("vllm:generation_tokens", "_total") == out.usage.completion_tokens
    reason = out.choices[0].finish_reason
    assert grew("vllm:request_success", "_total", finished_reason=reason) == 1
    assert grew("vllm:time_to_first_token_seconds", "_count") == 1
    assert grew("vllm:e2e_request_latency_seconds", "_count") == 1
    if out.usage.completion_tokens > 1:
        assert grew("vllm:inter_token_latency_seconds", "_count") >= 1


def test_running_requests_and_kv_usage_show_while_a_stream_runs(server, client):
    stream = client.completions.create(model=server.model, prompt="a long story", stream=True,
                                       max_tokens=400, temperature=1.0, seed=1)
    next(iter(stream))  # the first token arrived: the request is running
    families = _families(server)
    running = _value(families["vllm:num_requests_running"], model_name=server.model)
    kv = _value(families["vllm:kv_cache_usage_perc"], model_name=server.model)
    stream.close()
    assert running >= 1
    assert 0 < kv <= 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the closed stream's request is cancelled
        idle = _families(server)
        if _value(idle["vllm:num_requests_running"], model_name=server.model) == 0:
            break
        time.sleep(0.1)
    assert _value(idle["vllm:num_requests_running"], model_name=server.model) == 0
    assert _value(idle["vllm:kv_cache_usage_perc"], model_name=server.model) == 0


def test_generated_tokens_are_counted_while_a_long_generation_runs(server, client):
    """A scrape during a generation sees its tokens so far (they used to be counted only once
    the request ended: a dashboard showed nothing for a minute, then a jump)."""
    m = {"model_name": server.model}

    def counted() -> tuple[float, float]:
        families = _families(server)
        return (_value(families["vllm:generation_tokens"], "_total", **m),
                _value(families["moe_runtime_generation_tokens"], "_total"))

    before = counted()
    stream = client.completions.create(model=server.model, prompt="a long story", stream=True,
                                       max_tokens=900, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    received = 0
    chunks = iter(stream)
    while received < 5:
        received += len(next(chunks).choices[0].token_ids)
    during = counted()
    for chunk in chunks:  # to its end, so that no token is counted after this test
        if chunk.choices:
            received += len(chunk.choices[0].token_ids)
    after = counted()
    assert received == 900
    for was, mid, end in zip(before, during, after, strict=True):
        assert received > mid - was >= 5, (before, during, after)
        assert end - was == 900
