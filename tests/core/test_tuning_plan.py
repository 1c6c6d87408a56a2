"""The planner with a tuning cache: measurements break ties between equally exact candidates at
the deployment's token bucket, and nothing else; without a cache the plan is the declared one."""

from __future__ import annotations

import argparse

import attrs
import pytest
import torch

from moe_runtime import ExpertsBackendSpec, Hardware, Support
from moe_runtime.backend_api import LayerProblem
from moe_runtime.environment import Environment
from moe_runtime.executor import MoEExecutor, build_executor
from moe_runtime.planner import (
    Deployment,
    ExpertsRange,
    LayerPlan,
    Plan,
    layer_candidates,
    plan_layer,
    plan_model,
)
from moe_runtime.reference_math import quantize_expert_weights, reference_fused_experts
from moe_runtime.testing.registries import registry_of
from moe_runtime.tuning.cache import (
    Measurement,
    Section,
    Tuning,
    cache_key,
    candidate_key,
    load_tuning,
    problem_key,
    write_sections,
)
from moe_runtime.tuning.command import tuning_for

CPU = Environment("cpu", None, frozenset({"torch"}), "cpu")
ANY = Hardware(devices=("cpu",))
FIRST = ExpertsBackendSpec(name="first", factory="m:C", priority=50,
                           supports=[Support(formats=["bf16", "nvfp4_w4a16"], hardware=ANY)])
SECOND = ExpertsBackendSpec(name="second", factory="m:C", priority=40,
                            supports=[Support(formats=["bf16", "nvfp4_w4a16"], hardware=ANY)])
# runs nvfp4_w4a4 only as w4a16 (a declared degradation), at the highest priority
DEGRADING = ExpertsBackendSpec(
    name="degrading", factory="m:C", priority=90,
    supports=[Support(formats=["nvfp4_w4a4"], runs_as="nvfp4_w4a16", hardware=ANY)])


def layer(fmt="bf16", name="model.layers.0.mlp.experts"):
    return LayerProblem(name, fmt, "silu", 8, 2, 64, 32)


registry_with = registry_of


SLOW = 10000.0  # the built-in backends' time where a test does not say


CPU_EAGER = "eager: no CUDA graphs on cpu"


def tuning_of(tmp_path, registry, p, times: dict[tuple[str, int], float], errors=(),
              missing=(), graphs=None) -> Tuning:
    """A cache file timing ``p``'s candidates as ``times`` says ((backend, tokens) -> us; the
    others at :data:`SLOW`, except ``missing``), written and read back as a plan would.
    ``graphs``: (backend, tokens) -> (timed, eager us) where a time is not an eager one on
    CPU (``times`` then holds the graph replay's)."""
    graphs = graphs or {}
    plans = layer_candidates(p, registry=registry, environment=CPU,
                             deployment=Deployment()).plans
    by_name = {lp.experts: lp for lp in plans}
    for t in {t for _, t in times}:
        for b in by_name:
            if (b, t) not in missing:
                times.setdefault((b, t), SLOW)
    ms = tuple(
        Measurement(problem_key(p, 1), candidate_key(by_name[b], t), t,
                    None if (b, t) in errors else us, 5, "wall_clock", "2026-12-03T10:00:00Z",
                    "forward: RuntimeError: boom" if (b, t) in errors else None,
                    *graphs.get((b, t), (CPU_EAGER, None)))
        for (b, t), us in times.items())
    path = tmp_path / "tuning.json"
    write_sections(path, [Section(cache_key(CPU, registry), CPU.to_json(), ms)])
    tuning = load_tuning(path, CPU, registry)
    assert tuning.cache is not None, tuning.notes
    return tuning


def plan(p, registry, tuning=None, **dep):
    lp, _ = plan_layer(p, registry=registry, environment=CPU, deployment=Deployment(**dep),
                       tuning=tuning)
    return lp


def test_without_a_cache_the_declared_priority_decides():
    reg = registry_with(FIRST, SECOND)
    assert plan(layer(), reg).experts == "first"
    assert plan(layer(), reg, Tuning()) == plan(layer(), reg)


