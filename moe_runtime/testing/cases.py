"""Test cases generated from declarations (no second capability table anywhere).

Every number a case uses comes from the declaration it checks or from the format's storage:
sizes are built from the block's ``shape_multiple`` and the format's block size (the smallest sizes
admitted, sizes that are not multiples of 16 where admitted), experts cases run each block at its
own ``max_tokens_per_forward`` (where it declares none, at the planner's default deployment's
batch, 4096 tokens, and past it, at 8193: an undeclared bound claims every count) and never past
a declared one, experts on another rank than the first get local ids,
communication cases run each mode at its own ``max_tokens_per_rank`` and at every world size from
1 to 4 it admits. Which problems a
block accepts is decided by :meth:`Support.check`, the planner's own rule.
"""

from __future__ import annotations

import math
import zlib

import attrs

from moe_runtime import formats as F
from moe_runtime.backend_api import LayerProblem
from moe_runtime.declarations import CommBackendSpec, CommSupport, ExpertsBackendSpec, Support
from moe_runtime.environment import Environment
from moe_runtime.planner import Deployment
from moe_runtime.plugin.registry import Registry

# The largest per-rank batch a communication case sends on this machine; a declared bound above it
# is run at this size and the case id says so (``-tokens4096-of16384``).
MAX_CASE_TOKENS_PER_RANK = 4096
# The batch an unbounded mode is run at, per rank.
UNBOUNDED_CASE_TOKENS = 256
# World sizes tried where a mode admits them ("any" means these).
CASE_WORLD_SIZES = (1, 2, 3, 4)
# The batch an experts block without a declared token bound is run at once: what the planner's
# default deployment sends one forward (``Deployment().max_tokens_per_rank``), past every other
# shape's batch (at most 2049 tokens), with small sizes so it stays fast on a CPU. (At 2048 a
# kernel with a fixed 2048-row workspace passed, and the planner chose it for the default
# 4096-token deployment.)
UNBOUNDED_CASE_TOKENS_PER_FORWARD = Deployment().max_tokens_per_rank
# The largest batch an experts case sends; a declared bound above it is run at this size and the
# case id says so (``token_bound-16384-of-65536``).
MAX_CASE_TOKENS_PER_FORWARD = 16384
# An undeclared bound claims every count, not only the default deployment's: an unbounded block is
# run past it too, at twice it and one more (odd, past every power of two up to it), on the same
# small sizes (a backend right up to 4096 tokens and wrong past them passed at 4096).
UNBOUNDED_PAST_CASE_TOKENS = 2 * UNBOUNDED_CASE_TOKENS_PER_FORWARD + 1
# The input scale of the ``large_activations`` case (hidden states about N(0, 256^2), amax about
# 1000): the gated intermediate then reaches about 1e5-1e6 and the output about 1e5, past
# float16's largest value (65504) and far inside bfloat16's and float32's (3.4e38). Activations
# of a bf16 model are that large (residual-stream outliers): a backend that keeps its
# intermediate or its output in float16 returns inf there. Only for blocks whose activations are
# bf16 (a float16 model overflowing at 65504 is legitimate); an FP8 or NVFP4 activation scale is
# derived from the same amax, so the inputs are inside those formats' ranges too.
LARGE_ACTIVATION_SCALE = 256.0


def case_seed(case_id: str, seed: int = 0) -> int:
    """The input seed of a case: a stable hash of its id (the same in every process) and ``seed``."""
    return zlib.crc32(f"{seed}:{case_id}".encode()) & 0x7FFFFFFF


@attrs.frozen
class Shape:
    """One input shape: tokens, hidden, intermediate, experts, top-k and a routing pattern."""

    name: str
    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    # "random" | "one_expert" | "skip_experts" | "remote_slots" | "every_expert"
    routing: str = "random"
    # "random" (about N(0, 1)) | "gelu_tail": every gate pre-activation in about [-4, -3]
    gates: str = "random"
    # the hidden states' scale: about N(0, input_scale^2)
    input_scale: float = 1.0
    # the backend runs as rank ep_rank of ep_size: ``experts`` is its local experts' count, the
    # layer has ``experts * ep_size``, the dispatched ids are local (0 .. experts - 1) or -1
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def global_experts(self) -> int:
        return self.experts * self.ep_size

    @property
    def label(self) -> str:
        return f"{self.name}-h{self.hidden}i{self.intermediate}"


