"""The plugin manager: load plugins one by one, in a documented order.

Loading order (as pytest documents its own): blocked names first (``-p no:NAME`` and
``MOE_RUNTIME_BLOCK_PLUGINS``), then the built-in plugin, then entry points of the group
``moe_runtime`` unless ``MOE_RUNTIME_DISABLE_PLUGIN_AUTOLOAD`` is set, then plugins passed explicitly.
A plugin that fails to import is recorded and skipped, or raises in strict mode
(``MOE_RUNTIME_STRICT_PLUGINS=1``). Each call builds a fresh manager: no global state. What the
loaded plugins declare is collected by :class:`moe_runtime.plugin.registry.Registry`.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import os
import traceback
from typing import Iterable

import attrs
import pluggy

from moe_runtime.plugin import hookspecs

ENTRYPOINT_GROUP = "moe_runtime"
ENV_BLOCK = "MOE_RUNTIME_BLOCK_PLUGINS"
ENV_NO_AUTOLOAD = "MOE_RUNTIME_DISABLE_PLUGIN_AUTOLOAD"
ENV_STRICT = "MOE_RUNTIME_STRICT_PLUGINS"
BUILTIN_NAME = "builtin"


class PluginError(RuntimeError):
    """A plugin could not be loaded (strict mode) or two plugins collide."""


@attrs.frozen
class PluginInfo:
    """What ``moe-runtime plugins`` reports for one plugin."""

    name: str
    distribution: str | None
    version: str | None
    module: str | None
    status: str  # "loaded" | "failed" | "blocked"
    error: str | None = None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def blocked_from_env(environ=None) -> frozenset[str]:
    environ = os.environ if environ is None else environ
    return frozenset(n.strip() for n in environ.get(ENV_BLOCK, "").split(",") if n.strip())


@attrs.frozen
class PluginOptions:
    """How plugins are loaded, in one record passed down from the command line to every loader.

    :param blocked: plugin names not to load (``-p no:NAME``, ``MOE_RUNTIME_BLOCK_PLUGINS``).
    :param autoload: load entry points of the group ``moe_runtime``
        (off: ``--disable-plugin-autoload``, ``MOE_RUNTIME_DISABLE_PLUGIN_AUTOLOAD=1``).
    :param strict: a plugin that fails to load is fatal
        (``--strict-plugins``, ``MOE_RUNTIME_STRICT_PLUGINS=1``).
    """

    blocked: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    autoload: bool = True
    strict: bool = False

    @classmethod
    def from_environ(cls, environ=None) -> PluginOptions:
        """What the environment variables say (``os.environ`` unless ``environ`` is given)."""
        environ = os.environ if environ is None else environ
        return cls(blocked_from_env(environ), not _truthy(environ.get(ENV_NO_AUTOLOAD)),
                   _truthy(environ.get(ENV_STRICT)))

    def with_command_line(self, *, blocked: Iterable[str] = (), disable_autoload: bool = False,
                          strict: bool = False) -> PluginOptions:
        """These options and the global options of ``moe-runtime`` (which only add)."""
        return PluginOptions(self.blocked | frozenset(blocked),
                             self.autoload and not disable_autoload, self.strict or strict)

    def to_environ(self) -> dict[str, str]:
        """The environment variables that give a child process these options."""
        return {ENV_BLOCK: ",".join(sorted(self.blocked)),
                ENV_NO_AUTOLOAD: "" if self.autoload else "1",
                ENV_STRICT: "1" if self.strict else ""}


class MoEPluginManager(pluggy.PluginManager):
    """A pluggy manager that also remembers every plugin it tried to load, and how."""

    def __init__(self, options: PluginOptions | None = None) -> None:
        super().__init__(hookspecs.PROJECT)
        self.add_hookspecs(hookspecs)
        self.plugin_infos: list[PluginInfo] = []
        self.options = options or PluginOptions()


def get_plugin_manager(
    *,
    blocked: Iterable[str] = (),
    autoload: bool | None = None,
    strict: bool | None = None,
    plugins: Iterable[object] = (),
    environ=None,
    options: PluginOptions | None = None,
) -> MoEPluginManager:
    """Build a fresh plugin manager.

    :param blocked: plugin names not to load (``-p no:NAME``); ``builtin`` blocks the built-ins.
    :param autoload: load entry points of the group ``moe_runtime`` (default: unless
        ``MOE_RUNTIME_DISABLE_PLUGIN_AUTOLOAD`` is set).
    :param strict: raise :class:`PluginError` on a plugin that fails to load (default: from
        ``MOE_RUNTIME_STRICT_PLUGINS``); otherwise record it and go on.
    :param plugins: extra plugin objects (modules or instances) to register last.
    :param options: a :class:`PluginOptions` record (the command line's), used instead of the
        environment variables; ``blocked``, ``autoload`` and ``strict`` still apply on top.
    """
    base = options if options is not None else PluginOptions.from_environ(environ)
    blocked = frozenset(blocked) | base.blocked
    autoload = base.autoload if autoload is None else autoload
    strict = base.strict if strict is None else strict

    pm = MoEPluginManager(PluginOptions(blocked, autoload, strict))
    for name in blocked:
        pm.set_blocked(name)

    import moe_runtime
    from moe_runtime.plugin import builtin

    if BUILTIN_NAME in blocked:
        pm.plugin_infos.append(
            PluginInfo(BUILTIN_NAME, "moe-runtime", _version("moe-runtime"), builtin.__name__,
                       "blocked")
        )
    else:
        pm.register(builtin, name=BUILTIN_NAME)
        pm.plugin_infos.append(
            PluginInfo(BUILTIN_NAME, "moe-runtime", _version("moe-runtime"), builtin.__name__,
                       "loaded")
        )
    del moe_runtime

    if autoload:
        _load_entrypoints(pm, blocked=blocked, strict=strict)
        _drop_invalid_entrypoints(pm, strict=strict)
    for plugin in plugins:
        try:
            _check_unmarked_hooks(pm, plugin, pm.get_canonical_name(plugin))
            pm.register(plugin)
        except pluggy.PluginValidationError as exc:
            raise pluggy.PluginValidationError(
                exc.plugin, explain_validation_error(pm, exc, pm.get_canonical_name(plugin))
            ) from exc
        pm.plugin_infos.append(
            PluginInfo(pm.get_name(plugin), None, None, getattr(plugin, "__name__", None), "loaded")
        )
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise pluggy.PluginValidationError(
            exc.plugin, explain_validation_error(pm, exc, pm.get_name(exc.plugin))) from exc
    return pm


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _load_entrypoints(pm: MoEPluginManager, *, blocked: frozenset[str], strict: bool) -> None:
    seen: dict[str, str] = {}
    eps = sorted(md.entry_points(group=ENTRYPOINT_GROUP), key=lambda e: (e.name, e.value))
    for ep in eps:
        dist = ep.dist.name if ep.dist is not None else None
        version = ep.dist.version if ep.dist is not None else None
        if ep.name in blocked:
            pm.plugin_infos.append(PluginInfo(ep.name, dist, version, ep.value, "blocked"))
            continue
        if ep.name in seen or ep.name == BUILTIN_NAME:
            other = seen.get(ep.name, "moe-runtime (built-in)")
            if seen.get(ep.name) == dist:
                continue  # the same distribution seen twice on sys.path
            raise PluginError(
                f"plugin name {ep.name!r} is provided by two distributions: {other!r} and "
                f"{dist!r}; uninstall one, or block it with -p no:{ep.name}"
            )
        seen[ep.name] = dist
        try:
            obj = ep.load()
            _check_unmarked_hooks(pm, obj, ep.name)
            pm.register(obj, name=ep.name)
        except Exception as exc:  # a broken plugin must not take the host down
            error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, pluggy.PluginValidationError):
                # pluggy's message is several lines, its cause on the last: one line with the cause
                # and what the hook accepts, then pluggy's own text
                error = (f"{type(exc).__name__}: {explain_validation_error(pm, exc, ep.name)}"
                         f"\n{exc}")
            if strict:
                raise PluginError(
                    f"plugin {ep.name!r} from distribution {dist!r} failed to load: {error}"
                ) from exc
            pm.plugin_infos.append(
                PluginInfo(ep.name, dist, version, ep.value, "failed",
                           error + "\n" + traceback.format_exc(limit=3))
            )
            continue
        pm.plugin_infos.append(PluginInfo(ep.name, dist, version, ep.value, "loaded"))


def _drop_invalid_entrypoints(pm: MoEPluginManager, *, strict: bool) -> None:
    """A plugin implementing a hook that does not exist (a misspelling) is a load failure: it is
    unregistered and reported, or fatal in strict mode."""
    while True:
        try:
            pm.check_pending()
            return
        except pluggy.PluginValidationError as exc:
            name = pm.get_name(exc.plugin)
            error = explain_validation_error(pm, exc, name)
            if strict or name is None:
                raise PluginError(f"plugin {name!r}: {error}") from exc
            pm.unregister(exc.plugin)
            for k, info in enumerate(pm.plugin_infos):
                if info.name == name:
                    pm.plugin_infos[k] = attrs.evolve(info, status="failed", error=error)


def hook_signatures(pm: pluggy.PluginManager) -> dict[str, tuple[str, ...]]:
    """Every hook of the specification and the argument names it passes (by keyword)."""
    out = {}
    for name in sorted(vars(pm.hook)):
        hook = getattr(pm.hook, name)
        if not name.startswith("_") and hook.has_spec():
            out[name] = tuple(hook.spec.argnames) + tuple(hook.spec.kwargnames)
    return out


def _signature_list(pm: pluggy.PluginManager) -> str:
    return ", ".join(f"{n}({', '.join(a)})" for n, a in hook_signatures(pm).items())


def _hookimpls_of(pm: pluggy.PluginManager, plugin: object, name: str | None):
    """``(hook name, HookImpl)`` for every implementation the plugin object marks, as pluggy
    parses them."""
    for attr in dir(plugin):
        try:
            opts = pm.parse_hookimpl_opts(plugin, attr)
        except Exception:  # an attribute that raises when read is pluggy's to report
            continue
        if opts is None:
            continue
        function = getattr(plugin, attr)
        yield opts.get("specname") or attr, pluggy.HookImpl(plugin, name or "", function, opts)


def explain_validation_error(pm: pluggy.PluginManager, exc: pluggy.PluginValidationError,
                             name: str | None) -> str:
    """pluggy's ``PluginValidationError`` in one line: for each hook implementation of the plugin
    at fault, what is wrong with it and what the hook accepts (its name, its argument names).

    pluggy puts the cause on the last of several lines; ``moe-runtime plugins`` prints one."""
    signatures = hook_signatures(pm)
    accepted = _signature_list(pm)
    problems = []
    for hook_name, impl in _hookimpls_of(pm, exc.plugin, name):
        spec_args = signatures.get(hook_name)
        if spec_args is None:
            if impl.optionalhook:
                continue
            close = difflib.get_close_matches(hook_name, list(signatures), n=1)
            problems.append(
                f"unknown hook {hook_name!r} in plugin {name or exc.plugin!r}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + f"; the hooks of moe-runtime are {accepted}")
            continue
        extra = [a for a in impl.argnames if a not in spec_args]
        if extra:
            problems.append(
                f"plugin {name!r}: its hook implementation {hook_name}({', '.join(impl.argnames)}) "
                f"declares argument(s) {', '.join(map(repr, extra))}, which the hook does not "
                f"pass; the hook passes {', '.join(map(repr, spec_args))} by keyword (pluggy "
                f"matches parameters by name), so write {hook_name}({', '.join(spec_args)})")
    if problems:
        return "; ".join(problems)
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{text}; the hooks of moe-runtime are {accepted}"


def _check_unmarked_hooks(pm: pluggy.PluginManager, plugin: object, name: str | None) -> None:
    """A function named as a hook but not marked ``@moe_runtime.hookimpl`` is never called: pluggy
    skips it without a word, and the plugin would be listed as loaded having declared nothing."""
    specs = hook_signatures(pm)
    for attr in specs:
        function = getattr(plugin, attr, None)
        if not callable(function) or pm.parse_hookimpl_opts(plugin, attr) is not None:
            continue
        if pm.parse_hookspec_opts(plugin, attr) is not None:
            continue  # the specification itself, imported into the plugin's namespace
        raise pluggy.PluginValidationError(
            plugin,
            f"plugin {name!r} defines {attr}({', '.join(specs[attr])}) without marking it "
            f"@moe_runtime.hookimpl, so it would never be called and the plugin would declare "
            f"nothing; decorate it with @hookimpl (from moe_runtime import hookimpl)")
