"""What a backend declares it can run: frozen records, the only source of capability.

A plugin registers :class:`ExpertsBackendSpec` and :class:`CommBackendSpec` objects through the
``moe_runtime_register_backends`` hook. The planner, the CLI, the conformance suite and the docs all read
these records; nothing else in the project says what a backend supports.
"""

from __future__ import annotations

import enum
import math
import re
from typing import TYPE_CHECKING, Iterable

import attrs

from moe_runtime import formats as F

if TYPE_CHECKING:  # records only: no import cycle at run time
    from moe_runtime.backend_api import LayerProblem
    from moe_runtime.environment import Environment


def _fs(items: Iterable[str] | str) -> frozenset[str]:
    if isinstance(items, str):
        return frozenset({items})
    return frozenset(items)


def _tuple(items) -> tuple:
    return tuple(items)


#: the device kinds a :class:`Hardware` record may name
DEVICES = frozenset({"cpu", "cuda"})

_CAP_RE = re.compile(r"^(\d+)\.(\d+)$")


def parse_capability(text: str | tuple[int, int]) -> tuple[int, int]:
    """``"9.0"`` or ``(9, 0)`` -> ``(9, 0)``; a clear error for anything else."""
    if isinstance(text, tuple):
        return (int(text[0]), int(text[1]))
    m = _CAP_RE.match(str(text).strip())
    if not m:
        raise ValueError(f"compute capability {text!r} is not of the form MAJOR.MINOR, e.g. '9.0'")
    return (int(m.group(1)), int(m.group(2)))


def format_capability(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]}"


class Reason(enum.Enum):
    """Why a declaration does not accept a problem: a closed set, one value per cause."""

    UNSUPPORTED_FORMAT = "unsupported_format"
    DEGRADATION_DISABLED = "degradation_disabled"
    UNSUPPORTED_ACTIVATION = "unsupported_activation"
    UNSUPPORTED_LAYOUT = "unsupported_layout"
    UNSUPPORTED_PAYLOAD = "unsupported_payload"
    UNSUPPORTED_RUNS_AS = "unsupported_runs_as"
    UNSUPPORTED_SHAPE = "unsupported_shape"
    UNSUPPORTED_DEVICE = "unsupported_device"
    COMPUTE_CAPABILITY = "compute_capability"
    MISSING_DEPENDENCY = "missing_dependency"
    WORLD_SIZE = "world_size"
    TOKEN_BOUND = "token_bound"
    NO_COMMON_LAYOUT = "no_common_layout"
    NOT_REQUESTED = "not_requested"


@attrs.frozen
class Verdict:
    """The answer of a declaration's ``check``: accepted, or a :class:`Reason` with a sentence.

    ``message`` says what the problem has and what the declaration would accept instead. A verdict
    is truthy when accepted: ``if not support.check(problem, env): ...``.
    """

    reason: Reason | None = None
    message: str = ""

    @property
    def accepted(self) -> bool:
        return self.reason is None

    def __bool__(self) -> bool:
        return self.reason is None

    def describe(self) -> str:
        return "accepted" if self.reason is None else f"{self.reason.value}: {self.message}"


ACCEPTED = Verdict()

# The order in which an experts block is checked: for a backend with several blocks the verdict
# reported is the one of the block that got furthest down this list.
CHECK_ORDER = (
    Reason.UNSUPPORTED_FORMAT,
    Reason.UNSUPPORTED_ACTIVATION,
    Reason.UNSUPPORTED_LAYOUT,
    Reason.UNSUPPORTED_PAYLOAD,
    Reason.UNSUPPORTED_RUNS_AS,
    Reason.UNSUPPORTED_SHAPE,
    Reason.UNSUPPORTED_DEVICE,
    Reason.COMPUTE_CAPABILITY,
    Reason.MISSING_DEPENDENCY,
    Reason.DEGRADATION_DISABLED,
    Reason.WORLD_SIZE,
    Reason.TOKEN_BOUND,
)


