"""Plans agreed across expert-parallel ranks at start-up, before the first forward.

Ranks that chose different backends, modes or payloads would hang in their first all-to-all or
exchange garbage. So every rank computes its plan's fingerprint (:func:`plan_fields`: the
moe-runtime version, each plugin's distribution and version, the environment record, the
deployment, every layer's decision, not its notes) and :func:`agree_on_plan` compares them:

1. each rank writes its fields to the process group's key-value store, under a key of this round;
2. each waits for the keys of every rank of the group, at most ``timeout`` seconds;
3. every rank reads every rank's fields and reaches the same verdict: equal, or one
   :class:`PlanMismatchError` naming the ranks and the first field that differs.

A rank whose planning fails reports its refusal instead (:func:`plan_and_agree`), so the others
stop at once; a rank that does not report in time makes the others raise
:class:`PlanAgreementTimeout` naming it. Nothing waits without a bound, and no collective is
issued that a missing rank could block.
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Callable

import attrs

from moe_runtime.planner import Plan, PlanError

_PREFIX = "moe_runtime/plan_agreement"
ABSENT = "(absent)"


class PlanAgreementError(PlanError):
    """The expert-parallel ranks could not agree on one plan."""


class PlanMismatchError(PlanAgreementError):
    """Two ranks planned differently. ``field`` is the first that differs, ``values`` maps each
    rank to its value of it."""

    def __init__(self, message: str, field: str, values: dict[int, str]) -> None:
        super().__init__(message)
        self.field = field
        self.values = dict(values)


class PlanAgreementTimeout(PlanAgreementError):
    """Some ranks did not report their plan in time. ``missing`` lists them."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = list(missing)


@attrs.frozen
class PlanFingerprint:
    """The fields ranks compare, in the order a difference is reported, and their digest."""

    fields: tuple[tuple[str, str], ...] = attrs.field(
        converter=lambda fs: tuple((str(k), str(v)) for k, v in fs))

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.fields).encode()).hexdigest()[:16]


def _json(value) -> str:
    return json.dumps(value, sort_keys=True)


def _software(registry) -> list[tuple[str, str]]:
    from moe_runtime.plugin.manager import _version

    fields = [("moe-runtime version", _version("moe-runtime") or "unknown")]
    for info in sorted(registry.plugin_infos, key=lambda i: i.name):
        fields.append((f"plugin {info.name}",
                       f"{info.distribution} {info.version} ({info.status})"))
    return fields


def plan_fields(plan: Plan, registry) -> PlanFingerprint:
    """The fingerprint of ``plan`` made with ``registry``: software first, then the machine, the
    deployment and each layer's decision, so the first difference names the cause."""
    fields = _software(registry) + [("plan", "made")]
    env = plan.environment.to_json()
    for key in ("device", "capability", "available"):
        fields.append((f"environment.{key}", _json(env[key])))
    for key, value in attrs.asdict(plan.deployment).items():
        fields.append((f"deployment.{key}", _json(value)))
    fields.append(("layers", _json([lp.problem.name for lp in plan.layers])))
    for lp in plan.layers:
        for key, value in lp.to_json().items():
            # notes are words on the decisions (how a tie was settled names the tuning cache
            # read, its path and its times), not decisions: they may differ between ranks
            if key == "experts_by_tokens":  # the ranges are decisions, their notes words
                value = [{k: v for k, v in r.items() if k != "note"} for r in value]
            if key not in ("layer", "notes"):
                fields.append((f"layer {lp.problem.name}: {key}", _json(value)))
    return PlanFingerprint(fields)


def refusal_fields(error: Exception, registry) -> PlanFingerprint:
    """The fingerprint of a rank whose planning failed: its software and the error's first line."""
    first = (str(error).splitlines() or [type(error).__name__])[0]
    return PlanFingerprint(_software(registry) + [("plan", f"refused: {first}")])


