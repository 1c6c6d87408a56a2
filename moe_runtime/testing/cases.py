"""Test cases generated from declarations (no second capability table anywhere)."""

from __future__ import annotations

import attrs

from moe_runtime import formats as F
from moe_runtime.declarations import CommBackendSpec, ExpertsBackendSpec, Support
from moe_runtime.environment import Environment
from moe_runtime.manager import Registry

# Per-format tolerance: max |out - ref| / max |ref|, the reference computing in float32.
TOLERANCE = {
    F.BF16: 2e-2,
    F.FP16: 5e-3,
    F.FP8_W8A8: 6e-2,
    F.NVFP4_W4A4: 8e-2,
    F.NVFP4_W4A16: 3e-2,
}
DEFAULT_TOLERANCE = 8e-2


@attrs.frozen
class Shape:
    """One input shape: tokens, hidden, intermediate, experts, top-k and a routing pattern."""

    name: str
    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    routing: str = "random"  # "random" | "one_expert" | "skip_experts" | "remote_slots"


SHAPES = (
    Shape("one_token", 1, 64, 32, 8, 2),
    Shape("all_to_one_expert", 9, 64, 32, 8, 1, "one_expert"),
    Shape("idle_experts", 12, 64, 48, 8, 2, "skip_experts"),
    Shape("zero_tokens", 0, 64, 32, 4, 2),
    Shape("odd_hidden", 7, 80, 48, 6, 3),
    Shape("batch", 33, 128, 64, 8, 2),
    # experts on other ranks: some top-k ids are -1 (token-major only)
    Shape("remote_slots", 10, 64, 32, 8, 3, "remote_slots"),
)


@attrs.frozen
class ExpertsCase:
    backend: str
    format: str
    runs_as: str
    activation: str
    layout: str
    payload: str
    shape: Shape
    support_index: int

    @property
    def id(self) -> str:
        ra = f"-as-{self.runs_as}" if self.runs_as != self.format else ""
        return (f"{self.backend}-{self.format}{ra}-{self.activation}-{self.layout}-{self.payload}"
                f"-{self.shape.name}")


@attrs.frozen
class RefusalCase:
    backend: str
    format: str
    activation: str
    expected: str  # a planner Reason value
    environment: str  # target name the refusal is checked on

    @property
    def id(self) -> str:
        return f"{self.backend}-refuses-{self.format}-{self.activation}-on-{self.environment}"


@attrs.frozen
class CommCase:
    backend: str
    mode: str
    layout: str
    payload: str
    world_size: int

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.mode}-{self.payload}-ws{self.world_size}"


def _payload_allowed(registry: Registry, runs_as: str, payload: str) -> bool:
    if payload == F.UNQUANTIZED:
        return True
    return registry.formats[runs_as].spec.activation_payload == payload


def experts_cases(registry: Registry, spec: ExpertsBackendSpec) -> list[ExpertsCase]:
    out = []
    for i, s in enumerate(spec.supports):
        for fmt in sorted(s.formats):
            runs_as = s.runs_as or fmt
            for act in sorted(s.activations):
                for layout in sorted(s.layouts):
                    for payload in sorted(s.payloads):
                        if not _payload_allowed(registry, runs_as, payload):
                            continue
                        for shape in SHAPES:
                            if shape.routing == "remote_slots" and layout != F.TOKEN_MAJOR:
                                continue
                            if _shape_ok(s, fmt, shape):
                                out.append(ExpertsCase(spec.name, fmt, runs_as, act, layout,
                                                       payload, shape, i))
    return out


def _shape_ok(s: Support, fmt: str, shape: Shape) -> bool:
    m = max(s.shape_multiple, 16 if fmt.startswith("nvfp4") else 1)
    return shape.hidden % m == 0 and shape.intermediate % m == 0


def _target_for(s: Support) -> str:
    """A described environment where this Support block's hardware matches."""
    hw = s.hardware
    if "cpu" in hw.devices:
        return "cpu"
    if hw.cuda_capabilities:
        lo = hw.cuda_capabilities[0].min
        return f"cuda:{lo[0]}.{lo[1]}"
    return "cuda:9.0"


def refusal_cases(registry: Registry, spec: ExpertsBackendSpec) -> list[RefusalCase]:
    """Undeclared combinations and the reason the planner must give for each.

    - a registered format declared by no block: ``unsupported_format``, on a machine where one of
      the backend's blocks matches (so the format, not the device, is the reason);
    - an activation declared by no block: ``unsupported_activation``;
    - a declared format on a device kind no block of that format runs on: ``unsupported_device``;
    - a declared format on a CUDA capability outside every range of the blocks declaring it:
      ``compute_capability``.
    """
    out = []
    declared = {f for t in spec.supports for f in t.formats}
    acts = {a for t in spec.supports for a in t.activations}
    for s in spec.supports:
        target = _target_for(s)
        for fmt in sorted(set(registry.formats) - declared):
            out.append(RefusalCase(spec.name, fmt, sorted(s.activations)[0],
                                   "unsupported_format", target))
        for act in sorted(F.ACTIVATIONS - acts):
            out.append(RefusalCase(spec.name, sorted(s.formats)[0], act,
                                   "unsupported_activation", target))
    for fmt in sorted(declared):
        blocks = [t for t in spec.supports if fmt in t.formats]
        act = sorted(blocks[0].activations)[0]
        devices = {d for t in blocks for d in t.hardware.devices}
        if "cpu" not in devices:
            out.append(RefusalCase(spec.name, fmt, act, "unsupported_device", "cpu"))
        if "cuda" in devices and all(t.hardware.cuda_capabilities for t in blocks
                                     if "cuda" in t.hardware.devices):
            for probe in ("7.0", "8.0", "9.0", "10.0", "12.0"):
                env = Environment.for_target(f"cuda:{probe}")
                if not any(_hw_matches(t, env) for t in blocks):
                    out.append(RefusalCase(spec.name, fmt, act, "compute_capability",
                                           f"cuda:{probe}"))
    return list(dict.fromkeys(out))


def _hw_matches(s: Support, env: Environment) -> bool:
    hw = s.hardware
    if env.device not in hw.devices:
        return False
    if env.device == "cuda" and hw.cuda_capabilities:
        return any(r.contains(env.capability) for r in hw.cuda_capabilities)
    return True


def comm_cases(registry: Registry, spec: CommBackendSpec) -> list[CommCase]:
    out = []
    for s in spec.supports:
        sizes = [n for n in (1, 2, 4) if s.allows_world_size(n)]
        for payload in sorted(s.payloads):
            for ws in sizes:
                out.append(CommCase(spec.name, s.mode, s.layout, payload, ws))
    return out