def furthest(verdicts: Iterable[Verdict]) -> Verdict:
    """The refusal that got furthest down :data:`CHECK_ORDER` (an accepted verdict wins outright)."""
    verdicts = list(verdicts)
    for v in verdicts:
        if v:
            return v
    if not verdicts:
        return Verdict(Reason.UNSUPPORTED_FORMAT, "declares nothing")
    return max(verdicts, key=lambda v: CHECK_ORDER.index(v.reason) if v.reason in CHECK_ORDER
               else -1)


def _listed(items: Iterable[str]) -> str:
    return ", ".join(sorted(items)) or "none"


@attrs.frozen
class CapabilityRange:
    """CUDA compute capabilities from ``min`` to ``max`` inclusive (``max=None``: no upper bound).

    ``CapabilityRange.exactly("10.0")`` is a single capability.
    """

    min: tuple[int, int] = attrs.field(converter=parse_capability)
    max: tuple[int, int] | None = attrs.field(
        default=None, converter=attrs.converters.optional(parse_capability)
    )

    def __attrs_post_init__(self):
        if self.max is not None and self.max < self.min:
            raise ValueError(
                f"CapabilityRange({format_capability(self.min)!r}, {format_capability(self.max)!r})"
                ": the upper bound is below the lower one, so no device is in it; accepted: "
                "min <= max (CapabilityRange.exactly('9.0') for one capability)")

    @classmethod
    def exactly(cls, cap: str | tuple[int, int]) -> CapabilityRange:
        return cls(cap, cap)

    def contains(self, cap: tuple[int, int]) -> bool:
        return cap >= self.min and (self.max is None or cap <= self.max)

    def describe(self) -> str:
        if self.max == self.min:
            return format_capability(self.min)
        if self.max is None:
            return f"{format_capability(self.min)}+"
        return f"{format_capability(self.min)}-{format_capability(self.max)}"


@attrs.frozen
class Hardware:
    """Where a backend runs.

    :param devices: device kinds, a subset of ``{"cpu", "cuda"}``.
    :param cuda_capabilities: accepted CUDA compute capabilities; empty means any.
    :param requires: top-level module names that must be importable (checked without importing).
    """

    devices: frozenset[str] = attrs.field(converter=_fs, default=frozenset({"cpu", "cuda"}))
    cuda_capabilities: tuple[CapabilityRange, ...] = attrs.field(converter=_tuple, default=())
    requires: tuple[str, ...] = attrs.field(converter=lambda v: (v,) if isinstance(v, str)
                                            else tuple(v), default=())

    @requires.validator
    def _check_requires(self, _attr, value):
        bad = [m for m in value if not isinstance(m, str) or not re.fullmatch(r"[A-Za-z_]\w*", m)]
        if bad:
            raise ValueError(
                f"Hardware(requires={list(value)!r}): {bad[0]!r} is not a top-level module name; "
                "accepted: names such as 'triton' or 'deep_ep' (a string or a list of them)")

    @devices.validator
    def _check_devices(self, _attr, value):
        unknown = sorted(value - DEVICES)
        if unknown or not value:
            raise ValueError(
                f"Hardware(devices={sorted(value)!r}): "
                + (f"unknown device kind(s) {', '.join(map(repr, unknown))}; " if unknown
                   else "no device kind; ")
                + f"accepted: a non-empty subset of {sorted(DEVICES)}")

    @cuda_capabilities.validator
    def _check_capabilities(self, _attr, value):
        bad = [r for r in value if not isinstance(r, CapabilityRange)]
        if bad:
            raise ValueError(
                f"Hardware(cuda_capabilities=...): {bad[0]!r} is not a CapabilityRange; write "
                "CapabilityRange('9.0') for 9.0 and newer, CapabilityRange.exactly('9.0') for one")

    def describe_capabilities(self) -> str:
        if not self.cuda_capabilities:
            return "any"
        return ", ".join(r.describe() for r in self.cuda_capabilities)

    def check(self, environment: Environment) -> Verdict:
        """Device kind, then compute capability, then importable modules (when they were probed)."""
        env = environment
        if env.device not in self.devices:
            return Verdict(Reason.UNSUPPORTED_DEVICE,
                           f"runs on {_listed(self.devices)}, not on {env.described}")
        if env.device == "cuda" and self.cuda_capabilities:
            cap = env.capability
            if cap is None or not any(r.contains(cap) for r in self.cuda_capabilities):
                have = format_capability(cap) if cap else "unknown"
                return Verdict(Reason.COMPUTE_CAPABILITY, (
                    f"needs CUDA compute capability {self.describe_capabilities()}; "
                    f"{env.described} has {have}"))
        if env.available is not None:
            missing = [m for m in self.requires if m not in env.available]
            if missing:
                return Verdict(Reason.MISSING_DEPENDENCY, (
                    f"needs the module(s) {', '.join(missing)} importable; install the "
                    "distribution that provides them"))
        return ACCEPTED


