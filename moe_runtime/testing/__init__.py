"""The conformance suite: a backend's declaration, checked against what the backend does.

A backend author opts in with two lines (see ``docs/writing-a-backend.md``)::

    # conftest.py
    pytest_plugins = ["moe_runtime.testing.plugin"]

    # test_conformance.py
    from moe_runtime.testing.suite import *  # noqa: F401,F403

and names the backends to check with ``--moe-conformance NAME`` or the ini option
``moe_conformance = NAME``; or runs ``moe-runtime conformance NAME``. The cases come from the
declaration: every declared (format, activation, layout, payload) combination must match the
reference backend, every undeclared one must be refused by the planner, communication backends must
round-trip, hardware the machine lacks is skipped with the reason, and the entry point must import
no kernel library.
"""

# The case records are loaded on first use: the CLI imports this package for its ``conformance``
# command, and every other command should not pay for torch on the way.
_FROM_CASES = ("CommCase", "ExpertsCase", "RefusalCase", "TokenBoundCase", "case_seed",
               "comm_cases", "experts_cases", "refusal_cases", "token_bound_cases")
__all__ = list(_FROM_CASES)


def __getattr__(name):
    if name in _FROM_CASES:
        from moe_runtime.testing import cases

        return getattr(cases, name)
    raise AttributeError(f"module 'moe_runtime.testing' has no attribute {name!r}")
