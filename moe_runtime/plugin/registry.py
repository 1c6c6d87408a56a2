"""The registry: everything the loaded plugins declared, checked and keyed by name.

:meth:`Registry.from_plugin_manager` calls each ``register`` hook of a manager, plugin by plugin in
registration order (built-ins first), so it knows who declared what: a name declared twice, or a
declaration naming a format, payload or layout nobody registered, raises :class:`RegistryError`
naming the plugins.
"""

from __future__ import annotations

import attrs

from moe_runtime import formats as F
from moe_runtime.declarations import CommBackendSpec, ExpertsBackendSpec, factory_module
from moe_runtime.plugin.manager import (
    BUILTIN_NAME,
    MoEPluginManager,
    PluginError,
    PluginInfo,
    PluginOptions,
    get_plugin_manager,
)


class RegistryError(PluginError):
    """Two plugins declared the same backend or format name, or a declaration is invalid."""


class _PluginFault(RegistryError):
    """What one plugin declared is invalid (its hook raised, or a record names something unknown).

    An entry-point plugin at fault is reported as failed and skipped, as one that fails to import
    (fatal in strict mode); the built-in plugin and plugins passed in explicitly raise."""

    def __init__(self, plugin: str, message: str) -> None:
        super().__init__(message)
        self.plugin = plugin


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
        raise _PluginFault(plugin,
            f"weight format {fmt.name!r} (plugin {plugin!r}) has encoding {fmt.encoding!r}; "
            f"set encoding= to one of {', '.join(sorted(F.ENCODINGS))} ({hooks})")
    try:
        F.builtin_twin(fmt)
    except ValueError as exc:
        raise _PluginFault(plugin, f"plugin {plugin!r}: {exc} ({hooks})") from None


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
        """Call every plugin's hooks and check what they declared.

        A plugin whose hook raises, or whose declaration is invalid (an unknown format, payload,
        layout or activation, a ``runs_as`` that is not the format's weight-only variant, a
        quantized payload no format of its block is calibrated for), is at fault: an entry-point
        plugin is then reported as ``failed`` with the reason and skipped, like one that fails to
        import, and is fatal in strict mode; the built-in plugin and plugins passed in explicitly
        raise :class:`RegistryError`. Two plugins declaring one name raise in every mode."""
        options = getattr(pm, "options", None) or PluginOptions()
        infos = list(getattr(pm, "plugin_infos", ()))
        skipped: set[str] = set()
        while True:
            reg = cls(plugin_infos=tuple(infos), options=options)
            try:
                _call_each(pm.hook.moe_runtime_register_formats, reg._add_format, skipped)
                _call_each(pm.hook.moe_runtime_register_backends, reg._add_backend, skipped)
                reg._validate()
                return reg
            except _PluginFault as fault:
                k = next((k for k, i in enumerate(infos) if i.name == fault.plugin), None)
                info = infos[k] if k is not None else None
                dist = info.distribution if info is not None else None
                where = f"plugin {fault.plugin!r}" + (
                    f" from distribution {dist!r}" if dist else "")
                message = f"{where} declares something invalid: {fault}"
                tolerated = (info is not None and dist is not None and info.name != "builtin"
                             and not options.strict)
                if not tolerated:
                    raise RegistryError(message) from fault.__cause__
                skipped.add(fault.plugin)
                infos[k] = attrs.evolve(info, status="failed", error=message)
                if hasattr(pm, "plugin_infos"):
                    pm.plugin_infos[:] = infos
                if pm.get_plugin(fault.plugin) is not None:
                    pm.unregister(name=fault.plugin)

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
            raise _PluginFault(plugin,
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
            raise _PluginFault(plugin,
                f"plugin {plugin!r} registered {spec!r}; moe_runtime_register_backends accepts "
                "ExpertsBackendSpec or CommBackendSpec"
            )
        for other_table in (self.experts, self.comms):
            if spec.name in other_table:
                other = other_table[spec.name].plugin
                if other == plugin:
                    raise RegistryError(
                        f"plugin {plugin!r} registers backend name {spec.name!r} twice; backend "
                        "names must be unique: fix the plugin, or block it with "
                        f"-p no:{plugin}")
                # the plugin names are what -p no: takes; the built-ins are blocked as a whole
                names = [p for p in (plugin, other) if p != BUILTIN_NAME]
                options = " or ".join(f"-p no:{p}" for p in names)
                raise RegistryError(
                    f"backend name {spec.name!r} is registered by both plugin {other!r} and "
                    f"plugin {plugin!r}; backend names must be unique: uninstall one of the "
                    f"two, or block one with {options} (MOE_RUNTIME_BLOCK_PLUGINS="
                    f"{names[0]} in the environment)"
                )
        table[spec.name] = Registered(spec, plugin)

    def _validate(self) -> None:
        """Every name a declaration uses must be registered (formats, payloads) or known
        (layouts, activations); a block's ``runs_as`` must be its formats' weight-only variant,
        and each quantized payload it accepts must be the calibrated payload of one of them."""
        for reg in self.experts.values():
            for s in reg.spec.supports:
                for fmt in sorted(s.formats | ({s.runs_as} if s.runs_as else set())):
                    if fmt not in self.formats:
                        raise _PluginFault(reg.plugin,
                            f"experts backend {reg.spec.name!r} (plugin {reg.plugin!r}) declares "
                            f"unknown format {fmt!r}; registered formats: {sorted(self.formats)}"
                        )
                self._check_common(reg, s.payloads, s.layouts)
                self._check_block(reg, s)
        for reg in self.comms.values():
            for s in reg.spec.supports:
                self._check_common(reg, s.payloads, {s.layout})

    def _check_block(self, reg: Registered, s) -> None:
        name, plugin = reg.spec.name, reg.plugin
        block = f"experts backend {name!r} (plugin {plugin!r}), the Support block of " + (
            ", ".join(sorted(s.formats)))
        unknown = sorted(s.activations - F.ACTIVATIONS)
        if unknown:
            raise _PluginFault(plugin,
                f"{block}, declares unknown activation(s) {', '.join(map(repr, unknown))}; known "
                f"activations: {sorted(F.ACTIVATIONS)}")
        if not s.formats or not s.activations or not s.layouts or not s.payloads:
            empty = [f for f in ("formats", "activations", "layouts", "payloads")
                     if not getattr(s, f)]
            raise _PluginFault(plugin, f"{block}, declares no {', no '.join(empty)}; a block "
                                       "promises every combination of its sets")
        if s.runs_as is not None:
            wrong = sorted(f for f in s.formats
                           if f != s.runs_as and self.formats[f].spec.weight_only != s.runs_as)
            if wrong:
                variants = {f: self.formats[f].spec.weight_only for f in wrong}
                raise _PluginFault(plugin,
                    f"{block}, declares runs_as={s.runs_as!r}; a format runs only as its "
                    f"declared weight-only variant, and "
                    + "; ".join(f"{f} has " + (repr(v) if v else "none") for f, v in
                                variants.items())
                    + " (split the block, or drop runs_as)")
        for p in sorted(s.payloads - {F.UNQUANTIZED}):
            if not any(self.formats[s.runs(f)].spec.activation_payload == p for f in s.formats):
                calibrated = sorted(n for n, r in self.formats.items()
                                    if r.spec.activation_payload == p)
                raise _PluginFault(plugin,
                    f"{block}, declares payload {p!r}, which none of its formats is calibrated "
                    f"for when run as {', '.join(sorted({s.runs(f) for f in s.formats}))}: no "
                    f"layer could ever be dispatched to it so; {p} is the activation payload of "
                    f"{', '.join(calibrated) or 'no registered format'}")

    def _check_common(self, reg: Registered, payloads, layouts) -> None:
        for p in sorted(payloads):
            if p not in self.payloads:
                raise _PluginFault(reg.plugin,
                    f"backend {reg.spec.name!r} (plugin {reg.plugin!r}) declares unknown payload "
                    f"{p!r}; registered payloads: {sorted(self.payloads)}"
                )
        for lay in sorted(layouts):
            if lay not in F.LAYOUTS:
                raise _PluginFault(reg.plugin,
                    f"backend {reg.spec.name!r} (plugin {reg.plugin!r}) declares unknown layout "
                    f"{lay!r}; known layouts: {sorted(F.LAYOUTS)}"
                )

    def required_modules(self) -> frozenset[str]:
        out: set[str] = set()
        for reg in list(self.experts.values()) + list(self.comms.values()):
            out |= reg.spec.requires()
            out.add(factory_module(reg.spec.factory))
        return frozenset(out)

    def experts_spec(self, name: str) -> ExpertsBackendSpec:
        return self.experts[name].spec

    def comm_spec(self, name: str) -> CommBackendSpec:
        return self.comms[name].spec


def _call_each(hook_caller, add, skipped=frozenset()) -> None:
    """Call every implementation of a ``register`` hook, telling ``add`` which plugin it was.

    An exception a plugin's hook raises (a record it cannot build, say) is that plugin's fault, and
    so is a value it returns: pluggy would collect it in the hook's list of results, which
    moe-runtime never reads (records are declared by calling ``register``), so a hook returning its
    specs instead of registering them would otherwise declare nothing without a word. A hook wrapper
    is refused for the same reason: each implementation is called on its own, once."""
    argnames = tuple(hook_caller.spec.argnames) if hook_caller.spec is not None else ()
    call = f"{hook_caller.name}({', '.join(argnames)})"
    for impl in hook_caller.get_hookimpls():  # registration order: built-ins first
        name = impl.plugin_name
        if name in skipped:
            continue
        if impl.hookwrapper or impl.wrapper:
            raise _PluginFault(name,
                f"its hook {hook_caller.name} is marked as a wrapper (wrapper=True or "
                f"hookwrapper=True); moe-runtime calls each implementation of {call} once, on "
                f"its own: drop the option and call register(...) for each record")

        def register(item, /, *, _name=name):
            add(item, _name)

        try:
            result = impl.function(**{arg: register for arg in impl.argnames})
        except RegistryError:
            raise
        except Exception as exc:
            raise _PluginFault(name, f"its hook {hook_caller.name} raised "
                                     f"{type(exc).__name__}: {exc}{_where(exc)}") from exc
        if result is not None:
            raise _PluginFault(name,
                f"its hook {hook_caller.name} returned {_short_repr(result)} "
                f"({type(result).__name__}); the return value of {call} is not used, so nothing "
                f"it returns is registered: records are registered by calling the argument's "
                f"register(...), once per record, and the hook returns nothing (see "
                f"docs/writing-a-backend.md)")


def _short_repr(value, limit: int = 200) -> str:
    import reprlib

    r = reprlib.Repr()
    r.maxstring = r.maxother = 120
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = 3
    text = r.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _where(exc: BaseException) -> str:
    """`` (at FILE:LINE in FUNCTION)``: the innermost frame of the plugin's traceback."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if len(frames) < 2:  # only the call in _call_each: the hook itself did not run
        return ""
    f = frames[-1]
    return f" (at {f.filename}:{f.lineno}, in {f.name})"