def test_a_tie_is_broken_by_the_measured_fastest(tmp_path):
    reg = registry_with(FIRST, SECOND)
    tuning = tuning_of(tmp_path, reg, layer(), {("first", 4096): 90.0, ("second", 4096): 30.0,
                                                 ("reference", 4096): 900.0})
    lp = plan(layer(), reg, tuning)
    assert lp.experts == "second"
    assert lp.alternatives == ("first", "cpu_dequantized", "reference")
    assert lp.notes[-1] == (
        f"chosen by measurement (cache {tmp_path / 'tuning.json'}, measured 2026-12-03): "
        "second 30.0 us, first 90.0 us, reference 900.0 us, cpu_dequantized 10000.0 us at 4096 tokens "
        "per rank, eager calls (no CUDA graphs on cpu)")


def test_a_measurement_that_agrees_with_the_declaration_keeps_it_and_says_so(tmp_path):
    reg = registry_with(FIRST, SECOND)
    tuning = tuning_of(tmp_path, reg, layer(), {("first", 4096): 10.0, ("second", 4096): 30.0,
                                                 ("reference", 4096): 900.0})
    lp = plan(layer(), reg, tuning)
    assert lp.experts == "first" and lp.notes[-1].startswith("chosen by measurement")


def test_the_deployments_token_bucket_decides(tmp_path):
    reg = registry_with(FIRST, SECOND)
    times = {("first", 16): 5.0, ("second", 16): 9.0, ("reference", 16): 99.0,
             ("first", 4096): 90.0, ("second", 4096): 30.0, ("reference", 4096): 999.0}
    tuning = tuning_of(tmp_path, reg, layer(), times)
    assert plan(layer(), reg, tuning, max_tokens_per_rank=16).experts == "first"
    assert plan(layer(), reg, tuning, max_tokens_per_rank=1).experts == "first"  # next above
    assert plan(layer(), reg, tuning, max_tokens_per_rank=17).experts == "second"
    assert plan(layer(), reg, tuning, max_tokens_per_rank=10000).experts == "second"  # largest


def test_a_degraded_candidate_is_not_preferred_over_an_exact_one_however_fast(tmp_path):
    reg = registry_with(DEGRADING, FIRST)  # FIRST does not run w4a4; the reference runs it exact
    p = layer("nvfp4_w4a4")
    tuning = tuning_of(tmp_path, reg, p, {("degrading", 4096): 500.0, ("reference", 4096): 1.0})
    lp = plan(p, reg, tuning)
    assert lp.experts == "degrading" and lp.runs_as == "nvfp4_w4a16"
    # the measurement chose among the plans that run the weights as w4a16 only
    assert lp.notes[-1].endswith("degrading 500.0 us, cpu_dequantized 10000.0 us at 4096 tokens "
                                 "per rank, eager calls (no CUDA graphs on cpu)")


def test_a_pinned_backend_is_not_overridden_by_measurement(tmp_path):
    reg = registry_with(FIRST, SECOND)
    tuning = tuning_of(tmp_path, reg, layer(), {("first", 4096): 90.0, ("second", 4096): 1.0,
                                                 ("reference", 4096): 900.0})
    assert plan(layer(), reg, tuning, experts_backend="first").experts == "first"


def test_tied_plans_left_unmeasured_take_no_part(tmp_path):
    reg = registry_with(FIRST, SECOND)
    tuning = tuning_of(tmp_path, reg, layer(), {("first", 4096): 90.0, ("second", 4096): 50.0},
                       missing={("reference", 4096)})
    lp = plan(layer(), reg, tuning)
    assert lp.experts == "second"
    assert lp.notes[-1].endswith("second 50.0 us, first 90.0 us, cpu_dequantized 10000.0 us at "
                                 "4096 tokens per rank, eager calls (no CUDA graphs on cpu) "
                                 "(not measured: reference)")


