"""``python -m moe_runtime``: the ``moe-runtime`` command, for environments without its script."""

import sys

from moe_runtime.cli import main

if __name__ == "__main__":
    sys.exit(main())