@attrs.frozen
class Support:
    """One block of an experts backend's declaration: every combination of these sets runs.

    :param formats: weight formats of the layer this entry accepts.
    :param activations: gated activation functions.
    :param layouts: token layouts consumed (``token_major``, ``masked``).
    :param payloads: activation payloads accepted as input (``unquantized`` always means the model's
        16-bit activations; a quantized payload is accepted only for a format whose calibrated
        activation payload it is).
    :param hardware: where this entry runs.
    :param runs_as: run the accepted formats as this (weight-only) format instead: a declared
        degradation, reported by the planner (``nvfp4_w4a4`` weights run as ``nvfp4_w4a16``).
    :param shape_multiple: hidden and intermediate sizes must be multiples of this.
    :param note: a sentence for people, shown with the plan when this entry is chosen.
    :param prepared_bytes_per_weight: bytes per expert weight the backend holds after
        ``prepare`` (scales included), when it keeps its own copy of another size (a float32
        copy: ``4.0``); ``None``: the format's storage (:attr:`WeightFormat.bytes_per_weight`).
        The memory estimate of a plan that chooses this block counts this.
    :param max_tokens_per_forward: the most tokens one ``forward`` of this block runs (rows of
        ``hidden`` in ``token_major``, rows per expert in ``masked``), e.g. a kernel's fixed
        workspace; ``None`` (the default): any number. The planner does not choose the block for
        a deployment that may send one forward more (``max_tokens_per_rank`` times the
        expert-parallel size: every rank may route all its tokens to one rank), and the
        conformance suite runs a case at exactly this many tokens.
    """

    formats: frozenset[str] = attrs.field(converter=_fs)
    activations: frozenset[str] = attrs.field(converter=_fs, default=frozenset({F.SILU}))
    layouts: frozenset[str] = attrs.field(converter=_fs, default=frozenset({F.TOKEN_MAJOR}))
    payloads: frozenset[str] = attrs.field(converter=_fs, default=frozenset({F.UNQUANTIZED}))
    hardware: Hardware = attrs.field(factory=Hardware)
    runs_as: str | None = None
    shape_multiple: int = attrs.field(default=1)
    note: str = ""
    prepared_bytes_per_weight: float | None = None
    max_tokens_per_forward: int | None = attrs.field(default=None, kw_only=True)

    @max_tokens_per_forward.validator
    def _check_token_bound(self, _attr, value):
        if value is not None and not _is_count(value):
            raise ValueError(
                f"the Support block of {_listed(self.formats)} declares "
                f"max_tokens_per_forward={value!r}; accepted: None (any number of tokens) or a "
                "positive integer (the most tokens one forward runs)")

    def admits_tokens(self, tokens: int) -> bool:
        """Does one forward of this block run ``tokens`` tokens (its declared bound, if any)?"""
        return self.max_tokens_per_forward is None or tokens <= self.max_tokens_per_forward

    @shape_multiple.validator
    def _check_shape_multiple(self, _attr, value):
        if not _is_count(value):
            raise ValueError(
                f"the Support block of {_listed(self.formats)} declares shape_multiple={value!r}; "
                "accepted: a positive integer (1: any size)")

    @hardware.validator
    def _check_hardware(self, _attr, value):
        if not isinstance(value, Hardware):
            raise ValueError(
                f"the Support block of {_listed(self.formats)} declares hardware={value!r}; "
                "accepted: a Hardware(devices=..., cuda_capabilities=..., requires=...) record")

    def check(
        self,
        problem: LayerProblem,
        environment: Environment | None = None,
        *,
        runs_as: str | None = None,
        layout: str | None = None,
        payload: str | None = None,
        allow_degradation: bool = True,
        tokens_per_forward: int | None = None,
    ) -> Verdict:
        """Does this block run ``problem`` on ``environment``? The one matching rule.

        The planner, the conformance suite and backends' own guards all call this. Checked in
        :data:`CHECK_ORDER`: format, activation, then (when given) the layout and payload a setup
        would deliver and the format it asks to run as, shape, hardware, degradation, and (when
        given) the most tokens one forward may receive against ``max_tokens_per_forward``.
        ``environment=None`` leaves the hardware out (a backend guarding its own construction
        checks the device itself).
        """
        p = problem
        if p.format not in self.formats:
            return Verdict(Reason.UNSUPPORTED_FORMAT,
                           f"does not run format {p.format}; it declares {_listed(self.formats)}")
        if p.activation not in self.activations:
            return Verdict(Reason.UNSUPPORTED_ACTIVATION, (
                f"does not run activation {p.activation}; it declares "
                f"{_listed(self.activations)}"))
        if layout is not None and layout not in self.layouts:
            return Verdict(Reason.UNSUPPORTED_LAYOUT,
                           f"does not consume layout {layout}; it declares {_listed(self.layouts)}")
        if payload is not None and payload not in self.payloads:
            return Verdict(Reason.UNSUPPORTED_PAYLOAD, (
                f"does not accept payload {payload}; it declares {_listed(self.payloads)}"))
        own = self.runs_as or p.format
        if runs_as is not None and runs_as != own:
            return Verdict(Reason.UNSUPPORTED_RUNS_AS, (
                f"runs format {p.format} as {own}, not as {runs_as}"))
        m = self.shape_multiple
        if m > 1 and (p.hidden_size % m or p.intermediate_size % m):
            return Verdict(Reason.UNSUPPORTED_SHAPE, (
                f"needs hidden and intermediate sizes that are multiples of {m}; the layer has "
                f"hidden {p.hidden_size}, intermediate {p.intermediate_size}"))
        if environment is not None:
            hw = self.hardware.check(environment)
            if not hw:
                return hw
        if own != p.format and not allow_degradation:
            return Verdict(Reason.DEGRADATION_DISABLED, (
                f"runs format {p.format} only as {own} (a declared degradation), and degradation "
                "is switched off (--no-degradation)"))
        if tokens_per_forward is not None and not self.admits_tokens(tokens_per_forward):
            return Verdict(Reason.TOKEN_BOUND, (
                f"runs at most {self.max_tokens_per_forward} tokens per forward; the deployment "
                f"may send {tokens_per_forward} (lower --max-tokens-per-rank / --max-batch-size, "
                "or pin another experts backend)"))
        return ACCEPTED

    def runs(self, fmt: str) -> str:
        """The format this block computes layers of format ``fmt`` in."""
        return self.runs_as or fmt


