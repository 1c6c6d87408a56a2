"""Former name of :mod:`moe_runtime.executor`, kept so code importing it keeps working."""

from moe_runtime.executor import MoEExecutor, MoELayer, build_executor  # noqa: F401
