"""Prometheus metrics of one server, in a registry of its own (two apps in a process never mix).

Two families: ``moe_runtime_*`` (HTTP routes, the served model and each MoE layer's backends) and
the series a vLLM dashboard reads, under vLLM's names and with its ``model_name`` label
(``vllm:num_requests_running``, ``vllm:time_to_first_token_seconds``...; docs/serve.md lists them).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                      0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)


class _GraphCaptureCollector:
    """``moe_runtime_cuda_graph_captures_total`` and ``..._capture_seconds_total`` by phase
    (``warmup``, ``serving``), read from the engine at each scrape: a capture while serving is a
    step shape that warm-up did not reach, and its batch waited for it."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def collect(self):
        counts = getattr(self._engine, "graph_captures", None) or {}
        captures = CounterMetricFamily(
            "moe_runtime_cuda_graph_captures", "CUDA graphs captured, by phase (warmup: at "
            "start-up; serving: a step shape first seen while serving)", labels=["phase"])
        seconds = CounterMetricFamily(
            "moe_runtime_cuda_graph_capture_seconds", "seconds spent capturing CUDA graphs "
            "(each step's eager run included), by phase", labels=["phase"])
        for phase in ("warmup", "serving"):
            captures.add_metric([phase], counts.get(phase, 0))
            seconds.add_metric([phase], counts.get(f"{phase}_s", 0.0))
        yield captures
        yield seconds


