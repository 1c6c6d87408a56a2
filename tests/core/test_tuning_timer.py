"""The tuner's timer on CPU (warm-up calls first, the median of the timed ones, fewer repeats but
at least 3 where the budget would be spent), one shape per distinct layer, and random experts
quantized in chunks joining into the layer quantized whole."""

from __future__ import annotations

import time

import pytest

from moe_runtime.backend_api import ExpertWeights, LayerProblem
from moe_runtime.tuning.measure import Timer, TuneCase, distinct_problems, join_experts

CASE = TuneCase(plan=None, tokens=1, device="cpu")


def counting(pause: float = 0.0):
    calls = []

    def fn():
        calls.append(1)
        if pause:
            time.sleep(pause)

    return fn, calls


def test_warmup_then_every_repeat_when_calls_are_cheap():
    fn, calls = counting()
    timing = Timer(warmup=2, repeats=7, budget_s=10.0)(fn, CASE)
    assert len(calls) == 2 + 7
    assert timing.repeats == 7 and timing.timer == "wall_clock" and timing.median_us > 0


def test_a_slow_call_gets_the_fewest_repeats_the_budget_allows_but_at_least_three():
    fn, calls = counting(pause=0.05)
    timing = Timer(warmup=1, repeats=20, budget_s=0.1)(fn, CASE)
    assert timing.repeats == 3 and len(calls) == 1 + 3
    assert timing.median_us >= 0.05e6


def test_the_median_is_taken_not_the_mean():
    pauses = iter([0.0] + [0.001, 0.001, 0.2])  # one warm-up call, then one outlier among three

    def fn():
        time.sleep(next(pauses))

    timing = Timer(warmup=1, repeats=3, budget_s=100.0)(fn, CASE)
    assert timing.median_us < 0.1e6


def test_layers_of_one_shape_are_tuned_once():
    a = LayerProblem("model.layers.0.mlp.experts", "bf16", "silu", 8, 2, 64, 32)
    b = LayerProblem("model.layers.1.mlp.experts", "bf16", "silu", 8, 2, 64, 32)
    c = LayerProblem("model.layers.2.mlp.experts", "bf16", "silu", 8, 2, 128, 32)
    assert distinct_problems([a, b, c]) == [a, c]


def test_experts_quantized_in_chunks_join_into_one_layer():
    torch = pytest.importorskip("torch")
    from moe_runtime.reference_math import quantize_expert_weights

    w13, w2 = torch.randn(4, 64, 32), torch.randn(4, 32, 32)
    whole = quantize_expert_weights(w13, w2, "nvfp4_w4a4", "silu", a13_amax=4.0, a2_amax=4.0)
    parts = [quantize_expert_weights(w13[i:i + 2], w2[i:i + 2], "nvfp4_w4a4", "silu",
                                     a13_amax=4.0, a2_amax=4.0) for i in (0, 2)]
    joined = join_experts(parts)
    assert isinstance(joined, ExpertWeights) and joined.num_experts == 4
    for name in ("w13", "w2", "w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2", "a13_scale",
                 "a2_scale"):
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