def _up(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)


def _ragged(near: int, m: int) -> int | None:
    """The first multiple of ``m`` from ``near`` on that is not a multiple of 16 (None if none)."""
    if 16 % m == 0 and m >= 16:
        return None
    v = _up(near, m)
    for _ in range(64):
        if v % 16:
            return v
        v += m
    return None


def size_multiple(support: Support, fmt: F.WeightFormat) -> int:
    """The step of admitted hidden/intermediate sizes: the block's and the storage's, together."""
    return math.lcm(max(support.shape_multiple, 1), fmt.stored_as.size_multiple)


def activation_dtype(fmt: F.WeightFormat) -> str:
    """The activation dtype a layer of ``fmt`` is tried in: its own 16-bit storage (``float16``),
    else ``bfloat16``."""
    return "float16" if fmt.stored_as.element == "float16" else "bfloat16"


def token_bound_shapes(support: Support, m: int) -> tuple[Shape, ...]:
    """:func:`token_bound_shape`, and for a block that declares no bound, a batch past it too
    (:data:`UNBOUNDED_PAST_CASE_TOKENS` tokens, same sizes)."""
    at = token_bound_shape(support, m)
    if support.max_tokens_per_forward is not None:
        return (at,)
    n = UNBOUNDED_PAST_CASE_TOKENS
    return at, attrs.evolve(at, name=f"unbounded_tokens{n}", tokens=n)


def token_bound_shape(support: Support, m: int) -> Shape:
    """The batch of the block's token bound: exactly ``max_tokens_per_forward`` tokens (at most
    :data:`MAX_CASE_TOKENS_PER_FORWARD`, the id then says of what), or, for a block that declares
    none, :data:`UNBOUNDED_CASE_TOKENS_PER_FORWARD` tokens, past every other shape's batch."""
    bound = support.max_tokens_per_forward
    h, i = _up(32, m), _up(16, m)
    if bound is None:
        n = UNBOUNDED_CASE_TOKENS_PER_FORWARD
        return Shape(f"unbounded_tokens{n}", n, h, i, 8, 2)
    n = min(bound, MAX_CASE_TOKENS_PER_FORWARD)
    name = f"token_bound{n}" + (f"-of{bound}" if n < bound else "")
    return Shape(name, n, h, i, 8, 2)


