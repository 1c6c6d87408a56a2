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
    p.add_argument("backends", nargs="+", metavar="NAME [-- PYTEST_ARGS]",
                   help="backends to check; arguments after -- go to pytest")
    p.set_defaults(func=run_conformance)


def run_conformance(args) -> int:
    try:
        import pytest
    except ImportError:
        print("conformance: the suite runs on pytest, which is not installed here: "
              "pip install 'pytest>=8'", file=sys.stderr)
        return 2

    from moe_runtime.testing import suite

    # Backend names never start with "-": the first token that does begins pytest's arguments
    # (argparse hands everything after "--" to the positional list).
    names, extra = [], []
    for token in args.backends:
        (extra if extra or token.startswith("-") else names).append(token)
    if not names:
        print("conformance: name at least one backend (see `moe-runtime plugins`)",
              file=sys.stderr)
        return 2
    argv = [suite.__file__, "-p", "moe_runtime.testing.plugin", "-q", "-rs",
            "-p", "no:cacheprovider"]
    for name in names:
        argv += ["--moe-conformance", name]
    argv += extra
    code = pytest.main(argv)
    if code == 5:
        print("conformance: no test ran", file=sys.stderr)
    return int(code)
