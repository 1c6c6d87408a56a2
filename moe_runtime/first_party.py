"""Deprecated: the first-party plugin table moved to :mod:`moe_runtime.plugin.first_party`.

This module re-exports it and will be removed one release after 0.1.
"""

from moe_runtime.plugin.first_party import (  # noqa: F401
    CHECKOUT_NOTE,
    FIRST_PARTY,
    FirstPartyPlugin,
    degraded_plan_hints,
    is_installed,
    not_installed,
    providing,
    unregistered_backend_hint,
)