class ServerMetrics:
    """Requests, tokens and latencies, plus what the server runs (model and per-layer plan)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, *, model_name: str) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.requests = Counter("moe_runtime_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.in_progress = Gauge("moe_runtime_requests_in_progress",
                                 "generation requests being served now", registry=r)
        self.request_latency = Histogram("moe_runtime_request_latency_seconds",
                                         "time from request to the end of the response",
                                         ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.first_token_latency = Histogram("moe_runtime_time_to_first_token_seconds",
                                             "time from submission to the first generated token",
                                             ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("moe_runtime_prompt_tokens", "prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("moe_runtime_generation_tokens", "tokens generated",
                                         registry=r)
        self.prompt_length = Histogram("moe_runtime_request_prompt_tokens",
                                       "prompt length per request", buckets=_TOKEN_BUCKETS,
                                       registry=r)
        self.generation_length = Histogram("moe_runtime_request_generation_tokens",
                                           "generated tokens per request", buckets=_TOKEN_BUCKETS,
                                           registry=r)
        self.batch_sequences = Histogram("moe_runtime_batch_sequences",
                                         "sequences given a token by one forward step (the "
                                         "continuous batch's width)",
                                         buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
                                         registry=r)
        self.finished = Counter("moe_runtime_request_finish", "finished generations by reason",
                                ["reason"], registry=r)
        self._model_info = Info("moe_runtime_model", "the served model", registry=r)
        self._model_info.info({"model": model_name, "loader": "", "dtype": "", "device": ""})
        self._layer_info = Info("moe_runtime_moe_layer", "the plan's backends for each MoE layer",
                                ["layer"], registry=r)
        self.cuda_graphs = Gauge("moe_runtime_decode_cuda_graphs",
                                 "1 if decode steps replay CUDA graphs, else 0; max_tokens: the "
                                 "largest captured decode batch, reason: why on or off",
                                 ["max_tokens", "reason"], registry=r)
        self._vllm_series(r)

    def _vllm_series(self, r: CollectorRegistry) -> None:
        m = ["model_name"]
        self.running = Gauge("vllm:num_requests_running",
                             "requests that have had their first token and are not finished", m,
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting",
                             "requests submitted that have had no token yet", m, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc",
                              "fraction of the KV cache held by unfinished requests (0 to 1)", m,
                              registry=r)
        for gauge in (self.running, self.waiting, self.kv_usage):
            gauge.labels(model_name=self.model_name).set(0)
        self.v_prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens processed", m,
                                       registry=r)
        self.v_generation_tokens = Counter("vllm:generation_tokens", "tokens generated", m,
                                           registry=r)
        self.v_success = Counter("vllm:request_success", "finished requests by reason",
                                 [*m, "finished_reason"], registry=r)
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds",
                                "time from submission to the first token", m,
                                buckets=_LATENCY_BUCKETS, registry=r)
        self.v_itl = Histogram("vllm:inter_token_latency_seconds",
                               "time between a request's successive tokens", m,
                               buckets=_TOKEN_GAP_BUCKETS, registry=r)
        self.v_tpot = Histogram("vllm:request_time_per_output_token_seconds",
                                "a request's decode time per token after the first", m,
                                buckets=_TOKEN_GAP_BUCKETS, registry=r)
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds",
                               "time from submission to the last token", m,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.v_prompt_len = Histogram("vllm:request_prompt_tokens", "prompt tokens per request",
                                      m, buckets=_TOKEN_BUCKETS, registry=r)
        self.v_generation_len = Histogram("vllm:request_generation_tokens",
                                          "generated tokens per request", m,
                                          buckets=_TOKEN_BUCKETS, registry=r)

    def describe_engine(self, engine) -> None:
        """Read the engine's plan and live counts (called once the model is loaded)."""
        plan = engine.loaded.plan_json()
        self._model_info.info({
            "model": self.model_name,
            "loader": str(plan.get("loader", "")),
            "dtype": str(plan.get("dtype", "")),
            "device": str(plan.get("device", plan.get("environment", {}).get("device", ""))),
        })
        for lp in plan.get("layers", []):
            self._layer_info.labels(layer=str(lp.get("layer"))).info({
                "format": str(lp.get("format", "")),
                "experts_backend": str(lp.get("experts", "")),
                "communication_backend": str(lp.get("communication", "")),
                "runs_as": str(lp.get("runs_as", "")),
            })
        graphs = getattr(engine.batching, "graphs", None)
        if graphs is not None:
            self.describe_graphs(graphs)
        self.registry.register(_GraphCaptureCollector(engine))
        label = {"model_name": self.model_name}
        self.running.labels(**label).set_function(lambda: engine.num_running)
        self.waiting.labels(**label).set_function(lambda: engine.num_waiting)
        self.kv_usage.labels(**label).set_function(lambda: engine.kv_cache_usage)

    def describe_graphs(self, graphs) -> None:
        """Whether decode replays CUDA graphs (a :class:`~moe_runtime.serve.batching.GraphChoice`)."""
        self.cuda_graphs.clear()
        size = "" if graphs.max_tokens is None else str(graphs.max_tokens)
        self.cuda_graphs.labels(max_tokens=size, reason=graphs.reason).set(1 if graphs.on else 0)

    def finished_http(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.request_latency.labels(route=route).observe(seconds)

    def finished_request(self, *, route: str, prompt_tokens: int, completion_tokens: int,
                         reason: str, first_token_s: float | None, seconds: float) -> None:
        """One generated choice ended (its prompt, tokens, reason and timings); its tokens were
        counted as they came (:meth:`tokens_generated`)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_length.observe(prompt_tokens)
        self.generation_length.observe(completion_tokens)
        self.finished.labels(reason=reason).inc()
        label = {"model_name": self.model_name}
        self.v_prompt_tokens.labels(**label).inc(prompt_tokens)
        self.v_prompt_len.labels(**label).observe(prompt_tokens)
        self.v_generation_len.labels(**label).observe(completion_tokens)
        self.v_success.labels(**label, finished_reason=reason).inc()
        self.v_e2e.labels(**label).observe(seconds)
        if first_token_s is not None:
            self.first_token_latency.labels(route=route).observe(first_token_s)
            self.v_ttft.labels(**label).observe(first_token_s)
            if completion_tokens > 1:
                self.v_tpot.labels(**label).observe(
                    max(0.0, seconds - first_token_s) / (completion_tokens - 1))

    def tokens_generated(self, seconds: float | None, tokens: int) -> None:
        """``tokens`` new tokens of one request, ``seconds`` after its previous ones (None: its
        first). The token counters grow here, as the tokens come, so that a scrape during a long
        generation sees it (vLLM counts them per engine step too), not only once it ends."""
        self.generation_tokens.inc(tokens)
        self.v_generation_tokens.labels(model_name=self.model_name).inc(tokens)
        if seconds is None:
            return
        child = self.v_itl.labels(model_name=self.model_name)
        for _ in range(min(tokens, 64)):
            child.observe(seconds / tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
