"""pytest plugin of the conformance suite: options and case generation.

Backends to check, first found wins: a test module's ``MOE_CONFORMANCE_BACKENDS`` list, the
``--moe-conformance NAME[,NAME]`` option, the ini option ``moe_conformance``.
"""

from __future__ import annotations

import pytest

from moe_runtime.environment import Environment
from moe_runtime.manager import Registry


def pytest_addoption(parser):
    group = parser.getgroup("moe-runtime conformance")
    group.addoption("--moe-conformance", action="append", default=[], metavar="NAME",
                    help="backend(s) to run the moe-runtime conformance suite on")
    parser.addini("moe_conformance", "backends to run the moe-runtime conformance suite on",
                  type="args", default=[])


_STATE: dict = {}


def _registry() -> Registry:
    if "registry" not in _STATE:
        _STATE["registry"] = Registry.load()
    return _STATE["registry"]


def _environment() -> Environment:
    if "env" not in _STATE:
        reg = _registry()
        _STATE["env"] = Environment.probe(modules=reg.required_modules())
    return _STATE["env"]


def _selected(metafunc) -> list[str]:
    names = getattr(metafunc.module, "MOE_CONFORMANCE_BACKENDS", None)
    if not names:
        names = [n for opt in metafunc.config.getoption("moe_conformance") for n in opt.split(",")]
    if not names:
        names = metafunc.config.getini("moe_conformance")
    if not names:
        raise pytest.UsageError(
            "the moe-runtime conformance suite needs backends to check: pass --moe-conformance "
            "NAME, set the ini option moe_conformance, or MOE_CONFORMANCE_BACKENDS in the module")
    reg = _registry()
    known = set(reg.experts) | set(reg.comms)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise pytest.UsageError(
            f"conformance: backend(s) {unknown} are not registered; registered: {sorted(known)}")
    return names


def pytest_generate_tests(metafunc):
    from moe_runtime.testing.cases import comm_cases, experts_cases, refusal_cases

    wanted = {"experts_case", "refusal_case", "comm_case", "conformance_backend"}
    if not wanted & set(metafunc.fixturenames):
        return
    reg = _registry()
    names = _selected(metafunc)
    if "experts_case" in metafunc.fixturenames:
        cases = [c for n in names if n in reg.experts for c in experts_cases(reg, reg.experts_spec(n))]
        metafunc.parametrize("experts_case", cases, ids=[c.id for c in cases])
    if "refusal_case" in metafunc.fixturenames:
        cases = [c for n in names if n in reg.experts
                 for c in refusal_cases(reg, reg.experts_spec(n))]
        metafunc.parametrize("refusal_case", cases, ids=[c.id for c in cases])
    if "comm_case" in metafunc.fixturenames:
        cases = [c for n in names if n in reg.comms for c in comm_cases(reg, reg.comm_spec(n))]
        metafunc.parametrize("comm_case", cases, ids=[c.id for c in cases])
    if "conformance_backend" in metafunc.fixturenames:
        metafunc.parametrize("conformance_backend", names)


@pytest.fixture(scope="session")
def conformance_registry() -> Registry:
    return _registry()


@pytest.fixture(scope="session")
def conformance_environment() -> Environment:
    return _environment()