def shapes_for(support: Support, fmt: F.WeightFormat) -> tuple[Shape, ...]:
    """The shapes a block is tried on, from its own ``shape_multiple`` and the format's storage,
    and its token bound: none has more tokens than the block declares it runs in one forward
    (``max_tokens_per_forward``), and one has exactly that many (:func:`token_bound_shape`)."""
    m = size_multiple(support, fmt)
    h, i = _up(64, m), _up(32, m)
    shapes = [
        Shape("one_token", 1, h, i, 8, 2),
        Shape("all_to_one_expert", 9, h, _up(32, m), 8, 1, "one_expert"),
        # one expert's rows past a kernel tile or block (256 and fewer rows pass): 300 to one
        Shape("all_to_one_expert_batch", 300, h, i, 8, 1, "one_expert"),
        Shape("idle_experts", 12, h, _up(48, m), 8, 2, "skip_experts"),
        Shape("zero_tokens", 0, h, i, 4, 2),
        Shape("batch", 33, _up(128, m), h, 8, 2),
        # experts on other ranks: some top-k ids are -1 (token-major only)
        Shape("remote_slots", 10, h, i, 8, 3, "remote_slots"),
        # the same on rank 1 of 2: its 8 experts are the layer's 8-15, dispatched as local ids
        # 0-7 (a backend that subtracts first_local_expert again, or reads global ids, is caught;
        # on rank 0 the offset is 0 and hides it)
        Shape("remote_slots_rank1of2", 10, h, i, 8, 3, "remote_slots", ep_rank=1, ep_size=2),
        # rank 1 of 2 with every slot local, in every layout: masked blocks are this rank's
        # experts 0-7 (the layer's 8-15); a masked path that reads its experts by global id, or
        # adds first_local_expert, is caught (remote slots are token-major only)
        Shape("local_slots_rank1of2", 10, h, i, 8, 2, ep_rank=1, ep_size=2),
        # the smallest sizes the declaration admits, in a few tokens and in a batch large enough
        # for a backend's large-batch path (the GEMM-shaped one)
        Shape("smallest_sizes", 5, m, m, 4, 2),
        Shape("smallest_sizes_batch", 300, m, m, 4, 2),
        # enough output elements for the bias check to be reliable
        Shape("bias", 512, h, i, 8, 2),
        # as many experts as real models have, every one of them routed to (3 slots each): an
        # expert id mishandled past 8, 16, 32 or 64 is caught
        Shape("many_experts", 48, h, i, 128, 8, "every_expert"),
        # gelu only: every gate in GELU's negative tail, where the tanh approximation is 15-45%
        # off the exact (erf) GELU the reference computes (on N(0, 1) gates it is 1e-4 of the
        # range, inside every budget: a tanh-GELU backend passed the other cases)
        Shape("gelu_tail", 128, h, i, 8, 2, gates="gelu_tail"),
        # long reductions, as real layers have (hidden 2048-7168): an accumulator kept in the
        # model dtype loses about sqrt(K / 16) roundings' worth of precision, which K <= 128
        # hides inside the budget (a backend rounding its sum to bf16 every 16 columns passed)
        Shape("long_reduction", 8, _up(4096, m), _up(512, m), 2, 2),
        # real models' widths past the long reduction's: DeepSeek-V3's hidden size (7168, not a
        # power of two) and Mixtral's intermediate size (14336), each with the other side small
        # so the case stays cheap (a kernel with a fixed 4096-wide buffer, or an index or a grid
        # dimension that overflows past it, passed every other shape)
        Shape("wide_hidden", 4, _up(7168, m), _up(64, m), 2, 2),
        Shape("wide_intermediate", 4, _up(128, m), _up(14336, m), 2, 2),
        # batches between the 512 of the shapes above and the 4096 of the token bound, each one
        # past a power of two (a backend wrong from 600 to 4095 tokens passed every other case)
        Shape("mid_batch1025", 1025, h, i, 8, 2),
        Shape("mid_batch2049", 2049, h, i, 8, 2),
    ]
    if activation_dtype(fmt) != "float16":
        # large-magnitude activations, in range for bf16 and past float16's (an intermediate or
        # an output kept in float16 overflows to inf; a float16 model's own overflow is not
        # asked about)
        shapes.append(Shape("large_activations", 16, h, i, 8, 2,
                            input_scale=LARGE_ACTIVATION_SCALE))
    rh, ri = _ragged(72, m), _ragged(40, m)
    if rh is not None and ri is not None:  # admitted sizes that are not multiples of 16
        shapes.append(Shape("not_multiple_of_16", 7, rh, ri, 6, 3))
        shapes.append(Shape("not_multiple_of_16_batch", 300, rh, ri, 6, 3))
    # the planner never sends a forward past the block's bound: neither does the suite
    shapes = [sh for sh in shapes if support.admits_tokens(sh.tokens)]
    shapes.extend(token_bound_shapes(support, m))
    return tuple(shapes)


def _problem(fmt: str, activation: str, shape: Shape) -> LayerProblem:
    return LayerProblem("conformance.layer", fmt, activation, shape.global_experts, shape.top_k,
                        shape.hidden, shape.intermediate)


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
                f"-{self.shape.label}")


@attrs.frozen
class GraphCase:
    """A backend's ``cuda_graphs=True`` promise, on one case of one of its blocks: the case is run
    with its forward captured and replayed in a CUDA graph (where the machine has CUDA and the
    block runs on it), else skipped saying that the promise went unchecked."""

    experts_case: ExpertsCase

    @property
    def backend(self) -> str:
        return self.experts_case.backend

    @property
    def id(self) -> str:
        c = self.experts_case
        return f"{c.backend}-cuda_graphs-{c.id[len(c.backend) + 1:]}"


@attrs.frozen
class RefusalCase:
    backend: str
    format: str
    activation: str
    expected: str  # a Reason value
    environment: str  # target name the refusal is checked on
    hidden: int = 128
    intermediate: int = 64

    @property
    def id(self) -> str:
        size = "" if (self.hidden, self.intermediate) == (128, 64) else (
            f"-h{self.hidden}i{self.intermediate}")
        return (f"{self.backend}-refuses-{self.format}-{self.activation}{size}-on-"
                f"{self.environment}")


