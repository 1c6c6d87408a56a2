"""``moe-runtime serve``: an OpenAI-compatible HTTP server for MoE checkpoints.

The CLI calls :func:`add_serve_arguments` and :func:`run_serve`; tests and embedders build an app
with :func:`create_app` over an :class:`Engine` made from :func:`load_for_serving`'s result.
Importing this package is cheap: torch, transformers and the web stack load on first use.
"""

from __future__ import annotations

from moe_runtime.serve.command import add_serve_arguments, run_serve

__all__ = ["Engine", "LoadedModel", "add_serve_arguments", "create_app", "load_for_serving",
           "run_serve"]

_LAZY = {
    "create_app": "moe_runtime.serve.app",
    "Engine": "moe_runtime.serve.engine",
    "LoadedModel": "moe_runtime.integration.transformers",  # the one class, also load_model's
    "load_for_serving": "moe_runtime.serve.loading",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moe_runtime.serve' has no attribute {name!r}")
