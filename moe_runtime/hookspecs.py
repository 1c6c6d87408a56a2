"""Deprecated: the hook specs moved to :mod:`moe_runtime.plugin.hookspecs`.

This module re-exports them so plugins written against it (``from moe_runtime.hookspecs import
hookimpl``) keep working; it will be removed one release after 0.1.
"""

from moe_runtime.plugin.hookspecs import (  # noqa: F401
    PROJECT,
    hookimpl,
    hookspec,
    moe_runtime_register_backends,
    moe_runtime_register_formats,
)
