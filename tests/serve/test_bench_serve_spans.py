"""benchmarks/bench_serve.py's step profiler wraps the engine's sampler without changing its calls."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_serve_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Sampler:
    """The two methods the profiler wraps, with the engine sampler's signatures."""

    def __init__(self):
        self.calls = []

    def rows_for(self, keys):
        return torch.tensor(keys)

    def sample(self, logits, rows, buffer=None):
        self.calls.append(buffer)
        return logits.argmax(-1)


def test_the_profiler_passes_every_argument_of_a_sample_call_through():
    """On CUDA the continuous-batching path calls ``sample(scores, rows, buffer=...)``; the
    profiler's wrapper once took two arguments and failed the 2026-12-07 H100 profile."""
    bench = _bench()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    sampler = _Sampler()
    spans = bench._Spans(model, sampler)
    rows = sampler.rows_for([0, 1])
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    buffer = torch.zeros(1)
    assert sampler.sample(logits, rows, buffer=buffer).tolist() == [1, 0]
    assert sampler.sample(logits, rows).tolist() == [1, 0]
    assert sampler.calls == [buffer, None]
    out = spans.close()
    assert out["steps"] == 1 and out["sampler_ms"] is not None
    # closing restores the sampler's own methods
    assert sampler.sample.__func__ is _Sampler.sample
