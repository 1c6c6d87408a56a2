"""The planner: from layer formats, deployment and environment to a plan, using declarations only.

For every MoE layer it picks a (communication, experts) pair whose layouts and payloads match, by
declared priority, and reports every backend it turned down with a reason from :class:`Reason`.
Between candidates the declarations cannot tell apart (equally exact: same runs-as format,
communication backend and payloads) a tuning cache's measurements choose, when one is given
(docs/tuning.md). It never looks at a checkpoint's quantization method name or compares backend
names, except against the names a user asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import attrs

from moe_runtime import formats as F
from moe_runtime.backend_api import LayerProblem
from moe_runtime.declarations import (
    CommBackendSpec,
    CommSupport,
    ExpertsBackendSpec,
    Reason,
    Support,
    check_factory,
    forget_factory_problems,
    is_bytes_per_weight,
)
from moe_runtime.environment import Environment
from moe_runtime.plugin.registry import Registry

if TYPE_CHECKING:  # records only: the tuning package imports the planner
    from moe_runtime.tuning.cache import Tuning


@attrs.frozen
class Deployment:
    """How the user wants to run.

    :param ep_size: ranks in the expert-parallel group.
    :param experts_backend: a pinned experts backend name, or ``None`` for the planner's choice.
    :param comm_backend: a pinned communication backend name, or ``None``.
    :param payload: a pinned dispatch payload, or ``None`` to derive it from both declarations.
    :param max_tokens_per_rank: the largest batch per rank the deployment will send.
    :param allow_degradation: accept declared degradations (``runs_as``).
    """

    ep_size: int = 1
    experts_backend: str | None = None
    comm_backend: str | None = None
    payload: str | None = None
    max_tokens_per_rank: int = 4096
    allow_degradation: bool = True


@attrs.frozen
class Rejection:
    layer: str
    role: str  # "experts" | "communication"
    backend: str
    reason: Reason
    message: str

    def to_json(self) -> dict:
        return {
            "layer": self.layer,
            "role": self.role,
            "backend": self.backend,
            "reason": self.reason.value,
            "message": self.message,
        }

    @classmethod
    def from_json(cls, data: dict) -> Rejection:
        return cls(data["layer"], data["role"], data["backend"], Reason(data["reason"]),
                   data["message"])


@attrs.frozen
class ModeChoice:
    """One communication mode a layer may use, and the batches it serves.

    :param max_tokens_per_rank: the mode serves batches of at most this many tokens per rank
        (``None``: any batch).
    """

    comm_mode: str
    layout: str
    payload: str
    max_tokens_per_rank: int | None = None

    def to_json(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ModeChoice:
        return cls(data["comm_mode"], data["layout"], data["payload"],
                   data.get("max_tokens_per_rank"))


def first_mode_admitting(modes: Sequence[ModeChoice], tokens_per_rank: int) -> ModeChoice | None:
    """The first of ``modes`` whose bound admits a batch of ``tokens_per_rank``, or ``None``."""
    for m in modes:
        if m.max_tokens_per_rank is None or tokens_per_rank <= m.max_tokens_per_rank:
            return m
    return None


@attrs.frozen
class ExpertsRange:
    """Batches of at most ``max_tokens_per_rank`` tokens per rank (and more than the previous
    range's bound) run on ``experts`` instead of the plan's own: a measured choice per batch size
    (``--token-ranges``, docs/tuning.md), between plans that differ in the experts backend only.

    :param prepared_bytes_per_weight: that backend's declaration, as
        :attr:`LayerPlan.prepared_bytes_per_weight` (its weights are held beside the plan's).
    :param note: the measurement that chose it.
    """

    max_tokens_per_rank: int
    experts: str
    prepared_bytes_per_weight: float | None = None
    note: str = ""

    def to_json(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ExpertsRange:
        bound = data["max_tokens_per_rank"]
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:
            raise ValueError(f"experts_by_tokens: max_tokens_per_rank is {bound!r}; accepted: a "
                             "positive whole number of tokens")
        held = data.get("prepared_bytes_per_weight")
        if held is not None and not is_bytes_per_weight(held):
            raise ValueError(f"experts_by_tokens: prepared_bytes_per_weight is {held!r}; "
                             "accepted: a positive finite number, or null")
        return cls(bound, str(data["experts"]), held, str(data.get("note", "")))


@attrs.frozen
class LayerPlan:
    """The decision for one MoE layer.

    ``modes`` lists the communication modes in the order they are tried per batch: the first whose
    bound admits the batch is used (e.g. DeepEP low-latency for decode batches, normal mode for the
    rest). ``comm_mode``/``layout``/``payload`` describe the last one, which admits every batch.
    ``prepared_bytes_per_weight`` is the chosen block's declaration (:class:`Support`): bytes per
    expert weight the backend holds after ``prepare``; ``None``: the format's storage.
    """

    problem: LayerProblem
    experts: str
    comm: str
    comm_mode: str
    layout: str
    payload: str
    runs_as: str
    degradations: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    alternatives: tuple[str, ...] = ()
    modes: tuple[ModeChoice, ...] = ()
    prepared_bytes_per_weight: float | None = None
    #: measured per batch size (``--token-ranges``): the first range whose bound admits a batch
    #: runs it on its experts backend; batches past every range run on :attr:`experts`
    experts_by_tokens: tuple[ExpertsRange, ...] = ()

    def experts_for(self, tokens_per_rank: int) -> str:
        """The experts backend a batch of ``tokens_per_rank`` tokens (the largest over ranks)
        runs on."""
        for r in self.experts_by_tokens:
            if tokens_per_rank <= r.max_tokens_per_rank:
                return r.experts
        return self.experts

    @property
    def experts_backends(self) -> tuple[str, ...]:
        """Every experts backend this layer holds weights for: the plan's, then its ranges'."""
        return tuple(dict.fromkeys([self.experts, *(r.experts for r in self.experts_by_tokens)]))

    def mode_for(self, tokens_per_rank: int) -> ModeChoice:
        """The mode a batch of ``tokens_per_rank`` tokens (the largest over ranks) uses."""
        mode = first_mode_admitting(self.modes, tokens_per_rank)
        if mode is not None:
            return mode
        raise ValueError(
            f"layer {self.problem.name}: a batch of {tokens_per_rank} tokens per rank exceeds every "
            f"mode of {self.comm} (bounds {[m.max_tokens_per_rank for m in self.modes]}); the plan "
            "was made for smaller batches: raise --max-tokens-per-rank when planning")

    def to_json(self) -> dict:
        return {
            "layer": self.problem.name,
            "format": self.problem.format,
            "activation": self.problem.activation,
            "communication": self.comm,
            "communication_mode": self.comm_mode,
            "experts": self.experts,
            "layout": self.layout,
            "payload": self.payload,
            "runs_as": self.runs_as,
            "degradations": list(self.degradations),
            "notes": list(self.notes),
            "alternatives": list(self.alternatives),
            "modes": [m.to_json() for m in self.modes],
            "prepared_bytes_per_weight": self.prepared_bytes_per_weight,
            "experts_by_tokens": [r.to_json() for r in self.experts_by_tokens],
            "problem": attrs.asdict(self.problem),
        }

    @classmethod
    def from_json(cls, data: dict) -> LayerPlan:
        """The inverse of :meth:`to_json` (``problem`` holds the layer's sizes)."""
        held = data.get("prepared_bytes_per_weight")
        if held is not None and not is_bytes_per_weight(held):
            raise ValueError(
                f"layer {data.get('layer')!r}: prepared_bytes_per_weight is {held!r}; accepted: a "
                "positive finite number (bytes per expert weight after prepare), or null or "
                "absent for the format's storage")
        return cls(
            problem=LayerProblem(**data["problem"]), experts=data["experts"],
            comm=data["communication"], comm_mode=data["communication_mode"],
            layout=data["layout"], payload=data["payload"], runs_as=data["runs_as"],
            degradations=tuple(data.get("degradations", ())), notes=tuple(data.get("notes", ())),
            alternatives=tuple(data.get("alternatives", ())),
            modes=tuple(ModeChoice.from_json(m) for m in data.get("modes", ())),
            prepared_bytes_per_weight=held,
            experts_by_tokens=tuple(ExpertsRange.from_json(r)
                                    for r in data.get("experts_by_tokens") or ()),
        )


@attrs.frozen
class Plan:
    """The decisions for every MoE layer, the rejections on the way, and what they were made for.

    One value from ``moe-runtime plan --json`` to ``load_model(path, plan=...)`` and the executor:
    :meth:`to_json` and :meth:`from_json` are inverses (``Plan.from_json(p.to_json()) == p``), and
    ``from_json`` also reads the output of ``moe-runtime plan --json`` (extra keys are ignored).
    """

    layers: tuple[LayerPlan, ...]
    rejections: tuple[Rejection, ...]
    environment: Environment
    deployment: Deployment
    #: notes on the plan as a whole (a tuning cache that was read, or ignored and why)
    notes: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def for_layer(self, name: str) -> LayerPlan:
        for lp in self.layers:
            if lp.problem.name == name:
                return lp
        raise KeyError(f"no MoE layer named {name!r} in this plan")

    def to_json(self) -> dict:
        return {
            "environment": self.environment.to_json(),
            "deployment": attrs.asdict(self.deployment),
            "layers": [lp.to_json() for lp in self.layers],
            "rejections": [r.to_json() for r in self.rejections],
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        """A plan from :meth:`to_json`'s output; a :class:`PlanError` names what is missing."""
        try:
            return cls(
                layers=tuple(LayerPlan.from_json(lp) for lp in data["layers"]),
                rejections=tuple(Rejection.from_json(r) for r in data.get("rejections", ())),
                environment=Environment.from_json(data["environment"]),
                deployment=Deployment(**data["deployment"]),
                notes=tuple(data.get("notes", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(
                f"not a moe-runtime plan ({type(exc).__name__}: {exc}); write one with "
                "`moe-runtime plan CHECKPOINT --json` or Plan.to_json()") from None


class PlanError(ValueError):
    """No backend pair can run a layer as asked. ``rejections`` says why, backend by backend."""

    def __init__(self, message: str, rejections: Sequence[Rejection] = ()) -> None:
        super().__init__(message)
        self.rejections = tuple(rejections)


# --------------------------------------------------------------------------- declaration checks
# The matching rule itself is public and lives with the records: Support.check, CommSupport.check.


@attrs.frozen
class _ExpertsOption:
    spec: ExpertsBackendSpec
    support: Support
    runs_as: str


def tokens_per_forward(dep: Deployment) -> int:
    """The most tokens one experts ``forward`` may receive in this deployment: every rank's largest
    batch, all routed to one rank (``max_tokens_per_rank`` times the expert-parallel size)."""
    return dep.max_tokens_per_rank * max(dep.ep_size, 1)


def evaluate_experts(
    spec: ExpertsBackendSpec, p: LayerProblem, env: Environment, *, allow_degradation: bool = True,
    tokens: int | None = None,
) -> tuple[list[_ExpertsOption], tuple[Reason, str] | None]:
    """The Support blocks of ``spec`` that accept layer ``p`` here (native ones first), or why none.

    ``tokens``: the most tokens one forward may receive (:func:`tokens_per_forward`), checked
    against each block's ``max_tokens_per_forward`` (``None``: not checked)."""
    blocks = spec.accepting(p, env, allow_degradation=allow_degradation,
                            tokens_per_forward=tokens)
    if blocks and not (importable := check_factory(spec, env)):
        return [], (importable.reason, importable.message)
    if blocks:
        return [_ExpertsOption(spec, s, s.runs(p.format)) for s in blocks], None
    v = spec.check(p, env, allow_degradation=allow_degradation, tokens_per_forward=tokens)
    return [], (v.reason, v.message)


def evaluate_comm(
    spec: CommBackendSpec, env: Environment, dep: Deployment
) -> tuple[list[CommSupport], tuple[Reason, str] | None]:
    """The modes of ``spec`` usable for this deployment here, or why none.

    Token bounds are not checked here: a bounded mode still serves the batches under its bound
    when another mode of the backend covers the rest (see :func:`plan_layer`).
    """
    modes = spec.accepting(env, world_size=dep.ep_size)
    if modes and not (importable := check_factory(spec, env)):
        return [], (importable.reason, importable.message)
    if modes:
        return modes, None
    v = spec.check(env, world_size=dep.ep_size)
    return [], (v.reason, v.message)


def _ranked(table: dict) -> list:
    return sorted((r.spec for r in table.values()), key=lambda s: (-s.priority, s.name))


def _derive_payload(
    opt: _ExpertsOption, mode: CommSupport, registry: Registry, pinned: str | None
) -> tuple[str | None, str]:
    """The dispatch payload, from both sides' declarations (and the layer's runs-as format).

    A quantized payload is only possible when the format the experts run quantizes activations
    to it (its calibrated ``activation_payload``) and both sides declare it. Among the possible
    payloads the smallest wins. Returns ``(payload or None, why)``.
    """
    fmt = registry.formats[opt.runs_as].spec
    possible = {F.UNQUANTIZED}
    if fmt.activation_payload != F.UNQUANTIZED:
        possible.add(fmt.activation_payload)
    common = possible & opt.support.payloads & mode.payloads
    if pinned is not None:
        if pinned in common:
            return pinned, f"payload {pinned} as requested"
        return None, (
            f"payload {pinned} is not possible: format {opt.runs_as} allows "
            f"{', '.join(sorted(possible))}, experts backend {opt.spec.name} accepts "
            f"{', '.join(sorted(opt.support.payloads))}, communication mode {mode.mode} carries "
            f"{', '.join(sorted(mode.payloads))}"
        )
    if not common:
        return None, (
            f"no payload in common: experts backend {opt.spec.name} accepts "
            f"{', '.join(sorted(opt.support.payloads))}, communication mode {mode.mode} carries "
            f"{', '.join(sorted(mode.payloads))}"
        )
    best = min(common, key=lambda n: (registry.payloads[n].spec.bytes_per_element, n))
    return best, f"payload {best}"


def check_deployment(registry: Registry, dep: Deployment) -> None:
    """Pinned names must be registered; a clear error lists the ones that are."""
    for pinned, table, role, flag in (
        (dep.experts_backend, registry.experts, "experts", "--moe-runner-backend"),
        (dep.comm_backend, registry.comms, "communication", "--moe-a2a-backend"),
    ):
        if pinned is not None and pinned not in table:
            from moe_runtime.plugin.first_party import unregistered_backend_hint  # message text

            raise PlanError(
                f"{flag} {pinned!r} is not a registered {role} backend; registered: "
                f"{', '.join(sorted(table)) or 'none'} (see `moe-runtime plugins`)"
                + unregistered_backend_hint(pinned)
            )
    if dep.payload is not None and dep.payload not in registry.payloads:
        raise PlanError(
            f"payload {dep.payload!r} is not registered; registered payloads: "
            f"{', '.join(sorted(registry.payloads))}"
        )
    if dep.ep_size < 1:
        raise PlanError(f"expert-parallel size must be at least 1, got {dep.ep_size}")


# --------------------------------------------------------------------------- planning one layer
# plan_layer runs these steps in order; each step builds the rejections (and their sentences) of
# what it turned down, and nothing later rewrites them:
#   1. resolve_format      the layer's format must be registered
#   2. filter_experts      every experts backend checked with ExpertsBackendSpec.check
#   3. filter_comms        every communication backend checked with CommBackendSpec.check
#   4. refuse_*            nothing (or not what was pinned) is left: one error naming why
#   5. select_modes        per (experts, communication) pair: the modes and payloads that pair up
#                          (pair_backends: each experts backend with the first backend it pairs with)
#   6. describe_choice     degradations and notes of each pairing, for people (layer_candidates)
#   7. choose              the first candidate, or the measured fastest of those tied with it


@attrs.frozen
class _Candidates:
    """What the filtering steps left, and what they turned down."""

    experts: tuple[_ExpertsOption, ...]
    comms: tuple[tuple[CommBackendSpec, tuple[CommSupport, ...]], ...]
    accepting: tuple[str, ...]  # experts backends that could run the layer, pinned or not
    rejections: tuple[Rejection, ...]


def resolve_format(p: LayerProblem, registry: Registry) -> F.WeightFormat:
    """Step 1: the layer's weight format, which some plugin must have registered."""
    if p.format not in registry.formats:
        from moe_runtime.plugin.manager import BUILTIN_NAME

        blocked = [i.name for i in registry.plugin_infos if i.status == "blocked"]
        why = (f"; the built-in plugin, which registers every built-in format, is blocked "
               f"(-p no:{BUILTIN_NAME} or MOE_RUNTIME_BLOCK_PLUGINS)"
               if BUILTIN_NAME in blocked else
               f"; blocked plugins: {', '.join(blocked)}" if blocked else "")
        raise PlanError(
            f"layer {p.name}: format {p.format!r} is not registered by any plugin; registered "
            f"formats: {', '.join(sorted(registry.formats)) or 'none'}{why}"
        )
    return registry.formats[p.format].spec


def filter_experts(p: LayerProblem, registry: Registry, env: Environment, dep: Deployment
                   ) -> tuple[list[_ExpertsOption], list[str], list[Rejection]]:
    """Step 2: the experts blocks that may run ``p`` (ranked), the backends that accept it, and a
    rejection for each backend that does not (or that a pin excludes)."""
    options, accepting, rejections = [], [], []
    for spec in _ranked(registry.experts):
        opts, failure = evaluate_experts(spec, p, env, allow_degradation=dep.allow_degradation,
                                         tokens=tokens_per_forward(dep))
        if failure:
            rejections.append(Rejection(p.name, "experts", spec.name, *failure))
            continue
        accepting.append(spec.name)
        if dep.experts_backend is not None and spec.name != dep.experts_backend:
            rejections.append(Rejection(
                p.name, "experts", spec.name, Reason.NOT_REQUESTED,
                f"could run this layer, but --moe-runner-backend {dep.experts_backend} was asked for",
            ))
            continue
        options.extend(opts)
    return options, accepting, rejections


def filter_comms(p: LayerProblem, registry: Registry, env: Environment, dep: Deployment
                 ) -> tuple[list[tuple[CommBackendSpec, list[CommSupport]]], list[Rejection]]:
    """Step 3: the communication backends (with their usable modes) for this deployment, and a
    rejection for each that cannot run it. A backend a pin excludes is skipped without one."""
    usable, rejections = [], []
    for spec in _ranked(registry.comms):
        modes, failure = evaluate_comm(spec, env, dep)
        if failure:
            rejections.append(Rejection(p.name, "communication", spec.name, *failure))
            continue
        if dep.comm_backend is None or spec.name == dep.comm_backend:
            usable.append((spec, modes))
    return usable, rejections


def refuse_experts(p: LayerProblem, env: Environment, dep: Deployment, accepting: list[str],
                   rejections: list[Rejection]) -> PlanError:
    """Step 4a: no experts block is left. The pinned backend's own rejection, or every one."""
    if dep.experts_backend is not None:
        pinned = dep.experts_backend
        own = [r for r in rejections if r.backend == pinned and r.reason != Reason.NOT_REQUESTED]
        detail = f"{own[0].reason.value}: {own[0].message}" if own else ""
        others = [n for n in accepting if n != pinned]
        return PlanError(
            f"layer {p.name} (format {p.format}, activation {p.activation}): "
            f"experts backend {pinned!r} cannot run it: {detail}. "
            + (f"Experts backends that would run this layer: {', '.join(others)}."
               if others else "No registered experts backend runs this layer here."),
            rejections)
    lines = "; ".join(f"{r.backend}: {r.reason.value}: {r.message}" for r in rejections
                      if r.role == "experts")
    return PlanError(
        f"layer {p.name} (format {p.format}, activation {p.activation}): no experts backend "
        f"can run it on {env.described}. {lines}", rejections)


def refuse_comms(p: LayerProblem, env: Environment, dep: Deployment,
                 rejections: list[Rejection]) -> PlanError:
    """Step 4b: no communication mode is left for the deployment."""
    if dep.comm_backend is not None:
        own = [r for r in rejections if r.backend == dep.comm_backend]
        detail = f"{own[0].reason.value}: {own[0].message}" if own else "no usable mode"
        return PlanError(
            f"layer {p.name}: communication backend {dep.comm_backend!r} cannot run this "
            f"deployment: {detail}", rejections)
    lines = "; ".join(f"{r.backend}: {r.message}" for r in rejections
                      if r.role == "communication")
    return PlanError(
        f"layer {p.name}: no communication backend runs expert parallel size {dep.ep_size} "
        f"on {env.described}. {lines}", rejections)


def _match_mode(p: LayerProblem, opts: list[_ExpertsOption], mode: CommSupport,
                runs_as: str | None, registry: Registry, dep: Deployment
                ) -> tuple[_ExpertsOption, str] | str | None:
    """The first block of ``opts`` that consumes ``mode``'s layout and shares a payload with it:
    ``(block, payload)``; else why the payload failed (a sentence), or ``None`` (no layout)."""
    why_not = None
    for opt in opts:
        if runs_as is not None and opt.runs_as != runs_as:
            continue  # every mode of a layer runs the weights the same way
        if not opt.support.check(p, layout=mode.layout):
            continue
        payload, why = _derive_payload(opt, mode, registry, dep.payload)
        if payload is None:
            why_not = why_not or why
            continue
        return opt, payload
    return why_not


def select_modes(p: LayerProblem, opts: list[_ExpertsOption], cspec: CommBackendSpec,
                 modes: list[CommSupport], registry: Registry, dep: Deployment
                 ) -> tuple[_ExpertsOption | None, list[ModeChoice], list[Rejection]]:
    """Step 5: pair one experts backend's blocks with one communication backend's modes.

    Modes are taken in declared order until one admits every batch of the deployment. Returns the
    block used and the chosen modes, or ``(None, [], rejections)`` when the pair does not work:
    each rejection says which mode failed on layout or payload, or that the bounds fall short.
    """
    chosen: list[ModeChoice] = []
    used: _ExpertsOption | None = None
    failures: list[Rejection] = []
    for mode in modes:
        match = _match_mode(p, opts, mode, used.runs_as if used else None, registry, dep)
        if not isinstance(match, tuple):
            failures.append(_unpaired(p, cspec, mode, opts, why_payload=match))
            continue
        opt, payload = match
        used = used or opt
        chosen.append(ModeChoice(mode.mode, mode.layout, payload, mode.max_tokens_per_rank))
        if mode.max_tokens_per_rank is None or mode.max_tokens_per_rank >= dep.max_tokens_per_rank:
            return used, chosen, failures  # this mode admits every batch of the deployment
    if chosen:
        largest = max(m.max_tokens_per_rank for m in chosen)
        failures.append(Rejection(
            p.name, "communication", cspec.name, Reason.TOKEN_BOUND,
            f"its modes carry at most {largest} tokens per rank; the deployment asks "
            f"for {dep.max_tokens_per_rank} (lower --max-tokens-per-rank / "
            "--max-batch-size, or raise the backend's bound)",
        ))
    return None, [], failures


def _unpaired(p: LayerProblem, cspec: CommBackendSpec, mode: CommSupport,
              opts: list[_ExpertsOption], *, why_payload: str | None) -> Rejection:
    if why_payload is not None:
        return Rejection(p.name, "communication", cspec.name, Reason.UNSUPPORTED_PAYLOAD,
                         why_payload)
    consumes = sorted({lay for o in opts for lay in o.support.layouts})
    return Rejection(
        p.name, "communication", cspec.name, Reason.NO_COMMON_LAYOUT,
        f"mode {mode.mode} produces layout {mode.layout}; experts backend "
        f"{opts[0].spec.name} consumes {', '.join(consumes)}")


def describe_choice(p: LayerProblem, opt: _ExpertsOption, cspec: CommBackendSpec,
                    chosen: list[ModeChoice], registry: Registry, env: Environment
                    ) -> tuple[list[str], list[str]]:
    """Step 6: the degradations and notes a plan shows for the chosen pair."""
    degradations, notes = [], []
    if opt.runs_as != p.format:
        src = registry.formats[p.format].spec
        degradations.append(
            f"{p.format} weights run as {opt.runs_as} by {opt.spec.name}"
            + (f": activations are not quantized to {src.activation_payload}"
               if src.activation_payload != F.UNQUANTIZED else "")
            + (f" ({opt.support.note})" if opt.support.note else "")
        )
    elif opt.support.note:
        notes.append(opt.support.note)
    if len(chosen) > 1:
        notes.append("per batch: " + ", then ".join(
            f"{m.comm_mode} ({m.layout}, {m.payload}"
            + (f", up to {m.max_tokens_per_rank} tokens/rank)" if m.max_tokens_per_rank
               else ")") for m in chosen))
    quantized = sorted({m.payload for m in chosen} - {F.UNQUANTIZED})
    if quantized:
        notes.append(f"dispatch carries {', '.join(quantized)} activations (both sides "
                     "declare it)")
    if env.available is None:
        req = sorted(opt.spec.requires() | cspec.requires())
        if req:
            notes.append(f"assumes {', '.join(req)} importable on the target (not checked)")
    return degradations, notes


def _by_backend(options: list[_ExpertsOption]) -> list[list[_ExpertsOption]]:
    """Ranked backends, each with its accepting blocks (native first)."""
    groups: dict[str, list[_ExpertsOption]] = {}
    for opt in options:
        groups.setdefault(opt.spec.name, []).append(opt)
    return list(groups.values())


@attrs.frozen
class _Pairing:
    """An experts backend's blocks paired with a communication backend (step 5).

    ``failures`` are the pair failures met on the way to it, in ranked order: what a plan that
    chooses this pairing reports as turned down."""

    option: _ExpertsOption
    comm: CommBackendSpec
    modes: tuple[ModeChoice, ...]
    failures: tuple[Rejection, ...]


def pair_backends(p: LayerProblem, experts: list[_ExpertsOption],
                  comms: list[tuple[CommBackendSpec, list[CommSupport]]], registry: Registry,
                  dep: Deployment) -> tuple[list[_Pairing], list[Rejection]]:
    """Step 5 for every experts backend (ranked): its first communication backend (ranked) that
    pairs with it. Returns the pairings and every pair failure met."""
    pairings: list[_Pairing] = []
    failures: list[Rejection] = []
    for opts in _by_backend(experts):
        for cspec, modes in comms:
            opt, chosen, fails = select_modes(p, opts, cspec, modes, registry, dep)
            failures += fails
            if opt is not None:
                pairings.append(_Pairing(opt, cspec, tuple(chosen),
                                         tuple(dict.fromkeys(failures))))
                break
    return pairings, failures


@attrs.frozen
class Candidates:
    """What :func:`layer_candidates` found: the layer plans the planner chooses among.

    :param plans: one per experts backend that runs the layer, in declared order (priority, then
        name); ``plans[0]`` is the declared choice.
    :param rejections: what steps 2 and 3 turned down (reported by every plan).
    :param failures: per plan, the pair failures met on the way to it (reported with it).
    """

    plans: tuple[LayerPlan, ...]
    rejections: tuple[Rejection, ...]
    failures: tuple[tuple[Rejection, ...], ...]

    def result(self, index: int) -> tuple[LayerPlan, list[Rejection]]:
        """Plan ``index`` and what a plan choosing it reports as turned down."""
        return self.plans[index], [*self.rejections, *self.failures[index]]


def _layer_plan(p: LayerProblem, pairing: _Pairing, accepting: list[str], registry: Registry,
                env: Environment) -> LayerPlan:
    """Step 6: the layer plan of one pairing, with its degradations and notes."""
    opt, chosen = pairing.option, list(pairing.modes)
    degradations, notes = describe_choice(p, opt, pairing.comm, chosen, registry, env)
    last = chosen[-1]
    return LayerPlan(
        problem=p, experts=opt.spec.name, comm=pairing.comm.name, comm_mode=last.comm_mode,
        layout=last.layout, payload=last.payload, runs_as=opt.runs_as,
        degradations=tuple(degradations), notes=tuple(notes),
        alternatives=tuple(n for n in accepting if n != opt.spec.name), modes=tuple(chosen),
        prepared_bytes_per_weight=opt.support.prepared_bytes_per_weight,
    )


def layer_candidates(
    p: LayerProblem, *, registry: Registry, environment: Environment, deployment: Deployment
) -> Candidates:
    """Steps 1 to 6: every layer plan that could run ``p``, in declared order; raises
    :class:`PlanError` when none can (or not what was pinned). ``moe-runtime tune`` times these."""
    env, dep = environment, deployment
    resolve_format(p, registry)
    check_deployment(registry, dep)
    experts, accepting, rejections = filter_experts(p, registry, env, dep)
    comms, comm_rejections = filter_comms(p, registry, env, dep)
    rejections += comm_rejections
    if not experts:
        raise refuse_experts(p, env, dep, accepting, rejections)
    if not comms:
        raise refuse_comms(p, env, dep, rejections)
    pairings, pair_failures = pair_backends(p, experts, comms, registry, dep)
    if not pairings:
        rejections.extend(pair_failures)
        lines = "; ".join(f"{r.backend}: {r.reason.value}: {r.message}" for r in pair_failures)
        raise PlanError(
            f"layer {p.name} (format {p.format}): no communication backend pairs with the "
            f"experts backends that run it ({', '.join(sorted({o.spec.name for o in experts}))})"
            f": {lines}", rejections)
    plans = tuple(_layer_plan(p, pg, accepting, registry, env) for pg in pairings)
    return Candidates(plans, tuple(rejections), tuple(pg.failures for pg in pairings))


def equally_exact(a: LayerPlan, b: LayerPlan) -> bool:
    """Plans the declarations cannot tell apart: the weights run as the same format, through the
    same communication backend with the same payloads. Only between such plans may a
    measurement choose (priority is a declared guess of speed; a measurement replaces it)."""
    return (a.runs_as == b.runs_as and a.comm == b.comm
            and [m.payload for m in a.modes] == [m.payload for m in b.modes])


def choose(candidates: Candidates, dep: Deployment, tuning: Tuning | None) -> tuple[int, str]:
    """Step 7: the index of the chosen plan and a note on how (``""``: declared order).

    Without a tuning cache, or without a tie, the declared choice ``plans[0]`` stands; otherwise
    the cache picks among the plans equally exact with it (:meth:`TuningCache.fastest`)."""
    plans = candidates.plans
    tied = [i for i, lp in enumerate(plans) if equally_exact(lp, plans[0])]
    if tuning is None or tuning.cache is None or len(tied) < 2:
        return 0, ""
    pick, note = tuning.cache.fastest([plans[i] for i in tied], dep)
    return (tied[pick] if pick is not None else 0), note


def same_path(a: LayerPlan, b: LayerPlan) -> bool:
    """Plans that differ in the experts backend only: equally exact, and the same communication
    modes with the same layouts, payloads and bounds (one dispatch serves either's experts)."""
    return equally_exact(a, b) and a.modes == b.modes


def choose_ranges(candidates: Candidates, index: int, dep: Deployment,
                  tuning: Tuning | None) -> tuple[tuple[ExpertsRange, ...], str]:
    """Step 8, with ``--token-ranges`` only: for the batch sizes the cache measured below the
    deployment's bucket, the experts backend measured fastest there among the plans on the same
    path as the chosen one (:func:`same_path`); ``((), why not)`` where none differs."""
    if tuning is None or tuning.cache is None or not tuning.token_ranges:
        return (), ""
    plans = candidates.plans
    chosen = plans[index]
    peers = [index] + [i for i, lp in enumerate(plans) if i != index and same_path(lp, chosen)]
    if len(peers) < 2:
        return (), ("one experts backend for every batch size (--token-ranges): no other "
                    "backend runs this layer on the same path")
    found = tuning.cache.ranges([plans[i] for i in peers], dep, margin=tuning.range_margin)
    return found


def plan_layer(
    p: LayerProblem, *, registry: Registry, environment: Environment, deployment: Deployment,
    tuning: Tuning | None = None,
) -> tuple[LayerPlan, list[Rejection]]:
    """Plan one layer; raises :class:`PlanError` when nothing (or not what was pinned) can run it.

    The steps are listed above: the first pair (by experts priority, then communication
    priority) that :func:`select_modes` accepts wins, unless ``tuning`` measured a faster one
    among the plans tied with it (:func:`choose`).
    """
    found = layer_candidates(p, registry=registry, environment=environment,
                             deployment=deployment)
    index, note = choose(found, deployment, tuning)
    plan, rejections = found.result(index)
    if note:
        plan = attrs.evolve(plan, notes=(*plan.notes, note))
    ranges, range_note = choose_ranges(found, index, deployment, tuning)
    if ranges or range_note:
        plan = attrs.evolve(plan, experts_by_tokens=ranges,
                            notes=(*plan.notes, range_note) if range_note else plan.notes)
    return plan, rejections


def plan_model(
    problems: Iterable[LayerProblem],
    *,
    registry: Registry,
    environment: Environment,
    deployment: Deployment = Deployment(),
    tuning: Tuning | None = None,
) -> Plan:
    """Plan every MoE layer; one :class:`PlanError` naming every layer that cannot be planned.

    ``tuning`` (:func:`moe_runtime.tuning.cache.load_tuning`) breaks ties by measurement; its
    notes (which cache was read, or why one was ignored) become the plan's notes.
    """
    check_deployment(registry, deployment)
    forget_factory_problems()  # a kernels package installed or mended since the last plan
    layers, rejections, errors = [], [], []
    for p in problems:
        try:
            lp, rej = plan_layer(p, registry=registry, environment=environment,
                                 deployment=deployment, tuning=tuning)
        except PlanError as exc:
            errors.append(exc)
            continue
        layers.append(lp)
        rejections.extend(rej)
    if errors:
        raise PlanError(
            "\n".join(str(e) for e in errors),
            [r for e in errors for r in e.rejections] + rejections,
        )
    notes = tuning.notes if tuning is not None else ()
    return Plan(tuple(layers), tuple(rejections), environment, deployment, notes)