def test_an_unmeasured_declared_choice_stands_with_a_note(tmp_path):
    reg = registry_with(FIRST, SECOND)
    tuning = tuning_of(tmp_path, reg, layer(), {("second", 4096): 1.0},
                       missing={("first", 4096)})
    lp = plan(layer(), reg, tuning)
    assert lp.experts == "first"
    assert lp.notes[-1] == (f"declared priority decides; cache {tmp_path / 'tuning.json'} has no "
                            "measurement of first at 4096 tokens per rank")


def test_a_failed_measurement_of_the_declared_choice_keeps_it(tmp_path):
    reg = registry_with(FIRST, SECOND)
    tuning = tuning_of(tmp_path, reg, layer(), {("first", 4096): 90.0, ("second", 4096): 1.0},
                       errors={("first", 4096)})
    lp = plan(layer(), reg, tuning)
    assert lp.experts == "first" and "a failed measurement (forward: RuntimeError: boom)" in (
        lp.notes[-1])


def test_a_failed_measurement_of_another_plan_takes_no_part(tmp_path):
    reg = registry_with(FIRST, SECOND)
    tuning = tuning_of(tmp_path, reg, layer(), {("first", 4096): 90.0, ("second", 4096): 1.0},
                       errors={("second", 4096)})
    lp = plan(layer(), reg, tuning)
    assert lp.experts == "first" and lp.notes[-1].endswith("(not measured: second)")


def test_another_layer_shape_is_not_measured_by_this_one(tmp_path):
    reg = registry_with(FIRST, SECOND)
    tuning = tuning_of(tmp_path, reg, layer(), {("first", 16): 90.0, ("second", 16): 1.0,
                                                 ("reference", 16): 9.0})
    other = LayerProblem("model.layers.1.mlp.experts", "bf16", "silu", 8, 2, 128, 32)
    lp = plan(other, reg, tuning)
    assert lp.experts == "first" and lp.notes[-1].endswith("has no measurement of this layer "
                                                            "shape")


def test_layers_of_one_shape_share_measurements_and_the_plan_carries_the_cache_note(tmp_path):
    reg = registry_with(FIRST, SECOND)
    tuning = tuning_of(tmp_path, reg, layer(), {("first", 4096): 90.0, ("second", 4096): 1.0,
                                                 ("reference", 4096): 9.0})
    problems = [layer(name=f"model.layers.{i}.mlp.experts") for i in range(3)]
    p = plan_model(problems, registry=reg, environment=CPU, tuning=tuning)
    assert [lp.experts for lp in p.layers] == ["second"] * 3
    assert p.notes == tuning.notes
    assert type(p).from_json(p.to_json()) == p


def test_an_ignored_cache_leaves_the_layers_as_declared(tmp_path):
    reg = registry_with(FIRST, SECOND)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    tuning = load_tuning(bad, CPU, reg)
    problems = [layer(name=f"model.layers.{i}.mlp.experts") for i in range(2)]
    with_note = plan_model(problems, registry=reg, environment=CPU, tuning=tuning)
    declared = plan_model(problems, registry=reg, environment=CPU)
    assert with_note.layers == declared.layers and with_note.rejections == declared.rejections
    assert with_note.notes == tuning.notes and declared.notes == ()


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4_w4a16"])
def test_rejections_of_a_measured_choice_are_the_declared_choices_here(tmp_path, fmt):
    reg = registry_with(FIRST, SECOND)
    p = layer(fmt)
    tuning = tuning_of(tmp_path, reg, p, {("first", 4096): 90.0, ("second", 4096): 1.0,
                                          ("reference", 4096): 9.0})
    _, declared = plan_layer(p, registry=reg, environment=CPU, deployment=Deployment())
    _, measured = plan_layer(p, registry=reg, environment=CPU, deployment=Deployment(),
                             tuning=tuning)
    assert measured == declared  # the same backends were turned down, for the same reasons


# ------------------------------------------------------- how each candidate was timed


