"""The conformance tests. Import them into a test module: ``from moe_runtime.testing.suite import *``."""

from __future__ import annotations

import pytest

from moe_runtime.declarations import load_factory
from moe_runtime.testing.harness import (
    ConformanceSkip,
    check_refusal,
    check_token_bound,
    imports_of_entry_point,
    replay_command,
    run_comm_case,
    run_experts_case,
    run_graph_case,
)

__all__ = [
    "test_conformance_declared_combination_matches_reference",
    "test_conformance_declared_cuda_graphs_capture_and_replay",
    "test_conformance_undeclared_combination_is_refused",
    "test_conformance_dispatch_combine_round_trips",
    "test_conformance_batch_past_a_declared_bound_is_not_given_to_the_mode",
    "test_conformance_entry_point_imports_no_kernels",
    "test_conformance_factory_loads",
]

# fp8 payloads are compared with the quantized input: float32 arithmetic on both sides
COMM_TOLERANCE = {"unquantized": 1e-5, "fp8": 2e-5}


def test_conformance_declared_combination_matches_reference(
    experts_case, conformance_registry, conformance_environment, conformance_seed, record_property
):
    try:
        r = run_experts_case(conformance_registry, experts_case, conformance_environment,
                             conformance_seed)
    except ConformanceSkip as why:
        pytest.skip(str(why))
    record_property("error_budget_ratio", r["ratio"])
    record_property("format", experts_case.runs_as)
    record_property("cuda_graph_replayed", r.get("graph_replayed", False))
    assert not r["failures"], (
        f"{experts_case.id} (device {r['device']}): " + "; ".join(r["failures"])
        + f". Replay: {replay_command(experts_case.backend, experts_case.id, conformance_seed)}"
    )


def test_conformance_declared_cuda_graphs_capture_and_replay(
    graph_case, conformance_registry, conformance_environment, conformance_seed
):
    """A ``cuda_graphs=True`` backend: one case per block captured and replayed on CUDA; on a
    machine without CUDA skipped, so that ``-rs`` and the summary say the promise went
    unchecked."""
    try:
        r = run_graph_case(conformance_registry, graph_case, conformance_environment,
                           conformance_seed)
    except ConformanceSkip as why:
        pytest.skip(str(why))
    assert not r["failures"], (
        f"{graph_case.id} (device {r['device']}): " + "; ".join(r["failures"])
        + f". Replay: {replay_command(graph_case.backend, graph_case.id, conformance_seed)}")


def test_conformance_undeclared_combination_is_refused(refusal_case, conformance_registry,
                                                       conformance_seed):
    reason = check_refusal(conformance_registry, refusal_case)
    assert reason == refusal_case.expected, (
        f"{refusal_case.id}: refused with {reason}, expected {refusal_case.expected}. Replay: "
        f"{replay_command(refusal_case.backend, refusal_case.id, conformance_seed)}")


def test_conformance_dispatch_combine_round_trips(
    comm_case, conformance_registry, conformance_environment, conformance_seed
):
    try:
        per_rank = run_comm_case(conformance_registry, comm_case, conformance_environment,
                                 conformance_seed)
    except ConformanceSkip as why:
        pytest.skip(str(why))
    tol = COMM_TOLERANCE.get(comm_case.payload, 1e-5)
    bad = {f"rank {r} {scenario}": err for r, errs in enumerate(per_rank)
           for scenario, err in errs.items()
           if not isinstance(err, float) or err > tol}
    assert not bad, (
        f"{comm_case.id}: the round trip through identity experts is off (tolerance {tol:g}, "
        f"{comm_case.tokens} tokens per rank at the 'at_bound' scenario): {bad}. Replay: "
        f"{replay_command(comm_case.backend, comm_case.id, conformance_seed)}")


def test_conformance_batch_past_a_declared_bound_is_not_given_to_the_mode(
    token_bound_case, conformance_registry
):
    check_token_bound(conformance_registry, token_bound_case)


def test_conformance_entry_point_imports_no_kernels(conformance_backend, conformance_registry):
    bad = imports_of_entry_point(conformance_backend, conformance_registry.options)
    assert bad == [], f"loading the plugins imported {bad} before {conformance_backend} was selected"


def test_conformance_factory_loads(conformance_backend, conformance_registry):
    """The lazy ``"module:Class"`` factory imports and names a class (what selecting it does)."""
    reg = conformance_registry
    entry = reg.experts.get(conformance_backend) or reg.comms.get(conformance_backend)
    try:
        load_factory(entry.spec.factory, conformance_backend)
    except Exception as exc:  # whatever importing it raises, with the backend named
        pytest.fail(f"{exc} (plugin {entry.plugin!r}; the planner would select {conformance_backend}"
                    " and every layer given to it would fail to load)", pytrace=False)
