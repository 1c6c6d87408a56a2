"""pytest plugin of the conformance suite: options and case generation.

Backends to check, first found wins: a test module's ``MOE_CONFORMANCE_BACKENDS`` list, the
``--moe-conformance NAME[,NAME]`` option, the ini option ``moe_conformance``.
"""

from __future__ import annotations

import pytest

from moe_runtime.environment import Environment
from moe_runtime.plugin.manager import PluginOptions
from moe_runtime.plugin.registry import Registry


def pytest_addoption(parser):
    group = parser.getgroup("moe-runtime conformance")
    group.addoption("--moe-conformance", action="append", default=[], metavar="NAME",
                    help="backend(s) to run the moe-runtime conformance suite on")
    group.addoption("--moe-conformance-seed", type=int, default=0, metavar="N",
                    help="seed of the case inputs (default 0; each case hashes its id with it)")
    group.addoption("--moe-conformance-case", action="append", default=[], metavar="CASE_ID",
                    help="run only the case(s) with this id (the replay command of a failure)")
    parser.addini("moe_conformance", "backends to run the moe-runtime conformance suite on",
                  type="args", default=[])


_REGISTRY = pytest.StashKey[Registry]()
_ENVIRONMENT = pytest.StashKey[Environment]()


def _options(config) -> PluginOptions:
    """``moe-runtime conformance``'s plugin options (``PluginOptionsForSuite``), else the
    environment variables."""
    for plugin in config.pluginmanager.get_plugins():
        options = getattr(plugin, "moe_runtime_plugin_options", None)
        if isinstance(options, PluginOptions):
            return options
    return PluginOptions.from_environ()


def _registry(config) -> Registry:
    """The session's registry, loaded once per pytest run (kept in its config, not a global)."""
    if _REGISTRY not in config.stash:
        config.stash[_REGISTRY] = Registry.load(options=_options(config))
    return config.stash[_REGISTRY]


def _environment(config) -> Environment:
    if _ENVIRONMENT not in config.stash:
        reg = _registry(config)
        config.stash[_ENVIRONMENT] = Environment.probe(modules=reg.required_modules())
    return config.stash[_ENVIRONMENT]


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
    from moe_runtime.testing.command import unregistered

    problem = unregistered(_registry(metafunc.config), names)
    if problem:
        raise pytest.UsageError(problem)
    return names


# Kinds of case that exist only where a backend promises something (``cuda_graphs=True``): where
# none does (or ``--case`` names none of them), their test is left out, not skipped, so that a
# backend's summary counts no skip for what it never declared.
QUIET_WHEN_ABSENT = ("graph_case",)


def pytest_configure(config):
    config.addinivalue_line("markers", "moe_absent: a conformance test with no case (left out)")


def pytest_collection_modifyitems(config, items):
    items[:] = [i for i in items if i.get_closest_marker("moe_absent") is None]


def pytest_generate_tests(metafunc):
    from moe_runtime.testing.cases import (
        comm_cases,
        experts_cases,
        graph_cases,
        refusal_cases,
        token_bound_cases,
    )

    wanted = {"experts_case", "refusal_case", "comm_case", "token_bound_case", "graph_case",
              "conformance_backend"}
    if not wanted & set(metafunc.fixturenames):
        return
    reg = _registry(metafunc.config)
    names = _selected(metafunc)
    only = set(metafunc.config.getoption("moe_conformance_case") or ())
    if only:
        _check_case_ids(metafunc.config, reg, names, only)

    def param(fixture, make, table):
        if fixture not in metafunc.fixturenames:
            return
        cases = [c for n in names if n in table for c in make(reg, table[n].spec)]
        if only:
            cases = [c for c in cases if c.id in only]
        if not cases and fixture in QUIET_WHEN_ABSENT:
            # nothing promised, nothing to say: the item is dropped at collection
            metafunc.parametrize(fixture, [pytest.param(None, marks=pytest.mark.moe_absent)],
                                 ids=["none-declared"])
            return
        if not cases:
            why = (f"no case of {fixture} has an id in {sorted(only)}" if only else
                   f"the declaration of {', '.join(names)} gives no {fixture} (nothing of that "
                   "kind is declared)")
            metafunc.parametrize(fixture, [pytest.param(None, marks=pytest.mark.skip(why))],
                                 ids=["none-declared"])
            return
        metafunc.parametrize(fixture, cases, ids=[c.id for c in cases])

    param("experts_case", experts_cases, reg.experts)
    param("graph_case", graph_cases, reg.experts)
    param("refusal_case", refusal_cases, reg.experts)
    param("comm_case", comm_cases, reg.comms)
    param("token_bound_case", token_bound_cases, reg.comms)
    if "conformance_backend" in metafunc.fixturenames:
        metafunc.parametrize("conformance_backend", names)


_KNOWN_IDS = pytest.StashKey[dict]()


def _check_case_ids(config, reg: Registry, names, only) -> None:
    """Collect the case ids of the backends ``names`` (once per set of names); whether ``--case``
    names one of them is checked when collection ends (:func:`pytest_collection_finish`), over
    every module's backends."""
    known = config.stash.setdefault(_KNOWN_IDS, {})
    key = tuple(names)
    if key not in known:
        from moe_runtime.testing.cases import known_case_ids

        known[key] = known_case_ids(reg, names)


def pytest_collection_finish(session):
    """``--case ID`` must name a case of the backends checked: a usage error naming it and a few
    known ids otherwise, not a green run of nothing."""
    config = session.config
    only = set(config.getoption("moe_conformance_case") or ())
    known = config.stash.get(_KNOWN_IDS, {})
    if not only or not known:
        return
    from moe_runtime.testing.cases import unknown_case_ids

    names = [n for key in known for n in key]
    ids = [c for v in known.values() for c in v]
    problem = unknown_case_ids(ids, list(dict.fromkeys(names)), only)
    if problem:
        raise pytest.UsageError(problem)


@pytest.fixture(scope="session")
def conformance_registry(request) -> Registry:
    return _registry(request.config)


@pytest.fixture(scope="session")
def conformance_environment(request) -> Environment:
    return _environment(request.config)


@pytest.fixture(scope="session")
def conformance_seed(request) -> int:
    return int(request.config.getoption("moe_conformance_seed") or 0)
