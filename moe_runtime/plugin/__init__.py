"""The plugin machinery, in one place.

- :mod:`~moe_runtime.plugin.hookspecs`: the hook specifications, the whole plugin API;
- :mod:`~moe_runtime.plugin.manager`: loading plugins (order, blocking, strict mode, options);
- :mod:`~moe_runtime.plugin.registry`: what the loaded plugins declared, checked and keyed by name;
- :mod:`~moe_runtime.plugin.builtin`: the built-in plugin, registered through the same hooks;
- :mod:`~moe_runtime.plugin.first_party`: this repository's plugin distributions, for messages.

Nothing here imports torch or a kernel library.
"""
