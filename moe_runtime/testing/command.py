"""``moe-runtime conformance NAME``: run the suite on installed backends."""

from __future__ import annotations

import argparse
import sys


def add_conformance_command(sub) -> None:
    p = sub.add_parser(
        "conformance",
        help="run the conformance suite on backends (generated from their declarations)",
        description="Run the moe-runtime conformance suite on one or more registered backends. "
        "Extra arguments after -- go to pytest (e.g. -- -x -k nvfp4).",
    )
    p.add_argument("backends", nargs=argparse.REMAINDER, metavar="NAME [--seed N] [--case ID] "
                   "[-- PYTEST_ARGS]",
                   help="backends to check; arguments after -- go to pytest")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the case inputs (default 0: the same inputs on every run; each "
                        "case hashes its own id with the seed)")
    p.add_argument("--case", action="append", default=[], metavar="CASE_ID",
                   help="run only this case (a failure prints the command that replays it)")
    p.add_argument("--allow-unproven", action="store_true",
                   help="exit 0 even when every selected case that runs a backend's kernels was "
                        "skipped on this machine (by default that exits 5: nothing the backend "
                        "declares was proven here, e.g. a CUDA backend on a CPU-only machine)")
    p.set_defaults(func=run_conformance)


class PluginOptionsForSuite:
    """Handed to ``pytest.main(plugins=[...])``: the command's plugin options (``-p no:NAME``
    ...), which the suite's pytest plugin reads (without it, the environment variables). Defined
    here, not in the suite's plugin module, which pytest must import itself to rewrite asserts."""

    def __init__(self, options) -> None:
        self.moe_runtime_plugin_options = options


def run_conformance(args) -> int:
    try:
        import pytest
    except ImportError:
        print("conformance: the suite runs on pytest, which is not installed here: "
              "pip install 'pytest>=8'", file=sys.stderr)
        return 2

    from moe_runtime.testing import suite

    # Backend names never start with "-". --seed and --case may follow the names; after "--", or
    # from the first other option on, the arguments go to pytest.
    names, extra, cases, seed = [], [], list(args.case), args.seed
    allow_unproven = bool(getattr(args, "allow_unproven", False))
    tokens = list(args.backends)
    while tokens:
        token = tokens.pop(0)
        if extra:
            extra.append(token)
        elif token == "--":
            extra = tokens[:]
            tokens.clear()
            break
        elif token == "--allow-unproven":
            allow_unproven = True
        elif token in ("--seed", "--case") and tokens:
            value = tokens.pop(0)
            if token == "--case":
                cases.append(value)
            else:
                try:
                    seed = int(value)
                except ValueError:
                    print(f"conformance: --seed takes an integer, not {value!r}", file=sys.stderr)
                    return 2
        elif token.startswith("-"):
            extra.append(token)
        else:
            names.append(token)
    if not names:
        print("conformance: name at least one backend (see `moe-runtime plugins`)",
              file=sys.stderr)
        return 2
    options = getattr(args, "plugin_options", None)
    # An unknown name is one line here, not a collection error with pytest's traceback.
    problem = _unregistered(names, options) or (_unknown_cases(names, cases, options)
                                                if cases else None)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    # --tb=short: a failure is its assertion's sentence (the case, the errors, the budgets and
    # the replay command), not the suite's source with the registry's and the case's reprs;
    # a --tb after -- replaces it
    argv = [suite.__file__, "-p", "moe_runtime.testing.plugin", "-q", "-rs",
            "-p", "no:cacheprovider", "--tb=short"]
    for name in names:
        argv += ["--moe-conformance", name]
    argv += ["--moe-conformance-seed", str(seed)]
    for case in cases:
        argv += ["--moe-conformance-case", case]
    argv += extra
    tally = ProofTally()
    plugins = [tally] + ([PluginOptionsForSuite(options)] if options else [])
    code = int(pytest.main(argv, plugins=plugins))
    if code == 5:
        print("conformance: no test ran", file=sys.stderr)
        return code
    unproven = tally.unproven()
    for name, (skipped, reasons) in unproven.items():
        top = "; ".join(f"{why} ({n}x)" for why, n in reasons.most_common(3))
        print(f"conformance: no case that runs backend {name!r} ran on this machine: all "
              f"{skipped} were skipped ({top}). Its declarations are not proven here: run the "
              "suite where its hardware is" + ("" if allow_unproven else
                                               ", or pass --allow-unproven to exit 0 anyway"),
              file=sys.stderr)
    if code == 0 and unproven and not allow_unproven:
        return 5
    return code


