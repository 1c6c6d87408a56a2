# The conformance suite, run on the backends named by --moe-conformance or the ini option
# moe_conformance (pyproject.toml names example_bmm).
from moe_runtime.testing.suite import *  # noqa: F401,F403
