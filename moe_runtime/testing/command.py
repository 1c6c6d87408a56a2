"""``moe-runtime conformance NAME``: run the suite on installed backends."""

from __future__ import annotations

import sys


def add_conformance_command(sub) -> None:
    p = sub.add_parser(
        "conformance",
        help="run the conformance suite on backends (generated from their declarations)",
        description="Run the moe-runtime conformance suite on one or more registered backends. "
        "Extra arguments after -- go to pytest (e.g. -- -x -k nvfp4).",
    )
    p.add_argument("backends", nargs="+", metavar="NAME")
    p.add_argument("pytest_args", nargs="*", default=[], help=argparse_remainder_help())
    p.set_defaults(func=run_conformance)


def argparse_remainder_help() -> str:
    return "arguments passed to pytest (put them after --)"


def run_conformance(args) -> int:
    import pytest

    from moe_runtime.testing import suite

    argv = [suite.__file__, "-p", "moe_runtime.testing.plugin", "-q", "-rs",
            "-p", "no:cacheprovider"]
    for name in args.backends:
        argv += ["--moe-conformance", name]
    argv += list(args.pytest_args)
    code = pytest.main(argv)
    if code == 5:
        print("conformance: no test ran", file=sys.stderr)
    return int(code)
