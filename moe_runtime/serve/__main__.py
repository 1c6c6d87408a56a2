"""``python -m moe_runtime.serve``: the serve command without the rest of the CLI."""

from __future__ import annotations

import argparse
import sys

from moe_runtime.serve.command import add_serve_arguments, run_serve


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_runtime.serve",
                                     description="serve a MoE checkpoint over an OpenAI-compatible "
                                                 "HTTP API")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