def first_difference(by_rank: dict[int, PlanFingerprint]) -> tuple[str, dict[int, str]] | None:
    """The first field (in fingerprint order) whose value is not the same on every rank."""
    names = list(dict.fromkeys(k for fp in by_rank.values() for k, _ in fp.fields))
    tables = {r: dict(fp.fields) for r, fp in by_rank.items()}
    for name in names:
        values = {r: t.get(name, ABSENT) for r, t in sorted(tables.items())}
        if len(set(values.values())) > 1:
            return name, values
    return None


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def mismatch_message(field: str, values: dict[int, str]) -> str:
    groups: dict[str, list[int]] = {}
    for rank, value in sorted(values.items()):
        groups.setdefault(value, []).append(rank)
    parts = "; ".join(f"{_ranks(rs)}: {v!r}" for v, rs in groups.items())
    return (
        f"expert-parallel ranks planned differently; the first field that differs is "
        f"{field!r}: {parts}. Every rank must load the same plugins at the same versions, see the "
        "same kind of device, plan the same deployment and read the same tuning cache (or none: "
        "--tuning-cache none); every rank stops here, before the first forward.")


def compare(by_rank: dict[int, PlanFingerprint]) -> None:
    """Raise :class:`PlanMismatchError` unless every rank has the same fingerprint."""
    diff = first_difference(by_rank)
    if diff is not None:
        raise PlanMismatchError(mismatch_message(*diff), *diff)


def agree_on_plan(plan: Plan, registry, *, group=None, timeout: float = 120.0
                  ) -> PlanFingerprint:
    """Compare this rank's plan with every other rank's of ``group`` (default: the world).

    A no-op returning the fingerprint when ``torch.distributed`` is not initialised or the group
    has one rank. Raises :class:`PlanMismatchError` (on every rank alike) or
    :class:`PlanAgreementTimeout` after ``timeout`` seconds.
    """
    mine = plan_fields(plan, registry)
    by_rank = exchange(mine, group=group, timeout=timeout)
    if by_rank is not None:
        compare(by_rank)
    return mine


def plan_and_agree(make_plan: Callable[[], Plan], registry, *, group=None,
                   timeout: float = 120.0) -> Plan:
    """``make_plan()`` on this rank, then :func:`agree_on_plan`.

    A rank whose planning raises still reports (its refusal), so the other ranks stop at once with
    a :class:`PlanMismatchError` naming it instead of waiting out the timeout; it raises its own
    error.
    """
    try:
        plan = make_plan()
    except PlanError as exc:
        try:
            exchange(refusal_fields(exc, registry), group=group, timeout=timeout)
        except PlanAgreementError:
            pass  # this rank's own error says more
        raise
    agree_on_plan(plan, registry, group=group, timeout=timeout)
    return plan


def exchange(mine: PlanFingerprint, *, group=None, timeout: float = 120.0
             ) -> dict[int, PlanFingerprint] | None:
    """Every rank's fingerprint of ``group``, through the store (``None``: nothing to compare)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = group if group is not None else dist.group.WORLD
    ranks = sorted(dist.get_process_group_ranks(group))
    if len(ranks) < 2:
        return None
    me = dist.get_rank()
    store = _store()
    tag = "-".join(str(r) for r in ranks)
    round_no = store.add(f"{_PREFIX}/{tag}/round/{me}", 1)  # the store keeps the count

    def key(rank: int) -> str:
        return f"{_PREFIX}/{tag}/{round_no}/{rank}"

    store.set(key(me), json.dumps(mine.fields))
    try:
        store.wait([key(r) for r in ranks], timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError):
        missing = [r for r in ranks if not store.check([key(r)])]
        raise PlanAgreementTimeout(
            f"{_ranks(missing)} of the expert-parallel group ({_ranks(ranks)}) did not report "
            f"a plan within {timeout:g} s; rank {me} stops before the first forward (a rank "
            "that failed to start, or that does not call load_model / agree_on_plan)",
            missing) from None
    return {r: PlanFingerprint(json.loads(store.get(key(r)))) for r in ranks}


def _store():
    """The key-value store of the default process group (a private torch name, stable since
    torch 1.x); the agreement uses it so that no collective can block on a missing rank."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()
