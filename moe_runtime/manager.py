"""Deprecated: the plugin manager and registry moved to :mod:`moe_runtime.plugin.manager` and
:mod:`moe_runtime.plugin.registry`.

This module re-exports them (``Registry``, ``get_plugin_manager``, ``PluginOptions``...) so code
written against it keeps working; it will be removed one release after 0.1.
"""

from moe_runtime.plugin.manager import (  # noqa: F401
    BUILTIN_NAME,
    ENTRYPOINT_GROUP,
    ENV_BLOCK,
    ENV_NO_AUTOLOAD,
    ENV_STRICT,
    MoEPluginManager,
    PluginError,
    PluginInfo,
    PluginOptions,
    _version,
    blocked_from_env,
    get_plugin_manager,
)
from moe_runtime.plugin.registry import Registered, Registry, RegistryError  # noqa: F401