@attrs.frozen
class CommCase:
    """One mode at one world size, run with ``tokens`` per rank (its bound, where it has one)."""

    backend: str
    mode: str
    layout: str
    payload: str
    world_size: int
    tokens: int
    declared_bound: int | None = None

    @property
    def id(self) -> str:
        t = f"-tokens{self.tokens}"
        if self.declared_bound is not None and self.tokens < self.declared_bound:
            t += f"-of{self.declared_bound}"  # the declared bound is too large to run here
        return f"{self.backend}-{self.mode}-{self.payload}-ws{self.world_size}{t}"


@attrs.frozen
class TokenBoundCase:
    """A bounded mode: a batch one past its bound must not be given to it by the planner."""

    backend: str
    mode: str
    bound: int
    world_size: int

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.mode}-refuses-{self.bound + 1}-tokens-ws{self.world_size}"


def _payload_allowed(registry: Registry, runs_as: str, payload: str) -> bool:
    if payload == F.UNQUANTIZED:
        return True
    return registry.formats[runs_as].spec.activation_payload == payload


def experts_cases(registry: Registry, spec: ExpertsBackendSpec) -> list[ExpertsCase]:
    """Every declared (format, activation, layout, payload) on every shape the block admits."""
    out = []
    for index, s in enumerate(spec.supports):
        for fmt in sorted(s.formats):
            runs_as = s.runs(fmt)
            for shape in shapes_for(s, registry.formats[fmt].spec):
                for act in sorted(s.activations):
                    if shape.gates == "gelu_tail" and act != F.GELU:
                        continue  # its inputs are chosen for GELU
                    if not s.check(_problem(fmt, act, shape)):
                        continue  # the declaration's own rule says no (never by construction)
                    for layout in sorted(s.layouts):
                        if shape.routing == "remote_slots" and layout != F.TOKEN_MAJOR:
                            continue
                        for payload in sorted(s.payloads):
                            if _payload_allowed(registry, runs_as, payload):
                                out.append(ExpertsCase(spec.name, fmt, runs_as, act, layout,
                                                       payload, shape, index))
    return out


def graph_cases(registry: Registry, spec: ExpertsBackendSpec) -> list[GraphCase]:
    """For a backend that declares ``cuda_graphs=True``: one case of each block (a decode-like
    batch, else the block's first case with tokens), its capture and replay checked on CUDA."""
    if not spec.cuda_graphs:
        return []
    out = []
    every = experts_cases(registry, spec)
    for index in range(len(spec.supports)):
        mine = [c for c in every if c.support_index == index and c.shape.tokens]
        pick = next((c for c in mine if c.shape.name == "batch"), mine[0] if mine else None)
        if pick is not None:
            out.append(GraphCase(pick))
    return out


def _target_for(s: Support) -> str:
    """A described environment where this Support block's hardware matches."""
    hw = s.hardware
    if "cpu" in hw.devices:
        return "cpu"
    if hw.cuda_capabilities:
        lo = hw.cuda_capabilities[0].min
        return f"cuda:{lo[0]}.{lo[1]}"
    return "cuda:9.0"


def _admitted_sizes(step: int) -> tuple[int, int]:
    """(hidden, intermediate) of a refusal case: 128 and 64 rounded up to the sizes' multiple."""
    return _up(128, step), _up(64, step)


