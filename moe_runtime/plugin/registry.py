"""The registry: everything the loaded plugins declared, checked and keyed by name.

:meth:`Registry.from_plugin_manager` calls each ``register`` hook of a manager, plugin by plugin in
registration order (built-ins first), so it knows who declared what: a name declared twice, or a
declaration naming a format, payload or layout nobody registered, raises :class:`RegistryError`
naming the plugins.
"""

from __future__ import annotations

import attrs

from moe_runtime import formats as F
from moe_runtime.declarations import CommBackendSpec, ExpertsBackendSpec
from moe_runtime.plugin.manager import (
    MoEPluginManager,
    PluginError,
    PluginInfo,
    PluginOptions,
    get_plugin_manager,
)


class RegistryError(PluginError):
    """Two plugins declared the same backend or format name, or a declaration is invalid."""


@attrs.frozen
class Registered:
    """A declaration and the plugin that made it."""

    spec: object
    plugin: str


def _check_weight_format(fmt: F.WeightFormat, plugin: str) -> None:
    """A format is usable end to end (loading, reference, the suite's weights and error budgets)
    only through a storage encoding the core knows, and a payload the reference can emulate."""
    hooks = ("moe-runtime has no hook through which a plugin could supply the loading, "
             "quantization, dequantization and reference of another storage")
    if fmt.encoding not in F.ENCODINGS:
        raise RegistryError(
            f"weight format {fmt.name!r} (plugin {plugin!r}) has encoding {fmt.encoding!r}; "
            f"set encoding= to one of {', '.join(sorted(F.ENCODINGS))} ({hooks})")
    try:
        F.builtin_twin(fmt)
    except ValueError as exc:
        raise RegistryError(f"plugin {plugin!r}: {exc} ({hooks})") from None


@attrs.define
class Registry:
    """Everything the loaded plugins declared, keyed by name, with the declaring plugin."""

    formats: dict[str, Registered] = attrs.field(factory=dict)
    payloads: dict[str, Registered] = attrs.field(factory=dict)
    experts: dict[str, Registered] = attrs.field(factory=dict)
    comms: dict[str, Registered] = attrs.field(factory=dict)
    plugin_infos: tuple[PluginInfo, ...] = ()
    #: how the plugins were loaded: what a child process needs to load the same ones
    options: PluginOptions = attrs.field(factory=PluginOptions)

    @classmethod
    def from_plugin_manager(cls, pm: MoEPluginManager) -> Registry:
        reg = cls(plugin_infos=tuple(getattr(pm, "plugin_infos", ())),
                  options=getattr(pm, "options", None) or PluginOptions())
        _call_each(pm.hook.moe_runtime_register_formats, reg._add_format)
        _call_each(pm.hook.moe_runtime_register_backends, reg._add_backend)
        reg._validate()
        return reg

    @classmethod
    def load(cls, **kwargs) -> Registry:
        """``Registry.from_plugin_manager(get_plugin_manager(**kwargs))``."""
        return cls.from_plugin_manager(get_plugin_manager(**kwargs))

    def _add_format(self, item, plugin: str) -> None:
        if isinstance(item, F.WeightFormat):
            table, what = self.formats, "weight format"
        elif isinstance(item, F.Payload):
            table, what = self.payloads, "payload"
        else:
            raise RegistryError(
                f"plugin {plugin!r} registered {item!r}; moe_runtime_register_formats accepts "
                "WeightFormat or Payload"
            )
        if item.name in table:
            raise RegistryError(
                f"{what} {item.name!r} is registered by both plugin {table[item.name].plugin!r} "
                f"and plugin {plugin!r}"
            )
        if isinstance(item, F.WeightFormat):
            _check_weight_format(item, plugin)
        table[item.name] = Registered(item, plugin)

    def _add_backend(self, spec, plugin: str) -> None:
        if isinstance(spec, ExpertsBackendSpec):
            table = self.experts
        elif isinstance(spec, CommBackendSpec):
            table = self.comms
        else:
            raise RegistryError(
                f"plugin {plugin!r} registered {spec!r}; moe_runtime_register_backends accepts "
                "ExpertsBackendSpec or CommBackendSpec"
            )
        for other_table in (self.experts, self.comms):
            if spec.name in other_table:
                raise RegistryError(
                    f"backend name {spec.name!r} is registered by both plugin "
                    f"{other_table[spec.name].plugin!r} and plugin {plugin!r}; block one with "
                    f"-p no:NAME"
                )
        table[spec.name] = Registered(spec, plugin)

    def _validate(self) -> None:
        """Every name a declaration uses must be a registered format/payload/layout."""
        for reg in self.experts.values():
            for s in reg.spec.supports:
                for fmt in s.formats | ({s.runs_as} if s.runs_as else set()):
                    if fmt not in self.formats:
                        raise RegistryError(
                            f"experts backend {reg.spec.name!r} (plugin {reg.plugin!r}) declares "
                            f"unknown format {fmt!r}; registered formats: {sorted(self.formats)}"
                        )
                self._check_common(reg, s.payloads, s.layouts)
        for reg in self.comms.values():
            for s in reg.spec.supports:
                self._check_common(reg, s.payloads, {s.layout})

    def _check_common(self, reg: Registered, payloads, layouts) -> None:
        for p in payloads:
            if p not in self.payloads:
                raise RegistryError(
                    f"backend {reg.spec.name!r} (plugin {reg.plugin!r}) declares unknown payload "
                    f"{p!r}; registered payloads: {sorted(self.payloads)}"
                )
        for lay in layouts:
            if lay not in F.LAYOUTS:
                raise RegistryError(
                    f"backend {reg.spec.name!r} (plugin {reg.plugin!r}) declares unknown layout "
                    f"{lay!r}; known layouts: {sorted(F.LAYOUTS)}"
                )

    def required_modules(self) -> frozenset[str]:
        out: set[str] = set()
        for reg in list(self.experts.values()) + list(self.comms.values()):
            out |= reg.spec.requires()
        return frozenset(out)

    def experts_spec(self, name: str) -> ExpertsBackendSpec:
        return self.experts[name].spec

    def comm_spec(self, name: str) -> CommBackendSpec:
        return self.comms[name].spec


def _call_each(hook_caller, add) -> None:
    """Call every implementation of a ``register`` hook, telling ``add`` which plugin it was."""
    for impl in hook_caller.get_hookimpls():  # registration order: built-ins first
        name = impl.plugin_name

        def register(item, _name=name):
            add(item, _name)

        impl.function(**{arg: register for arg in impl.argnames})
