"""The hook specifications of moe-runtime: the whole plugin API.

Every hook is named ``moe_runtime_*``, is called with keyword arguments only, and receives a
``register`` callback: the host owns the registry, so it knows which plugin registered what and
rejects collisions itself. Implement a hook with ``@moe_runtime.hookimpl``.
"""

from __future__ import annotations

import pluggy

PROJECT = "moe_runtime"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def moe_runtime_register_formats(register):
    """Add weight formats or activation payloads to the vocabulary of declarations.

    :param register: ``register(item)`` where ``item`` is a
        :class:`moe_runtime.formats.WeightFormat` or :class:`moe_runtime.formats.Payload`.
        Registering a name that another plugin already registered raises ``RegistryError``.

    Called once per plugin manager, before backends are registered. Returns nothing: a returned
    value is never registered, so an implementation that returns one is reported as at fault.
    """


@hookspec
def moe_runtime_register_backends(register):
    """Declare the backends this plugin provides.

    :param register: ``register(spec)`` where ``spec`` is a
        :class:`moe_runtime.declarations.ExpertsBackendSpec` (compute) or
        :class:`moe_runtime.declarations.CommBackendSpec` (dispatch/combine). A backend name used by
        two plugins raises ``RegistryError`` naming both.

    Must not import kernel libraries: a spec carries a lazy ``"module:Class"`` factory that is
    imported only when the planner selects the backend. Returns nothing: a returned value (a list
    of specs, say) is never registered, so an implementation that returns one is reported as at
    fault.
    """
