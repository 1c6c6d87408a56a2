"""Prometheus metrics of one server, in a registry of its own (two apps in a process never mix)."""

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

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)


class ServerMetrics:
    """Requests, tokens and latencies, plus what the server runs (model and per-layer plan)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, *, model_name: str, plan: dict) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
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

        model = Info("moe_runtime_model", "the served model", registry=r)
        model.info({
            "model": model_name,
            "loader": str(plan.get("loader", "")),
            "dtype": str(plan.get("dtype", "")),
            "device": str(plan.get("device", plan.get("environment", {}).get("device", ""))),
        })
        layer = Info("moe_runtime_moe_layer", "the plan's backends for each MoE layer",
                     ["layer"], registry=r)
        for lp in plan.get("layers", []):
            layer.labels(layer=str(lp.get("layer"))).info({
                "format": str(lp.get("format", "")),
                "experts_backend": str(lp.get("experts", "")),
                "communication_backend": str(lp.get("communication", "")),
                "runs_as": str(lp.get("runs_as", "")),
            })

    def render(self) -> bytes:
        return generate_latest(self.registry)
