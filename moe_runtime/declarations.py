"""What a backend declares it can run: frozen records, the only source of capability.

A plugin registers :class:`ExpertsBackendSpec` and :class:`CommBackendSpec` objects through the
``moe_runtime_register_backends`` hook. The planner, the CLI, the conformance suite and the docs all read
these records; nothing else in the project says what a backend supports.
"""

from __future__ import annotations

import re
from typing import Iterable

import attrs

from moe_runtime import formats as F


def _fs(items: Iterable[str] | str) -> frozenset[str]:
    if isinstance(items, str):
        return frozenset({items})
    return frozenset(items)


def _tuple(items) -> tuple:
    return tuple(items)


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


@attrs.frozen
class CapabilityRange:
    """CUDA compute capabilities from ``min`` to ``max`` inclusive (``max=None``: no upper bound).

    ``CapabilityRange.exactly("10.0")`` is a single capability.
    """

    min: tuple[int, int] = attrs.field(converter=parse_capability)
    max: tuple[int, int] | None = attrs.field(
        default=None, converter=attrs.converters.optional(parse_capability)
    )

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
    requires: tuple[str, ...] = attrs.field(converter=_tuple, default=())

    def describe_capabilities(self) -> str:
        if not self.cuda_capabilities:
            return "any"
        return ", ".join(r.describe() for r in self.cuda_capabilities)


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
    """

    formats: frozenset[str] = attrs.field(converter=_fs)
    activations: frozenset[str] = attrs.field(converter=_fs, default=frozenset({F.SILU}))
    layouts: frozenset[str] = attrs.field(converter=_fs, default=frozenset({F.TOKEN_MAJOR}))
    payloads: frozenset[str] = attrs.field(converter=_fs, default=frozenset({F.UNQUANTIZED}))
    hardware: Hardware = attrs.field(factory=Hardware)
    runs_as: str | None = None
    shape_multiple: int = 1
    note: str = ""


def _check_backend(spec, supports, what: str) -> None:
    if not supports:
        raise ValueError(f"{spec.role} backend {spec.name!r} declares no {what}")
    if ":" not in spec.factory:
        raise ValueError(f"backend {spec.name!r}: factory {spec.factory!r} must be 'module:Class'")


def _requires(supports) -> frozenset[str]:
    return frozenset(m for s in supports for m in s.hardware.requires)


@attrs.frozen
class ExpertsBackendSpec:
    """An experts (compute) backend.

    :param name: unique backend name (what ``--moe-runner-backend`` takes).
    :param factory: lazy ``"module:Class"``; the class takes ``setup=ExpertsSetup`` and is imported
        only when the backend is selected.
    :param supports: the declaration, one or more :class:`Support` blocks.
    :param priority: higher wins when several backends can run a layer; ties break by name.
    :param description: one sentence for ``moe-runtime plugins``.
    """

    name: str
    factory: str
    supports: tuple[Support, ...] = attrs.field(converter=_tuple)
    priority: int = 0
    description: str = ""
    role = "experts"

    @supports.validator
    def _check(self, _attr, value):
        _check_backend(self, value, "Support block")

    def requires(self) -> frozenset[str]:
        return _requires(self.supports)


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

    def allows_world_size(self, n: int) -> bool:
        if self.world_sizes is not None:
            return n in self.world_sizes
        return n >= self.min_world_size and (self.max_world_size is None or n <= self.max_world_size)

    def describe_world_sizes(self) -> str:
        if self.world_sizes is not None:
            return ", ".join(str(n) for n in sorted(self.world_sizes))
        return f"{self.min_world_size}-{self.max_world_size or 'any'}"


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
        _check_backend(self, value, "mode")

    def requires(self) -> frozenset[str]:
        return _requires(self.supports)


def load_factory(factory: str):
    """Import ``"module:Class"`` and return the object (only when a backend is selected)."""
    import importlib

    module_name, _, attr = factory.partition(":")
    module = importlib.import_module(module_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
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