def _is_count(value) -> bool:
    """A positive int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


_FACTORY_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def _check_backend(spec, supports, what: str, kind) -> None:
    if not isinstance(spec.name, str) or not re.match(r"^[A-Za-z0-9_.-]+$", spec.name):
        raise ValueError(
            f"{spec.role} backend name {spec.name!r}: accepted: a non-empty string of letters, "
            "digits, '_', '-' and '.' (what --moe-runner-backend and conformance take)")
    if not supports:
        raise ValueError(f"{spec.role} backend {spec.name!r} declares no {what}")
    bad = [s for s in supports if not isinstance(s, kind)]
    if bad:
        raise ValueError(
            f"{spec.role} backend {spec.name!r}: supports holds {bad[0]!r}; accepted: "
            f"{kind.__name__} records")
    if not isinstance(spec.factory, str) or not _FACTORY_RE.match(spec.factory):
        raise ValueError(
            f"{spec.role} backend {spec.name!r}: factory {spec.factory!r} must be 'module:Class' "
            "(a dotted module path, a colon, the class), e.g. 'moe_runtime_mine.experts:MyExperts'")
    if not isinstance(spec.priority, int) or isinstance(spec.priority, bool):
        raise ValueError(
            f"{spec.role} backend {spec.name!r} declares priority={spec.priority!r}; accepted: an "
            "integer (higher wins; reference is 0, triton 30)")


def is_bytes_per_weight(value) -> bool:
    """Is ``value`` a valid ``prepared_bytes_per_weight`` other than ``None``: a positive finite
    int or float (not a bool, not an integer beyond any float)?"""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:
        return False


def _check_prepared_bytes(backend: str, support: Support) -> None:
    value = support.prepared_bytes_per_weight
    if value is None:
        return
    if not is_bytes_per_weight(value):
        raise ValueError(
            f"experts backend {backend!r}: the Support block of {_listed(support.formats)} "
            f"declares "
            f"prepared_bytes_per_weight={value!r}; accepted: a positive finite number of bytes per "
            "expert weight the backend holds after prepare (4.0 for a float32 copy), or None for "
            "the format's storage")


def _requires(supports) -> frozenset[str]:
    return frozenset(m for s in supports for m in s.hardware.requires)


def factory_module(factory: str) -> str:
    """The top-level module a ``"module:Class"`` factory imports (``"pkg"`` for ``"pkg.sub:C"``)."""
    return factory.partition(":")[0].split(".")[0]


def check_factory(spec, environment: Environment | None) -> Verdict:
    """Whether ``spec``'s factory loads on ``environment``: a backend whose declarations are
    registered but whose package is not installed (a plugin's entry point left behind, a
    declaration-only distribution) is refused at planning with what to install, and one whose
    package is there but whose factory does not load (its module or class missing, an import
    inside it failing) is refused with :func:`load_factory`'s message, not picked and then
    failing at load. The factory is imported only for a backend that accepts the layer on this
    machine, and only where the environment was probed for its top-level module
    (:meth:`Environment.probe` with ``Registry.required_modules()``, as every command does); a
    described target or a hand-built environment assumes it."""
    module = factory_module(spec.factory)
    env = environment
    if env is None or env.available is None or module not in env.checked:
        return ACCEPTED
    if module not in env.available:
        return Verdict(Reason.MISSING_DEPENDENCY, (
            f"its factory {spec.factory!r} imports the module {module!r}, which is not importable "
            "here; install the distribution that provides it"))
    # the package is there: the factory itself must load (a module of the package or the class
    # missing, an import inside it failing), or the backend would be picked and fail at load
    problem = factory_problem(spec.factory, spec.name)
    if problem is None:
        return ACCEPTED
    return Verdict(Reason.MISSING_DEPENDENCY, (
        f"{problem.removeprefix(f'backend {spec.name!r}: ')}; fix or reinstall the distribution "
        "that provides it"))


_FACTORY_PROBLEMS: dict[tuple[str, str], str | None] = {}


def forget_factory_problems() -> None:
    """Try every factory again (each :func:`~moe_runtime.planner.plan_model` starts so): a package
    installed or mended since the last plan is seen by the next."""
    _FACTORY_PROBLEMS.clear()


def factory_problem(factory: str, backend: str) -> str | None:
    """Why ``factory`` does not load in this process (:func:`load_factory`'s message), or None;
    tried once per factory until :func:`forget_factory_problems` (the planner asks once per
    layer, and forgets at the start of each model's plan)."""
    key = (factory, backend)
    if key not in _FACTORY_PROBLEMS:
        try:
            load_factory(factory, backend)
        except Exception as exc:  # any error of the import: the message says which
            _FACTORY_PROBLEMS[key] = str(exc)
        else:
            _FACTORY_PROBLEMS[key] = None
    return _FACTORY_PROBLEMS[key]


@attrs.frozen
class ExpertsBackendSpec:
    """An experts (compute) backend.

    :param name: unique backend name (what ``--moe-runner-backend`` takes).
    :param factory: lazy ``"module:Class"``; the class takes ``setup=ExpertsSetup`` and is imported
        only when the backend is selected.
    :param supports: the declaration, one or more :class:`Support` blocks.
    :param priority: higher wins when several backends can run a layer; ties break by name.
    :param description: one sentence for ``moe-runtime plugins``.
    :param cuda_graphs: ``True`` promises that ``forward`` can be captured in a CUDA graph and
        replayed (no host synchronization, no copy from pageable host memory, nothing sized from
        data on the host). ``moe-runtime serve`` replays decode steps as CUDA graphs only when
        every experts backend of the plan promises it (else decode runs eagerly and the server
        says why), and the conformance suite captures and replays every declared combination on
        a CUDA device to prove it. Default ``False``: nothing is captured.
    """

    name: str
    factory: str
    supports: tuple[Support, ...] = attrs.field(converter=_tuple)
    priority: int = 0
    description: str = ""
    cuda_graphs: bool = attrs.field(default=False, kw_only=True)
    role = "experts"

    @cuda_graphs.validator
    def _check_graphs(self, _attr, value):
        if not isinstance(value, bool):
            raise ValueError(f"experts backend {self.name!r} declares cuda_graphs={value!r}; "
                             "accepted: True (forward can be captured in a CUDA graph) or False")

    @supports.validator
    def _check(self, _attr, value):
        _check_backend(self, value, "Support block", Support)
        for support in value:
            _check_prepared_bytes(self.name, support)

    def requires(self) -> frozenset[str]:
        return _requires(self.supports)

    def check(self, problem: LayerProblem, environment: Environment | None = None,
              **kwargs) -> Verdict:
        """Accepted if any block accepts (see :meth:`Support.check`), else the furthest refusal.

        When every block refuses the format, the message lists every format the backend declares
        (each block's own message names only its own formats).
        """
        verdicts = [s.check(problem, environment, **kwargs) for s in self.supports]
        best = furthest(verdicts)
        if all(v.reason is Reason.UNSUPPORTED_FORMAT for v in verdicts):
            declared = {f for s in self.supports for f in s.formats}
            return Verdict(Reason.UNSUPPORTED_FORMAT,
                           f"does not run format {problem.format}; it declares {_listed(declared)}")
        return best

    def require_setup(self, setup) -> None:
        """Raise ``ValueError`` unless a block accepts ``setup`` (an ``ExpertsSetup``): the guard a
        backend runs at construction, since pinned and hand-built setups bypass the planner."""
        verdict = self.check(setup.problem, runs_as=setup.runs_as, layout=setup.layout,
                             payload=setup.payload)
        if not verdict:
            raise ValueError(
                f"layer {setup.problem.name}: {self.name} cannot run this setup: "
                f"{verdict.describe()} (format {setup.problem.format} as {setup.runs_as}, "
                f"activation {setup.problem.activation}, layout {setup.layout}, payload "
                f"{setup.payload}; `moe-runtime plugins` shows what it declares)")

    def accepting(self, problem: LayerProblem, environment: Environment | None = None,
                  **kwargs) -> list[Support]:
        """The blocks that accept ``problem``, native ones (no ``runs_as``) first."""
        ok = [s for s in self.supports if s.check(problem, environment, **kwargs)]
        return sorted(ok, key=lambda s: s.runs(problem.format) != problem.format)


@attrs.frozen
class CommSupport:
    """One mode of a communication backend.

    :param layout: the token layout ``dispatch`` produces in this mode.
    :param payloads: activation payloads it can carry.
    :param min_world_size: smallest expert-parallel group; ``max_world_size``: largest (None: any).
    :param world_sizes: the exact group sizes allowed, when not a range (``{2, 4, 8}``); ``None``
        means every size from ``min_world_size`` to ``max_world_size``.
    :param max_tokens_per_rank: per-rank token bound of this mode (None: unbounded).
    :param hardware: where it runs.
    :param mode: a short name of the mode (``"normal"``, ``"low_latency"``).
    """

    layout: str
    payloads: frozenset[str] = attrs.field(converter=_fs, default=frozenset({F.UNQUANTIZED}))
    min_world_size: int = 1
    max_world_size: int | None = None
    max_tokens_per_rank: int | None = None
    hardware: Hardware = attrs.field(factory=Hardware)
    mode: str = "default"
    world_sizes: frozenset[int] | None = attrs.field(
        default=None, converter=attrs.converters.optional(frozenset))

    def __attrs_post_init__(self):
        where = f"communication mode {self.mode!r}"
        if not _is_count(self.min_world_size):
            raise ValueError(f"{where} declares min_world_size={self.min_world_size!r}; "
                             "accepted: a positive integer")
        if self.max_world_size is not None and not (
                _is_count(self.max_world_size) and self.max_world_size >= self.min_world_size):
            raise ValueError(f"{where} declares max_world_size={self.max_world_size!r}; "
                             f"accepted: None (any) or an integer >= min_world_size "
                             f"({self.min_world_size})")
        if self.world_sizes is not None and (
                not self.world_sizes or not all(_is_count(n) for n in self.world_sizes)):
            raise ValueError(f"{where} declares world_sizes={sorted(self.world_sizes)!r}; "
                             "accepted: None or a non-empty set of positive integers")
        if self.max_tokens_per_rank is not None and not _is_count(self.max_tokens_per_rank):
            raise ValueError(f"{where} declares max_tokens_per_rank={self.max_tokens_per_rank!r}; "
                             "accepted: None (unbounded) or a positive integer")
        if not isinstance(self.hardware, Hardware):
            raise ValueError(f"{where} declares hardware={self.hardware!r}; accepted: a "
                             "Hardware(...) record")

    def allows_world_size(self, n: int) -> bool:
        if self.world_sizes is not None:
            return n in self.world_sizes
        return n >= self.min_world_size and (self.max_world_size is None or n <= self.max_world_size)

    def describe_world_sizes(self) -> str:
        if self.world_sizes is not None:
            return ", ".join(str(n) for n in sorted(self.world_sizes))
        return f"{self.min_world_size}-{self.max_world_size or 'any'}"

    def admits_tokens(self, tokens_per_rank: int) -> bool:
        return self.max_tokens_per_rank is None or tokens_per_rank <= self.max_tokens_per_rank

    def check(
        self,
        environment: Environment | None = None,
        *,
        world_size: int = 1,
        tokens_per_rank: int | None = None,
        layout: str | None = None,
        payload: str | None = None,
    ) -> Verdict:
        """Does this mode run a group of ``world_size`` ranks here, batches of
        ``tokens_per_rank`` tokens (when given), with this layout and payload (when given)?"""
        if layout is not None and layout != self.layout:
            return Verdict(Reason.UNSUPPORTED_LAYOUT,
                           f"mode {self.mode} produces layout {self.layout}, not {layout}")
        if payload is not None and payload not in self.payloads:
            return Verdict(Reason.UNSUPPORTED_PAYLOAD, (
                f"mode {self.mode} carries {_listed(self.payloads)}, not {payload}"))
        if environment is not None:
            hw = self.hardware.check(environment)
            if not hw:
                return hw
        if not self.allows_world_size(world_size):
            return Verdict(Reason.WORLD_SIZE, (
                f"mode {self.mode} runs with {self.describe_world_sizes()} expert-parallel ranks; "
                f"the deployment has {world_size}"))
        if tokens_per_rank is not None and not self.admits_tokens(tokens_per_rank):
            return Verdict(Reason.TOKEN_BOUND, (
                f"mode {self.mode} carries at most {self.max_tokens_per_rank} tokens per rank; "
                f"the batch has {tokens_per_rank}"))
        return ACCEPTED


@attrs.frozen
class CommBackendSpec:
    """A communication (dispatch/combine) backend.

    :param name: unique name (what ``--moe-a2a-backend`` takes).
    :param factory: lazy ``"module:Class"`` taking ``setup=CommSetup``.
    :param supports: its modes, in order of preference.
    :param priority: higher wins; ties break by name.
    """

    name: str
    factory: str
    supports: tuple[CommSupport, ...] = attrs.field(converter=_tuple)
    priority: int = 0
    description: str = ""
    role = "communication"

    @supports.validator
    def _check(self, _attr, value):
        _check_backend(self, value, "mode", CommSupport)

    def requires(self) -> frozenset[str]:
        return _requires(self.supports)

    def check(self, environment: Environment | None = None, **kwargs) -> Verdict:
        """Accepted if any mode accepts (see :meth:`CommSupport.check`), else the furthest refusal."""
        return furthest(s.check(environment, **kwargs) for s in self.supports)

    def accepting(self, environment: Environment | None = None, **kwargs) -> list[CommSupport]:
        """The modes that accept, in declared order of preference."""
        return [s for s in self.supports if s.check(environment, **kwargs)]


class FactoryError(ImportError):
    """A backend's ``"module:Class"`` factory names something that is not a class."""


def _reraise(exc: Exception, message: str):
    """``exc``'s own type with ``message`` (callers catching ImportError or AttributeError still
    do), or :class:`FactoryError` where that type cannot carry a message."""
    try:
        new = type(exc)(message)
    except Exception:
        new = FactoryError(message)
    raise new from exc


def load_factory(factory: str, backend: str | None = None):
    """Import ``"module:Class"`` and return the object (only when a backend is selected).

    A module that does not import, or an attribute it lacks, raises the same kind of error with a
    message naming the backend (when given), the factory and what went wrong."""
    import importlib

    who = f"backend {backend!r}: " if backend else ""
    module_name, _, attr = factory.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        _reraise(exc, f"{who}factory {factory!r} does not load: importing {module_name!r} raised "
                      f"{type(exc).__name__}: {exc}")
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            _reraise(exc, f"{who}factory {factory!r} does not load: module {module_name!r} has "
                          f"no attribute {attr!r}")
    if not callable(obj):
        raise FactoryError(f"{who}factory {factory!r} names a {type(obj).__name__} object, not a "
                           "class")
    return obj


def describe_support(s: Support) -> dict:
    """A JSON-able view of one Support block (for ``plugins --json`` and docs)."""
    return {
        "formats": sorted(s.formats),
        "activations": sorted(s.activations),
        "layouts": sorted(s.layouts),
        "payloads": sorted(s.payloads),
        "devices": sorted(s.hardware.devices),
        "cuda_capabilities": s.hardware.describe_capabilities(),
        "requires": list(s.hardware.requires),
        "runs_as": s.runs_as,
        "shape_multiple": s.shape_multiple,
        "max_tokens_per_forward": s.max_tokens_per_forward,
        "note": s.note,
    }


def describe_comm_support(s: CommSupport) -> dict:
    return {
        "mode": s.mode,
        "layout": s.layout,
        "payloads": sorted(s.payloads),
        "world_size": s.describe_world_sizes(),
        "max_tokens_per_rank": s.max_tokens_per_rank,
        "devices": sorted(s.hardware.devices),
        "cuda_capabilities": s.hardware.describe_capabilities(),
        "requires": list(s.hardware.requires),
    }
