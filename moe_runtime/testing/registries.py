"""A registry holding exactly the given backend specs, for planner tests (no entry points loaded)."""

from __future__ import annotations

import types

from moe_runtime.plugin.hookspecs import hookimpl
from moe_runtime.plugin.manager import get_plugin_manager
from moe_runtime.plugin.registry import Registry


def registry_of(*specs) -> Registry:
    """A :class:`Registry` of ``specs`` (experts and communication specs) and nothing else."""
    plugin = types.ModuleType("registry_of_" + "_".join(s.name for s in specs))

    @hookimpl
    def moe_runtime_register_backends(register):
        for s in specs:
            register(s)

    plugin.moe_runtime_register_backends = moe_runtime_register_backends
    return Registry.from_plugin_manager(
        get_plugin_manager(autoload=False, plugins=[plugin], environ={}))