def test_graph_replays_are_compared_by_their_medians(tmp_path):
    reg = registry_with(FIRST, SECOND)
    graphs = {("first", 16): ("graph", 200.0), ("second", 16): ("graph", 150.0),
              ("reference", 16): ("graph", 900.0), ("cpu_dequantized", 16): ("graph", 950.0)}
    tuning = tuning_of(tmp_path, reg, layer(), {("first", 16): 20.0, ("second", 16): 40.0},
                       graphs=graphs)
    lp = plan(layer(), reg, tuning, max_tokens_per_rank=16)
    # eagerly second is faster (150 against 200 us); replayed, as decode runs, first is
    assert lp.experts == "first"
    assert lp.notes[-1].endswith("first 20.0 us, second 40.0 us, cpu_dequantized 10000.0 us, "
                                 "reference 10000.0 us at 16 tokens per rank, CUDA-graph "
                                 "replays")


def test_a_mix_of_graph_and_eager_times_is_compared_eager_like_with_like(tmp_path):
    reg = registry_with(FIRST, SECOND)
    graphs = {("first", 16): ("graph", 300.0)}  # first replays in 20 us, 300 us eagerly
    tuning = tuning_of(tmp_path, reg, layer(), {("first", 16): 20.0, ("second", 16): 250.0},
                       graphs=graphs, missing={("reference", 16), ("cpu_dequantized", 16)})
    lp = plan(layer(), reg, tuning, max_tokens_per_rank=16)
    # 20 us of replay against 250 us of an eager call would compare host launch work; the
    # eager times (300 against 250 us) are the same kind of time
    assert lp.experts == "second"
    assert lp.notes[-1].endswith(
        "second 250.0 us, first 300.0 us at 16 tokens per rank, eager calls compared, like with "
        "like (second: no CUDA graphs on cpu; replayed from a CUDA graph: first 20.0 us) "
        "(not measured: cpu_dequantized, reference)")


def test_eager_reasons_are_grouped_in_the_note(tmp_path):
    reg = registry_with(FIRST, SECOND)
    graphs = {("first", 16): ("eager: capture failed: RuntimeError: sync", None)}
    tuning = tuning_of(tmp_path, reg, layer(), {("first", 16): 20.0, ("second", 16): 40.0},
                       graphs=graphs, missing={("reference", 16), ("cpu_dequantized", 16)})
    lp = plan(layer(), reg, tuning, max_tokens_per_rank=16)
    assert lp.experts == "first"
    assert "eager calls (first: capture failed: RuntimeError: sync; second: no CUDA graphs on " \
           "cpu)" in lp.notes[-1]


# ------------------------------------------------------------------------------------------------
# --token-ranges: an experts backend per measured batch size, where another backend on the same
# path is measured faster than the layer's choice there; the executor runs each batch on the
# backend its size maps to, and the plan says so. Without the flag nothing changes.


def ranged(t: Tuning, margin=0.05) -> Tuning:
    return attrs.evolve(t, token_ranges=True, range_margin=margin)


# first wins the large batches (the deployment's bucket), second the small ones
TIMES = {("first", 1): 9.0, ("second", 1): 3.0, ("first", 16): 10.0, ("second", 16): 4.0,
         ("first", 128): 20.0, ("second", 128): 30.0, ("first", 4096): 90.0,
         ("second", 4096): 300.0}


def test_without_the_flag_one_backend_serves_every_batch(tmp_path):
    reg = registry_with(FIRST, SECOND)
    lp = plan(layer(), reg, tuning_of(tmp_path, reg, layer(), dict(TIMES)))
    assert lp.experts == "first" and lp.experts_by_tokens == ()
    assert lp.experts_for(1) == "first"


def test_small_batches_run_on_the_backend_measured_faster_there(tmp_path):
    reg = registry_with(FIRST, SECOND)
    lp = plan(layer(), reg, ranged(tuning_of(tmp_path, reg, layer(), dict(TIMES))))
    assert lp.experts == "first"  # the deployment's bucket (4096) decides the plan's own
    assert [(r.max_tokens_per_rank, r.experts) for r in lp.experts_by_tokens] == [(16, "second")]
    assert [lp.experts_for(n) for n in (1, 16, 17, 128, 5000)] == [
        "second", "second", "first", "first", "first"]
    assert lp.experts_backends == ("first", "second")
    note = lp.notes[-1]
    assert note.startswith("experts backend by batch size, chosen by measurement")
    assert "1-16 tokens per rank on second, larger batches on first" in note
    assert "held side by side" in note
    assert "second 4.0 us, first 10.0 us at 16 tokens" in lp.experts_by_tokens[0].note
    # the plan's JSON carries the ranges
    assert LayerPlan.from_json(lp.to_json()) == lp


