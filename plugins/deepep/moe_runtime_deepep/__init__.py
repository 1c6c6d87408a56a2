"""moe-runtime communication backend on DeepEP (normal and low-latency modes).

Importing this package imports neither torch nor ``deep_ep``: the entry point is
:mod:`moe_runtime_deepep.plugin` (the declaration), the backend is
:mod:`moe_runtime_deepep.backend` (imported by the planner's lazy factory only when selected).
"""

__version__ = "0.1.0"