def refusal_cases(registry: Registry, spec: ExpertsBackendSpec) -> list[RefusalCase]:
    """Undeclared combinations and the reason the planner must give for each.

    - a registered format declared by no block: ``unsupported_format``, on a machine where one of
      the backend's blocks matches (so the format, not the device, is the reason);
    - an activation declared by no block: ``unsupported_activation``;
    - sizes the format's storage admits but no block declaring the format does:
      ``unsupported_shape``;
    - a declared format on a device kind no block of that format runs on: ``unsupported_device``;
    - a declared format on a CUDA capability outside every range of the blocks declaring it:
      ``compute_capability``.
    """
    out = []
    declared = {f for t in spec.supports for f in t.formats}
    acts = {a for t in spec.supports for a in t.activations}
    for s in spec.supports:
        target = _target_for(s)
        # sizes the block admits, so that only the probed property can be the reason
        h, i = _admitted_sizes(size_multiple(s, registry.formats[sorted(s.formats)[0]].spec))
        for fmt in sorted(set(registry.formats) - declared):
            out.append(RefusalCase(spec.name, fmt, sorted(s.activations)[0],
                                   "unsupported_format", target, h, i))
        for act in sorted(F.ACTIVATIONS - acts):
            out.append(RefusalCase(spec.name, sorted(s.formats)[0], act,
                                   "unsupported_activation", target, h, i))
    for fmt in sorted(declared):
        blocks = [t for t in spec.supports if fmt in t.formats]
        act = sorted(blocks[0].activations)[0]
        storage = registry.formats[fmt].spec.stored_as.size_multiple
        steps = [size_multiple(t, registry.formats[fmt].spec) for t in blocks]
        ah, ai = _admitted_sizes(min(steps))
        if min(steps) > storage:  # every block asks for more than the storage does
            h = i = min(steps) + storage
            env = _target_for(blocks[0])
            if all(h % st for st in steps):
                out.append(RefusalCase(spec.name, fmt, act, "unsupported_shape", env, h, i))
        devices = {d for t in blocks for d in t.hardware.devices}
        if "cpu" not in devices:
            out.append(RefusalCase(spec.name, fmt, act, "unsupported_device", "cpu", ah, ai))
        if "cuda" in devices and all(t.hardware.cuda_capabilities for t in blocks
                                     if "cuda" in t.hardware.devices):
            for probe in ("7.0", "8.0", "9.0", "10.0", "12.0"):
                env = Environment.for_target(f"cuda:{probe}")
                if not any(t.hardware.check(env) for t in blocks):
                    out.append(RefusalCase(spec.name, fmt, act, "compute_capability",
                                           f"cuda:{probe}", ah, ai))
    return list(dict.fromkeys(out))


def case_world_sizes(mode: CommSupport) -> list[int]:
    sizes = [n for n in CASE_WORLD_SIZES if mode.allows_world_size(n)]
    if mode.world_sizes is not None:
        sizes += sorted(n for n in mode.world_sizes if n not in sizes and n <= max(
            CASE_WORLD_SIZES))
    return sizes


def case_tokens(mode: CommSupport) -> int:
    if mode.max_tokens_per_rank is None:
        return UNBOUNDED_CASE_TOKENS
    return min(mode.max_tokens_per_rank, MAX_CASE_TOKENS_PER_RANK)


def comm_cases(registry: Registry, spec: CommBackendSpec) -> list[CommCase]:
    """Each mode, payload and world size, at the mode's declared token bound."""
    out = []
    for s in spec.supports:
        for payload in sorted(s.payloads):
            for ws in case_world_sizes(s):
                out.append(CommCase(spec.name, s.mode, s.layout, payload, ws, case_tokens(s),
                                    s.max_tokens_per_rank))
    return out


def token_bound_cases(registry: Registry, spec: CommBackendSpec) -> list[TokenBoundCase]:
    out = []
    for s in spec.supports:
        sizes = case_world_sizes(s)
        if s.max_tokens_per_rank is not None and sizes:
            out.append(TokenBoundCase(spec.name, s.mode, s.max_tokens_per_rank, sizes[0]))
    return out


def known_case_ids(registry: Registry, names) -> list[str]:
    """Every case id the suite generates for the backends ``names`` (and the names themselves,
    the ids of the entry-point and factory checks)."""
    ids = list(names)
    for make, table in ((experts_cases, registry.experts), (graph_cases, registry.experts),
                        (refusal_cases, registry.experts), (comm_cases, registry.comms),
                        (token_bound_cases, registry.comms)):
        ids += [c.id for n in names if n in table for c in make(registry, table[n].spec)]
    return ids


def unknown_case_ids(ids, names, only) -> str | None:
    """The sentence for ``--case`` ids (``only``) among no case ``ids`` of the backends ``names``
    (None if each is one): a mistyped replay id must fail naming it and a few known ids."""
    unknown = sorted(set(only) - set(ids))
    if not unknown:
        return None
    import difflib

    near = [c for u in unknown for c in difflib.get_close_matches(u, ids, n=3, cutoff=0.5)]
    examples = list(dict.fromkeys(near + [c for c in ids if c not in names]))[:5]
    return (f"--case {', '.join(repr(u) for u in unknown)}: no case of {', '.join(names)} has "
            f"this id ({len(ids)} known, e.g. {', '.join(repr(c) for c in examples)}); the "
            f"replay command of a failure prints the exact id")