def test_a_bucket_won_by_the_plans_own_backend_splits_the_ranges(tmp_path):
    reg = registry_with(FIRST, SECOND)
    times = {**TIMES, ("first", 16): 3.0, ("second", 16): 9.0,
             ("first", 128): 50.0, ("second", 128): 20.0}
    lp = plan(layer(), reg, ranged(tuning_of(tmp_path, reg, layer(), times)))
    assert [(r.max_tokens_per_rank, r.experts) for r in lp.experts_by_tokens] == [
        (1, "second"), (16, "first"), (128, "second")]
    assert [lp.experts_for(n) for n in (1, 2, 16, 17, 128, 129)] == [
        "second", "first", "first", "second", "second", "first"]


def test_a_win_within_the_margin_is_noise(tmp_path):
    reg = registry_with(FIRST, SECOND)
    times = {**TIMES, ("second", 1): 8.8, ("second", 16): 9.7}  # 2-3% faster than first
    lp = plan(layer(), reg, ranged(tuning_of(tmp_path, reg, layer(), times)))
    assert lp.experts_by_tokens == ()
    assert "no other backend measured more than 5% faster than first below 4096" in lp.notes[-1]
    lp = plan(layer(), reg, ranged(tuning_of(tmp_path, reg, layer(), times), margin=0.01))
    assert [r.experts for r in lp.experts_by_tokens] == ["second"]


def test_a_bucket_where_the_plans_own_backend_was_not_measured_keeps_it(tmp_path):
    reg = registry_with(FIRST, SECOND)
    lp = plan(layer(), reg, ranged(tuning_of(tmp_path, reg, layer(), dict(TIMES),
                                             errors={("first", 16)})))
    assert [(r.max_tokens_per_rank, r.experts) for r in lp.experts_by_tokens] == [(1, "second")]


def test_a_pinned_backend_has_no_ranges(tmp_path):
    reg = registry_with(FIRST, SECOND)
    lp = plan(layer(), reg, ranged(tuning_of(tmp_path, reg, layer(), dict(TIMES))),
              experts_backend="first")
    assert lp.experts_by_tokens == () and "no other backend" in lp.notes[-1]


def test_the_command_line_flag(tmp_path):
    reg = registry_with(FIRST, SECOND)
    tuning_of(tmp_path, reg, layer(), dict(TIMES))  # writes tmp_path / tuning.json
    args = argparse.Namespace(tuning_cache=str(tmp_path / "tuning.json"), token_ranges=True)
    t = tuning_for(args, CPU, reg)
    assert t.token_ranges and t.cache is not None
    args = argparse.Namespace(tuning_cache="none", token_ranges=True)
    t = tuning_for(args, CPU, reg)
    assert not t.token_ranges and "no usable tuning cache" in t.notes[-1]


def test_ranges_from_json_are_checked():
    with pytest.raises(ValueError, match="max_tokens_per_rank is 0; accepted: a positive"):
        ExpertsRange.from_json({"max_tokens_per_rank": 0, "experts": "x"})
    with pytest.raises(ValueError, match="prepared_bytes_per_weight is -1"):
        ExpertsRange.from_json({"max_tokens_per_rank": 4, "experts": "x",
                                "prepared_bytes_per_weight": -1})


# ------------------------------------------------------------------ the executor, real backends


