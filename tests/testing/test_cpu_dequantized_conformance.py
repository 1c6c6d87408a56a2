"""The built-in CPU experts backend passes the conformance suite (every declared combination)."""

from moe_runtime.testing.suite import *  # noqa: F401,F403

MOE_CONFORMANCE_BACKENDS = ["cpu_dequantized"]
