"""The conformance tests. Import them into a test module: ``from moe_runtime.testing.suite import *``."""

from __future__ import annotations

import pytest

from moe_runtime.testing.harness import (
    ConformanceSkip,
    check_refusal,
    imports_of_entry_point,
    run_comm_case,
    run_experts_case,
)

__all__ = [
    "test_conformance_declared_combination_matches_reference",
    "test_conformance_undeclared_combination_is_refused",
    "test_conformance_dispatch_combine_round_trips",
    "test_conformance_entry_point_imports_no_kernels",
]


def test_conformance_declared_combination_matches_reference(
    experts_case, conformance_registry, conformance_environment
):
    try:
        r = run_experts_case(conformance_registry, experts_case, conformance_environment)
    except ConformanceSkip as why:
        pytest.skip(str(why))
    assert r["error"] <= r["tolerance"], (
        f"{experts_case.id}: max error {r['error']:.4g} of the reference's range exceeds the "
        f"{experts_case.runs_as} tolerance {r['tolerance']} (device {r['device']})"
    )


def test_conformance_undeclared_combination_is_refused(refusal_case, conformance_registry):
    reason = check_refusal(conformance_registry, refusal_case)
    assert reason == refusal_case.expected, (
        f"{refusal_case.id}: refused with {reason}, expected {refusal_case.expected}")


def test_conformance_dispatch_combine_round_trips(
    comm_case, conformance_registry, conformance_environment
):
    try:
        errors = run_comm_case(conformance_registry, comm_case, conformance_environment)
    except ConformanceSkip as why:
        pytest.skip(str(why))
    tol = 0.0 if comm_case.payload == "unquantized" else 1e-5
    assert max(errors) <= tol + 1e-5, f"{comm_case.id}: round trip error per rank {errors}"


def test_conformance_entry_point_imports_no_kernels(conformance_backend):
    bad = imports_of_entry_point(conformance_backend)
    assert bad == [], f"loading the plugins imported {bad} before {conformance_backend} was selected"
