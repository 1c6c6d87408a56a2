"""Plan agreement with tuning caches: ranks whose decisions are equal agree whatever cache each
read (a note on how a tie was settled is no decision); ranks whose caches made them decide
differently stop with the field that differs and a hint at the caches."""

from __future__ import annotations

import attrs
import pytest

from moe_runtime.agreement import PlanMismatchError, compare, plan_fields
from moe_runtime.backend_api import LayerProblem
from moe_runtime.environment import Environment
from moe_runtime.planner import Deployment, layer_candidates, plan_model
from moe_runtime.plugin.manager import get_plugin_manager
from moe_runtime.plugin.registry import Registry
from moe_runtime.tuning.cache import (
    Measurement,
    Section,
    cache_key,
    candidate_key,
    load_tuning,
    problem_key,
    write_sections,
)

CPU = Environment("cpu", None, frozenset({"torch"}), "cpu")
P = LayerProblem("model.layers.0.mlp.experts", "bf16", "silu", 8, 2, 64, 32)
EP2 = Deployment(ep_size=2, max_tokens_per_rank=16)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.from_plugin_manager(get_plugin_manager(autoload=False, environ={}))


def cache(path, registry, times: dict[str, float], ep_size: int):
    plans = layer_candidates(P, registry=registry, environment=CPU, deployment=EP2).plans
    assert {"reference", "cpu_dequantized"} <= {lp.experts for lp in plans}
    ms = tuple(Measurement(problem_key(P, ep_size), candidate_key(lp, 16), 16,
                           times[lp.experts], 5, "wall_clock", "2026-12-01T00:00:00Z")
               for lp in plans if lp.experts in times)
    write_sections(path, [Section(cache_key(CPU, registry), CPU.to_json(), ms)])
    return load_tuning(path, CPU, registry)


def plan(registry, tuning=None):
    return plan_model([P], registry=registry, environment=CPU, deployment=EP2, tuning=tuning)


def test_a_cache_on_one_rank_only_that_decides_nothing_does_not_stop_the_ranks(tmp_path,
                                                                              registry):
    # tune measures a local layer (ep_size 1): under EP 2 the cache settles nothing, it only notes
    tuning = cache(tmp_path / "t.json", registry, {"reference": 5.0, "cpu_dequantized": 80.0}, 1)
    with_cache, without = plan(registry, tuning), plan(registry)
    assert with_cache.layers[0].experts == without.layers[0].experts
    assert with_cache.layers[0].notes[-1].endswith(
        "has no measurement of this layer shape at ep_size 2 (it measured this shape at "
        "ep_size 1)")
    compare({0: plan_fields(with_cache, registry), 1: plan_fields(without, registry)})


def test_the_same_measurements_at_two_paths_agree(tmp_path, registry):
    times = {"reference": 5.0, "cpu_dequantized": 80.0}
    a = plan(registry, cache(tmp_path / "a.json", registry, times, 2))
    b = plan(registry, cache(tmp_path / "b.json", registry, times, 2))
    assert a.layers[0].experts == b.layers[0].experts == "reference"
    assert plan_fields(a, registry) == plan_fields(b, registry)


def test_caches_that_decide_differently_stop_the_ranks_naming_the_field_and_the_caches(
        tmp_path, registry):
    a = plan(registry, cache(tmp_path / "a.json", registry,
                             {"reference": 5.0, "cpu_dequantized": 80.0}, 2))
    b = plan(registry, cache(tmp_path / "b.json", registry,
                             {"reference": 80.0, "cpu_dequantized": 5.0}, 2))
    assert a.layers[0].experts != b.layers[0].experts
    with pytest.raises(PlanMismatchError) as err:
        compare({0: plan_fields(a, registry), 1: plan_fields(b, registry)})
    assert err.value.field == "layer model.layers.0.mlp.experts: experts"
    assert "the same tuning cache" in str(err.value)


def test_a_plan_note_is_not_in_the_fingerprint_but_every_decision_is(registry):
    p = plan(registry)
    fields = dict(plan_fields(p, registry).fields)
    noted = attrs.evolve(p, layers=(attrs.evolve(p.layers[0], notes=("another note",)),))
    assert plan_fields(noted, registry) == plan_fields(p, registry)
    for key in p.layers[0].to_json():
        if key not in ("layer", "notes"):
            assert f"layer model.layers.0.mlp.experts: {key}" in fields
