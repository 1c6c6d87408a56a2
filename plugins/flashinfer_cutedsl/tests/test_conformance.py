"""The core's conformance suite on this backend, generated from its declaration.

Refusals and the lazy-import check run everywhere. Declared combinations run only on a device of
compute capability 10.0/10.3/10.7 with the [kernels] extra; elsewhere they are skipped with the
reason the suite gives.
"""

from moe_runtime.testing.suite import *  # noqa: F401,F403

MOE_CONFORMANCE_BACKENDS = ["flashinfer_cutedsl"]
