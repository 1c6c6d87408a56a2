"""moe-runtime: Mixture-of-Experts layers run by backends chosen from their declarations."""

from moe_runtime.declarations import (
    CapabilityRange,
    CommBackendSpec,
    CommSupport,
    ExpertsBackendSpec,
    Hardware,
    Support,
)
from moe_runtime.plugin.hookspecs import hookimpl, hookspec
from moe_runtime.plugin.manager import get_plugin_manager
from moe_runtime.plugin.registry import Registry

__all__ = [
    "CapabilityRange",
    "CommBackendSpec",
    "CommSupport",
    "ExpertsBackendSpec",
    "Hardware",
    "Registry",
    "Support",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
]
__version__ = "0.1.0"
