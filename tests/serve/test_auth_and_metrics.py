"""``--api-key`` on every route but /health and /metrics, and the Prometheus metrics."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("GET", "/v1/moe/plan"),
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/no/such/route"),
])
def test_every_route_but_health_and_metrics_needs_the_key(server, api_key, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": api_key}):
        r = httpx.request(method, server.root + path, headers=headers, json={})
        assert r.status_code == 401, (path, headers)
        assert r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("order", ["right-first", "wrong-first"])
def test_two_authorization_headers_are_refused_whichever_comes_first(server, api_key, order):
    """One field (RFC 9110 11.6.2); the first used to win, so 'right, wrong' was let in while a
    proxy in front that read the last saw a wrong key."""
    keys = [api_key, "wrong"] if order == "right-first" else ["wrong", api_key]
    headers = httpx.Headers([("Authorization", f"Bearer {k}") for k in keys])
    r = httpx.get(server.root + "/v1/models", headers=headers)
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and "2 Authorization headers" in err["message"]


def test_health_and_metrics_need_no_key(server):
    # as vLLM guards only /v1: a Prometheus scraper holds no API key
    assert httpx.get(server.root + "/health").status_code == 200
    assert httpx.get(server.root + "/metrics").status_code == 200


def test_the_openai_client_with_a_wrong_key_is_refused(server):
    bad = openai.OpenAI(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def _metrics(http) -> dict:
    families = text_string_to_metric_families(http.get("/metrics").text)
    return {f.name: f for f in families}


def _value(family, suffix="", **labels) -> float:
    return sum(s.value for s in family.samples
               if s.name == family.name + suffix and all(s.labels.get(k) == v
                                                         for k, v in labels.items()))


def test_metrics_count_requests_and_tokens(client, http, server):
    before = _metrics(http)
    out = client.completions.create(model=server.model, prompt="count these tokens",
                                    max_tokens=4, temperature=0)
    after = _metrics(http)
    route = "/v1/completions"
    assert _value(after["moe_runtime_requests"], "_total", route=route, status="200") == \
        _value(before["moe_runtime_requests"], "_total", route=route, status="200") + 1
    assert _value(after["moe_runtime_prompt_tokens"], "_total") - _value(
        before["moe_runtime_prompt_tokens"], "_total") == out.usage.prompt_tokens
    assert _value(after["moe_runtime_generation_tokens"], "_total") - _value(
        before["moe_runtime_generation_tokens"], "_total") == out.usage.completion_tokens
    latency = after["moe_runtime_request_latency_seconds"]
    assert latency.type == "histogram"
    assert _value(latency, "_count", route=route) >= 1
    ttft = after["moe_runtime_time_to_first_token_seconds"]
    assert _value(ttft, "_count", route=route) >= 1


def test_metrics_show_each_moe_layer_backend_from_the_plan(http):
    plan = http.get("/v1/moe/plan").json()
    # an Info metric: the Prometheus text format writes it as a gauge named *_info, value 1
    info = _metrics(http)["moe_runtime_moe_layer_info"]
    assert all(s.value == 1 for s in info.samples)
    shown = {s.labels["layer"]: s.labels for s in info.samples}
    assert set(shown) == {lp["layer"] for lp in plan["layers"]}
    for lp in plan["layers"]:
        assert shown[lp["layer"]]["experts_backend"] == lp["experts"]
        assert shown[lp["layer"]]["communication_backend"] == lp["communication"]
        assert shown[lp["layer"]]["format"] == lp["format"]


def test_metrics_name_the_model(http, server):
    info = _metrics(http)["moe_runtime_model_info"]
    assert [s.labels["model"] for s in info.samples] == [server.model]


def test_metrics_say_decode_runs_eagerly_on_a_cpu_and_why(http, server):
    family = _metrics(http)["moe_runtime_decode_cuda_graphs"]
    assert family.type == "gauge"
    [sample] = family.samples
    assert sample.value == 0
    assert sample.labels["max_tokens"] == ""
    assert sample.labels["reason"] == "the model runs on cpu; CUDA graphs need a CUDA device"
    # the sentence the start-up log gives for the choice
    assert server.lines_with("CUDA graphs off: " + sample.labels["reason"])


def test_the_cuda_graphs_gauge_shows_the_capture_bound_when_on():
    from moe_runtime.serve.batching import GraphChoice
    from moe_runtime.serve.metrics import ServerMetrics

    metrics = ServerMetrics(model_name="m")
    metrics.describe_graphs(GraphChoice(False, "first", None))
    metrics.describe_graphs(GraphChoice(True, "decode replayed", 48))
    [family] = [f for f in text_string_to_metric_families(metrics.render().decode())
                if f.name == "moe_runtime_decode_cuda_graphs"]
    assert [(s.value, s.labels) for s in family.samples] == [
        (1.0, {"max_tokens": "48", "reason": "decode replayed"})]


def test_graph_captures_are_scraped_by_phase(http):
    """On a CPU server no step replays a graph: both phases read 0 captures and 0 seconds."""
    m = _metrics(http)
    for name in ("moe_runtime_cuda_graph_captures", "moe_runtime_cuda_graph_capture_seconds"):
        family = m[name]
        assert family.type == "counter"
        assert {s.labels["phase"]: s.value for s in family.samples
                if s.name == name + "_total"} == {"warmup": 0, "serving": 0}


def test_graph_captures_read_the_engine_at_each_scrape():
    from moe_runtime.serve.metrics import ServerMetrics, _GraphCaptureCollector

    class Engine:  # only what the collector reads
        graph_captures = {"warmup": 12, "serving": 0, "warmup_s": 3.5, "serving_s": 0.0}

    metrics = ServerMetrics(model_name="m")
    engine = Engine()
    metrics.registry.register(_GraphCaptureCollector(engine))

    def read():
        fams = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
        return ({s.labels["phase"]: s.value for s in fams["moe_runtime_cuda_graph_captures"].samples
                 if s.name.endswith("_total")},
                _value(fams["moe_runtime_cuda_graph_capture_seconds"], "_total", phase="serving"))

    assert read() == ({"warmup": 12, "serving": 0}, 0.0)
    engine.graph_captures = {"warmup": 12, "serving": 2, "warmup_s": 3.5, "serving_s": 0.75}
    assert read() == ({"warmup": 12, "serving": 2}, 0.75)