# The suite's tests that run a backend's kernels (the others check refusals, token bounds against
# the planner, imports and the factory, which run no kernel and pass on any machine), by the
# fixture that carries their case.
PROVING_FIXTURES = ("experts_case", "graph_case", "comm_case")


class ProofTally:
    """A pytest plugin of ``moe-runtime conformance``: per backend, how many of its selected cases
    that run its kernels passed, failed or were skipped (and why)."""

    def __init__(self) -> None:
        self.backend_of: dict[str, str] = {}
        self.outcome: dict[str, str] = {}
        self.reason: dict[str, str] = {}

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            for fixture in PROVING_FIXTURES:
                case = params.get(fixture)
                if case is not None:
                    self.backend_of[item.nodeid] = case.backend

    def pytest_runtest_logreport(self, report) -> None:
        if report.nodeid not in self.backend_of:
            return
        if report.failed:
            self.outcome[report.nodeid] = "failed"
        elif report.skipped and self.outcome.get(report.nodeid) != "failed":
            self.outcome[report.nodeid] = "skipped"
            longrepr = report.longrepr
            why = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            self.reason[report.nodeid] = why.removeprefix("Skipped: ")
        elif report.when == "call" and report.passed:
            self.outcome.setdefault(report.nodeid, "passed")

    def unproven(self) -> dict:
        """backend -> (skipped count, Counter of skip reasons), for each backend some of whose
        kernel-running cases ran in this session and none of which passed or failed."""
        import collections

        ran = collections.defaultdict(collections.Counter)
        reasons = collections.defaultdict(collections.Counter)
        for nodeid, outcome in self.outcome.items():
            backend = self.backend_of[nodeid]
            ran[backend][outcome] += 1
            if outcome == "skipped":
                reasons[backend][self.reason.get(nodeid, "")] += 1
        return {b: (c["skipped"], reasons[b]) for b, c in ran.items()
                if c["skipped"] and not c["passed"] and not c["failed"]}


def _unregistered(names, options) -> str | None:
    from moe_runtime.plugin.manager import PluginOptions
    from moe_runtime.plugin.registry import Registry
    try:
        reg = Registry.load(options=options or PluginOptions.from_environ())
    except Exception:  # strict mode's load failure: the suite reports it as it always did
        return None
    return unregistered(reg, names)


def _unknown_cases(names, cases, options) -> str | None:
    """The sentence for ``--case`` ids that name no case of the backends (None if all do)."""
    from moe_runtime.plugin.manager import PluginOptions
    from moe_runtime.plugin.registry import Registry
    try:
        reg = Registry.load(options=options or PluginOptions.from_environ())
    except Exception:  # the suite reports it
        return None
    from moe_runtime.testing.cases import known_case_ids, unknown_case_ids

    problem = unknown_case_ids(known_case_ids(reg, names), names, cases)
    return f"conformance: {problem}" if problem else None


def unregistered(reg, names) -> str | None:
    """The sentence for backend names the registry lacks (None if every one is registered)."""
    known = set(reg.experts) | set(reg.comms)
    unknown = [n for n in names if n not in known]
    if not unknown:
        return None
    failed = [i for i in reg.plugin_infos if i.status == "failed"]
    hint = "".join(f"\n  plugin {i.name!r} ({i.distribution}) failed to load: "
                   f"{(i.error or '').splitlines()[0] if i.error else ''}" for i in failed)
    return (f"conformance: backend(s) {unknown} are not registered; registered: {sorted(known)}"
            + (f"; `moe-runtime plugins` lists these failed plugins:{hint}" if failed else ""))
