"""How ``tune`` times a candidate: eagerly, and again as CUDA-graph replays where the call
captures and reproduces the eager output. On CPU the capture is a stand-in (no CUDA graphs);
the fallbacks record why a measurement is eager. On a CUDA device, a tiny triton layer is
recorded as graph-timed."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.backend_api import LayerProblem
from moe_runtime.environment import Environment
from moe_runtime.plugin.manager import get_plugin_manager
from moe_runtime.plugin.registry import Registry
from moe_runtime.tuning.command import print_results
from moe_runtime.tuning.measure import Timer, Timing, shapes_to_tune, tune

CPU = Environment("cpu", None, frozenset({"torch"}), "cpu")
P = LayerProblem("model.layers.0.mlp.experts", "bf16", "silu", 8, 2, 64, 32)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.from_plugin_manager(get_plugin_manager(autoload=False, environ={}))


@pytest.fixture(scope="module")
def shapes(registry):
    return shapes_to_tune([P], registry=registry, environment=CPU, tokens=[1, 8],
                          backends=["cpu_dequantized"])


class TwoTimes:
    """Runs each timed call once; reports ``eager`` for the first timing of a measurement and
    ``graph`` for the second (the replays), so the record shows which was used."""

    def __init__(self, eager: float = 300.0, graph: float = 20.0) -> None:
        self.eager, self.graph, self.calls = eager, graph, 0

    def __call__(self, fn, case) -> Timing:
        fn()
        self.calls += 1
        return Timing(self.eager if self.calls % 2 else self.graph, 4, "fake")


def stand_in_capture(wrong: bool = False):
    """A capture that 'replays' by doing nothing and hands back the eager outputs (or zeros)."""
    seen = []

    def capture(executor, batches, device):
        seen.append(len(batches))
        outs = [executor(*b) for b in batches]
        return [(lambda: None, torch.zeros_like(o) + 7 if wrong else o) for o in outs]

    return capture, seen


def test_on_cpu_every_measurement_is_eager_with_the_reason(registry, shapes):
    found = tune(shapes, [1, 8], registry=registry, device="cpu",
                 timer=Timer(warmup=1, repeats=3, budget_s=5.0))
    assert [m.timed for m in found] == ["eager: no CUDA graphs on cpu"] * 2
    assert all(m.eager_us == m.median_us and m.median_us > 0 for m in found)


def test_a_capture_that_raises_leaves_the_eager_time_and_says_why(registry, shapes):
    def capture(executor, batches, device):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    timer = TwoTimes()
    found = tune(shapes, [1], registry=registry, device="cpu", timer=timer, capture=capture)
    (m,) = found
    assert m.timed == ("eager: capture failed: RuntimeError: operation not permitted when "
                       "stream is capturing")
    assert m.median_us == m.eager_us == 300.0 and m.error is None and timer.calls == 1


def test_a_captured_call_is_recorded_as_graph_with_its_eager_time(registry, shapes):
    capture, seen = stand_in_capture()
    found = tune(shapes, [1, 8], registry=registry, device="cpu", timer=TwoTimes(),
                 capture=capture)
    assert seen == [3, 3]  # one graph per rotating input batch
    assert [(m.timed, m.median_us, m.eager_us) for m in found] == [("graph", 20.0, 300.0)] * 2


def test_a_replay_that_does_not_reproduce_the_eager_output_is_not_used(registry, shapes):
    capture, _ = stand_in_capture(wrong=True)
    (m,) = tune(shapes, [1], registry=registry, device="cpu", timer=TwoTimes(), capture=capture)
    assert m.timed.startswith("eager: a replay's output differs from the eager call's")
    assert m.median_us == 300.0


def test_batches_above_the_graph_bound_are_not_captured(registry, shapes):
    capture, seen = stand_in_capture()
    found = tune(shapes, [1, 8], registry=registry, device="cpu", timer=TwoTimes(),
                 capture=capture, graph_max_tokens=4)
    assert seen == [3]
    assert [m.timed for m in found] == [
        "graph", "eager: 8 tokens is above the graph bound of 4 (engines run such batches "
                 "eagerly)"]


def test_the_table_says_how_each_time_was_taken(registry, shapes, capsys):
    capture, _ = stand_in_capture()
    found = tune(shapes, [1, 8], registry=registry, device="cpu", timer=TwoTimes(),
                 capture=capture, graph_max_tokens=4)
    print_results(shapes, found)
    out = capsys.readouterr().out
    assert "     1 tokens: cpu_dequantized 20.0 us graph (eager 300.0 us)" in out
    assert ("     8 tokens: cpu_dequantized 300.0 us eager (8 tokens is above the graph bound "
            "of 4 (engines run such batches eagerly))") in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")
def test_triton_on_a_tiny_layer_is_timed_as_graph_replays():
    reg = Registry.from_plugin_manager(get_plugin_manager())
    if "triton" not in reg.experts:
        pytest.skip("the triton plugin is not installed")
    env = Environment.probe(device="cuda", modules=reg.required_modules())
    p = LayerProblem("model.layers.0.mlp.experts", "bf16", "silu", 8, 2, 256, 128)
    shapes = shapes_to_tune([p], registry=reg, environment=env, tokens=[1, 16],
                            backends=["triton"])
    assert shapes[0].plans, shapes[0].skipped
    found = tune(shapes, [1, 16], registry=reg, device="cuda",
                 timer=Timer(warmup=2, repeats=5, budget_s=5.0))
    assert [m.timed for m in found] == ["graph", "graph"], [m.timed for m in found]
    assert all(m.error is None and 0 < m.median_us and m.eager_us > 0 for m in found)


def test_replays_timed_at_zero_leave_the_eager_time_and_say_why(registry, shapes):
    capture, _ = stand_in_capture()
    (m,) = tune(shapes, [1], registry=registry, device="cpu", timer=TwoTimes(graph=0.0),
                capture=capture)
    assert m.median_us == m.eager_us == 300.0 and m.error is None
    assert m.timed == ("eager: replays: timer: median 0.0 us, not a positive time (below the "
                       "timer's resolution?)")


@pytest.mark.parametrize(("repeats", "budget_s", "per_call_s", "want"), [
    (20, 10.0, 0.001, 20),  # the budget holds every repeat
    (20, 10.0, 1.0, 10),    # the budget cuts
    (20, 10.0, 100.0, 3),   # ... but not below 3
    (1, 10.0, 0.001, 1),    # --repeats 1 times one call, not 3
    (2, 0.0, 1.0, 2),       # fewer than 3 asked: that many, whatever the budget
])
def test_timed_calls_never_exceed_the_repeats_asked(repeats, budget_s, per_call_s, want):
    assert Timer(warmup=1, repeats=repeats, budget_s=budget_s).timed_calls(per_call_s) == want