def _ranged_plan(tmp_path, ep_size=1):
    """The built-in backends on CPU: the reference measured fastest up to 16 tokens,
    cpu_dequantized (declared first) at the rest."""
    reg = registry_of()
    p = LayerProblem("model.layers.0.mlp.experts", "nvfp4_w4a16", "silu", 8, 2, 64, 32,
                     dtype="float32")
    times = {("reference", 16): 10.0, ("cpu_dequantized", 16): 50.0,
             ("reference", 4096): 900.0, ("cpu_dequantized", 4096): 100.0}
    t = ranged(tuning_of(tmp_path, reg, p, times))
    plan_ = plan_model([p], registry=reg, environment=CPU, tuning=t,
                       deployment=Deployment(ep_size=ep_size))
    return reg, plan_.layers[0]


def test_the_executor_runs_each_batch_on_its_ranges_backend(tmp_path):
    reg, lp = _ranged_plan(tmp_path)
    assert lp.experts == "cpu_dequantized"
    assert [(r.max_tokens_per_rank, r.experts) for r in lp.experts_by_tokens] == [
        (16, "reference")]
    gen = torch.Generator().manual_seed(0)
    weights = quantize_expert_weights(torch.randn(8, 64, 64, generator=gen) / 8,
                                      torch.randn(8, 64, 32, generator=gen) / 6,
                                      "nvfp4_w4a16", "silu")
    ex = build_executor(lp, reg, weights)
    for n, backend in ((1, "ReferenceExperts"), (16, "ReferenceExperts"),
                       (17, "CpuDequantizedExperts"), (300, "CpuDequantizedExperts")):
        assert type(ex.path_for(n)[2]).__name__ == backend, n
        x = torch.randn(n, 64, generator=gen)
        ids = torch.rand(n, 8, generator=gen).topk(2, -1).indices.int()
        w = torch.softmax(torch.randn(n, 2, generator=gen), -1)
        torch.testing.assert_close(ex(x, ids, w), reference_fused_experts(x, ids, w, weights),
                                   rtol=1e-5, atol=1e-5)
    # an engine's bound decides over the local batch
    assert type(ex._path(torch.zeros(2, 64), 4096)[2]).__name__ == "CpuDequantizedExperts"
    # a hand-made executor without the ranges' backends is refused by name
    with pytest.raises(ValueError, match="runs some batch sizes on reference"):
        MoEExecutor(lp, ex.paths, weights)


def test_under_expert_parallelism_without_a_bound_every_rank_takes_the_plans_own(tmp_path):
    reg, lp = _ranged_plan(tmp_path)
    weights = quantize_expert_weights(torch.randn(8, 64, 64) / 8, torch.randn(8, 64, 32) / 6,
                                      "nvfp4_w4a16", "silu")
    ex = build_executor(lp, reg, weights)
    ex.ep_size = 2  # the rule alone: a rank's local batch size is not agreed with the others
    assert type(ex._path(torch.zeros(3, 64), None)[2]).__name__ == "CpuDequantizedExperts"
    assert type(ex._path(torch.zeros(3, 64), 3)[2]).__name__ == "ReferenceExperts"


def test_a_plan_with_ranges_survives_json(tmp_path):
    reg, lp = _ranged_plan(tmp_path)
    p = Plan((lp,), (), CPU, Deployment())
    assert Plan.from_json(p.to_json()) == p


def test_ranks_agree_on_the_ranges_not_on_their_notes(tmp_path):
    from moe_runtime.agreement import first_difference, plan_fields

    reg, lp = _ranged_plan(tmp_path)
    a = Plan((lp,), (), CPU, Deployment())
    reworded = attrs.evolve(lp, experts_by_tokens=tuple(
        attrs.evolve(r, note="other times") for r in lp.experts_by_tokens))
    b = Plan((reworded,), (), CPU, Deployment())
    assert first_difference({0: plan_fields(a, reg), 1: plan_fields(b, reg)}) is None
    moved = attrs.evolve(lp, experts_by_tokens=(attrs.evolve(lp.experts_by_tokens[0],
                                                             max_tokens_per_rank=8),))
    c = Plan((moved,), (), CPU, Deployment())
    field, _ = first_difference({0: plan_fields(a, reg), 1: plan_fields(c, reg)})
    assert field.endswith("experts_by_tokens")
