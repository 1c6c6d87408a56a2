"""Deprecated: the built-in plugin moved to :mod:`moe_runtime.plugin.builtin`.

This module re-exports its declarations (``REFERENCE``, ``CPU_DEQUANTIZED``, ``LOCAL``,
``TORCH_ALL_TO_ALL``...) and will be removed one release after 0.1. It defines no hook
implementations of its own: the manager registers :mod:`moe_runtime.plugin.builtin`.
"""

from moe_runtime.plugin.builtin import (  # noqa: F401
    ALL_FORMATS,
    CPU,
    CPU_DEQUANTIZED,
    LOCAL,
    REFERENCE,
    TORCH_ALL_TO_ALL,
)
