"""The tuning cache: its schema, its key, reading it for a plan, and the measured choice.

A cache file holds sections, one per key. A key is what makes a measurement valid here: the
device (:attr:`Environment.described`), the environment fingerprint
(:meth:`Environment.fingerprint`) and the software (the moe-runtime version and every plugin's
distribution, version and status, as plan agreement compares them). Reading a cache for a plan:

1. no file: nothing (a cache named explicitly that does not exist gets a note);
2. not JSON, another schema, or a field of the wrong type: ignored, the note names what (an
   older schema of moe-runtime's own is *outdated*: its measurements were taken another way);
3. the section whose key equals this run's is used; failing that, one of the same device and
   environment fingerprint makes the cache *stale* (the note names the first software field that
   differs), and none makes it *foreign* (the note names the devices it holds);
4. :meth:`TuningCache.fastest` then picks, among plans the planner found equally exact, the one
   measured fastest at the deployment's token bucket, or says why it cannot. Each measurement
   says how it was timed (:data:`GRAPH`, or ``"eager: <why>"``), and candidates are compared
   only by times taken the same way (:meth:`TuningCache.fastest`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import attrs

if TYPE_CHECKING:  # records only: reading a cache imports no torch
    from moe_runtime.backend_api import LayerProblem
    from moe_runtime.environment import Environment
    from moe_runtime.planner import Deployment, LayerPlan

SCHEMA = "moe-runtime-tuning/2"
#: older schemas of this package, and why their measurements cannot be compared with today's
OUTDATED_SCHEMAS = {
    "moe-runtime-tuning/1": "every call was timed eagerly (host launch work included, no CUDA-graph "
                            "replays)",
}
GRAPH = "graph"  # Measurement.timed of a CUDA-graph replay; eager ones are "eager: <why>"
ENV_VAR = "MOE_RUNTIME_TUNING_CACHE"  # a path; "" or "none" switches the default cache off
PROBLEM_FIELDS = ("format", "activation", "num_experts", "top_k", "hidden_size",
                  "intermediate_size", "dtype", "ep_size")
CANDIDATE_FIELDS = ("experts", "runs_as", "comm", "layout", "payload")


class CacheFormatError(ValueError):
    """A tuning cache is not of :data:`SCHEMA`; the message names the field and what it expects."""


class OutdatedCacheError(CacheFormatError):
    """A tuning cache of an older schema of moe-runtime (:data:`OUTDATED_SCHEMAS`)."""


# ------------------------------------------------------------------------------------- keys


def problem_key(p: LayerProblem, ep_size: int) -> dict:
    """What a measurement is of, on the layer's side: its sizes and formats, not its name."""
    return {**{f: getattr(p, f) for f in PROBLEM_FIELDS if f != "ep_size"}, "ep_size": ep_size}


def candidate_key(plan: LayerPlan, tokens: int) -> dict:
    """What a measurement is of, on the backends' side: the plan's path for ``tokens`` per rank."""
    from moe_runtime.planner import first_mode_admitting

    mode = first_mode_admitting(plan.modes, tokens) or plan.modes[-1]
    return {"experts": plan.experts, "runs_as": plan.runs_as, "comm": plan.comm,
            "layout": mode.layout, "payload": mode.payload}


def _frozen(d: dict) -> tuple:
    return tuple(sorted(d.items()))


def software_of(registry) -> dict[str, str]:
    """The software fields of a cache key: the ones plan agreement compares across ranks."""
    from moe_runtime.agreement import _software

    return dict(_software(registry))


def cache_key(environment: Environment, registry) -> dict:
    return {"device": environment.described, "environment": environment.fingerprint(),
            "software": software_of(registry)}


def default_cache_path(environ=None) -> Path | None:
    """``$MOE_RUNTIME_TUNING_CACHE``, else ``tuning.json`` in moe-runtime's cache folder
    (``$XDG_CACHE_HOME/moe-runtime``, or ``~/.cache/moe-runtime``); ``None`` when switched off."""
    environ = os.environ if environ is None else environ
    if ENV_VAR in environ:
        value = environ[ENV_VAR].strip()
        return None if value.lower() in ("", "none") else Path(value).expanduser()
    from moe_runtime.serve.default_model import cache_root

    return cache_root() / "tuning.json"


# ----------------------------------------------------------------------------------- schema


def _check_timed(instance, attribute, value: str) -> None:
    if not (value == GRAPH or value.startswith("eager: ")):
        raise ValueError(f"Measurement.timed is {value!r}, expected {GRAPH!r} or 'eager: <why>'")


@attrs.frozen
class Measurement:
    """One timed (layer shape, candidate, tokens): the median in microseconds, or the error that
    stopped it.

    ``timed`` says how ``median_us`` was taken: :data:`GRAPH` (replays of a CUDA graph captured
    from the call), or ``"eager: <why not a graph>"`` (the call from Python). ``eager_us`` is
    the eager median, also taken when ``median_us`` is a graph replay's, so that a candidate
    that could not be captured can be compared with it like with like."""

    problem: dict
    candidate: dict
    tokens: int
    median_us: float | None
    repeats: int
    timer: str
    measured_at: str
    error: str | None = None
    timed: str = attrs.field(default="eager: no CUDA graph tried", validator=_check_timed)
    eager_us: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.eager_us is None and self.timed != GRAPH and self.median_us is not None:
            object.__setattr__(self, "eager_us", self.median_us)
        if self.timed == GRAPH and self.median_us is not None and self.eager_us is None:
            raise ValueError("a graph-timed Measurement needs eager_us, the eager median")

    @property
    def graphed(self) -> bool:
        return self.timed == GRAPH

    @property
    def where(self) -> tuple:
        return (_frozen(self.problem), _frozen(self.candidate), self.tokens)

    def to_json(self) -> dict:
        return attrs.asdict(self)


def _need(data: dict, field: str, kind, where: str):
    if not isinstance(data, dict) or field not in data:
        raise CacheFormatError(f"{where} has no field {field!r}")
    value = data[field]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise CacheFormatError(f"{where}.{field} is {value!r}, expected {names}")
    return value


#: the JSON type of each field of a measurement's problem and candidate; a field not named here
#: (a later moe-runtime's) must be a string or an integer, so that the record can be a table key
FIELD_TYPES = {"format": str, "activation": str, "num_experts": int, "top_k": int,
               "hidden_size": int, "intermediate_size": int, "dtype": str, "ep_size": int,
               **{f: str for f in CANDIDATE_FIELDS}}


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _record(data, field: str, fields: Sequence[str], where: str) -> dict:
    record = _need(data, field, dict, where)
    missing = [f for f in fields if f not in record]
    if missing:
        raise CacheFormatError(f"{where}.{field} lacks {', '.join(missing)}")
    for name, value in record.items():
        kind = FIELD_TYPES.get(name, (str, int))
        if not isinstance(value, kind) or isinstance(value, bool):
            names = "str or int" if isinstance(kind, tuple) else kind.__name__
            raise CacheFormatError(f"{where}.{field}.{name} is {_shown(value)}, expected {names}")
    return record


def _microseconds(data, field: str, where: str) -> float:
    """A time of ``data``: a positive finite number of microseconds."""
    raw = _need(data, field, (int, float), where)
    try:
        value = float(raw)
    except OverflowError:  # an integer beyond any float
        value = math.inf
    if not (math.isfinite(value) and value > 0):
        raise CacheFormatError(f"{where}.{field} must be a positive finite number, got "
                               f"{_shown(raw)}")
    return value


def parse_measurement(data, where: str) -> Measurement:
    """A :class:`Measurement` from its JSON, or :class:`CacheFormatError` naming the field."""
    problem = _record(data, "problem", PROBLEM_FIELDS, where)
    candidate = _record(data, "candidate", CANDIDATE_FIELDS, where)
    tokens = _need(data, "tokens", int, where)
    if tokens < 1:
        raise CacheFormatError(f"{where}.tokens must be at least 1, got {_shown(tokens)}")
    error = data.get("error")
    median = None if error is not None else _microseconds(data, "median_us", where)
    timed = _need(data, "timed", str, where)
    if not (timed == GRAPH or timed.startswith("eager: ")):
        raise CacheFormatError(f"{where}.timed is {timed!r}, expected {GRAPH!r} or "
                               "'eager: <why>'")
    eager = None
    if median is not None and (timed == GRAPH or data.get("eager_us") is not None):
        eager = _microseconds(data, "eager_us", where)
    return Measurement(problem, candidate, tokens, median,
                       _need(data, "repeats", int, where), _need(data, "timer", str, where),
                       _need(data, "measured_at", str, where), error, timed, eager)


@attrs.frozen
class Section:
    """The measurements made under one key."""

    key: dict
    environment: dict
    measurements: tuple[Measurement, ...]

    def to_json(self) -> dict:
        return {"key": self.key, "environment": self.environment,
                "measurements": [m.to_json() for m in self.measurements]}


def parse_cache(data) -> list[Section]:
    """The sections of a cache file's JSON, or :class:`CacheFormatError` naming what is wrong."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        if isinstance(got, str) and got in OUTDATED_SCHEMAS:
            raise OutdatedCacheError(f"schema {got!r} is an older one: {OUTDATED_SCHEMAS[got]}; "
                                     f"this moe-runtime reads {SCHEMA!r}")
        raise CacheFormatError(f"schema is {got!r}, expected {SCHEMA!r}")
    sections = []
    for i, raw in enumerate(_need(data, "sections", list, "the cache")):
        where = f"sections[{i}]"
        key = _need(raw, "key", dict, where)
        for field, kind in (("device", str), ("environment", str), ("software", dict)):
            _need(key, field, kind, f"{where}.key")
        items = _need(raw, "measurements", list, where)
        sections.append(Section(key, raw.get("environment") or {}, tuple(
            parse_measurement(m, f"{where}.measurements[{j}]") for j, m in enumerate(items))))
    return sections


def read_sections(path: Path) -> list[Section]:
    """The sections of the file at ``path``; :class:`CacheFormatError` if it is not a cache."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise CacheFormatError(f"cannot be read ({exc})") from None
    except RecursionError:
        raise CacheFormatError("not JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, and an integer of too many digits
        raise CacheFormatError(f"not JSON ({exc})") from None
    return parse_cache(data)


def write_sections(path: Path, sections: Sequence[Section]) -> None:
    """Write atomically (a temporary file renamed into place); through a symbolic link, its
    target is written (a cache shared by a link stays shared)."""
    path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"schema": SCHEMA, "sections": [s.to_json() for s in sections]},
                                  indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def merge(sections: Sequence[Section], new: Section) -> list[Section]:
    """``sections`` with ``new`` merged in: its measurements replace the same (shape,
    candidate, tokens) under its key; a section of the same device and environment but other
    software (stale, never to be read again) is dropped; other devices' sections stay."""
    kept, old = [], ()
    for s in sections:
        if s.key == new.key:
            old = s.measurements
        elif not (s.key["device"] == new.key["device"]
                  and s.key["environment"] == new.key["environment"]):
            kept.append(s)
    table = {m.where: m for m in (*old, *new.measurements)}
    return [*kept, attrs.evolve(new, measurements=tuple(table.values()))]


# ----------------------------------------------------------------------------- for a plan


@attrs.frozen
class Tuning:
    """What a plan reads from a tuning cache: the usable cache (or ``None``) and notes on it."""

    cache: TuningCache | None = None
    notes: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    #: ``--token-ranges``: also choose an experts backend per measured batch size
    #: (:meth:`TuningCache.ranges`), where one beats the chosen backend by ``range_margin``
    token_ranges: bool = False
    range_margin: float = 0.05


def _first_software_difference(theirs: dict, mine: dict) -> str:
    for field in sorted(set(theirs) | set(mine)):
        if theirs.get(field) != mine.get(field):
            return (f"{field} is {mine.get(field, '(absent)')!r} here, "
                    f"{theirs.get(field, '(absent)')!r} in the cache")
    return "the software differs"  # pragma: no cover - keys differ in software only


def select_section(sections: Sequence[Section], key: dict) -> tuple[Section | None, str]:
    """The section of ``key``, or ``None`` and why (stale or foreign)."""
    for s in sections:
        if s.key == key:
            return s, ""
    for s in sections:
        if s.key["device"] == key["device"] and s.key["environment"] == key["environment"]:
            return None, f"stale: {_first_software_difference(s.key['software'], key['software'])}"
    held = "; ".join(f"{s.key['device']} (environment {s.key['environment']})" for s in sections)
    return None, (f"foreign: it holds measurements of {held or 'nothing'}, not of "
                  f"{key['device']} (environment {key['environment']})")


def load_tuning(path: str | Path | None, environment: Environment, registry, *,
                explicit: bool = True) -> Tuning:
    """The tuning a plan on ``environment`` with ``registry``'s plugins may use from ``path``.

    Never raises for a bad cache: it is ignored with a note saying why. ``explicit=False`` (the
    default location) says nothing when the file does not exist.
    """
    if path is None:
        return Tuning()
    path = Path(path)
    again = f"run `moe-runtime tune CHECKPOINT --cache {path}` on this machine"
    try:
        found = path.is_file()
    except OSError as exc:  # e.g. a folder on the way this user may not search
        return Tuning(notes=(f"ignored tuning cache {path}: malformed: cannot be read ({exc})",))
    if not found:
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        return Tuning(notes=(f"tuning cache {path} {what}; backends are chosen by "
                             f"declared priority ({again})",) if explicit else ())
    try:
        sections = read_sections(path)
    except OutdatedCacheError as exc:
        return Tuning(notes=(f"ignored tuning cache {path}: outdated: {exc}; {again}",))
    except CacheFormatError as exc:
        return Tuning(notes=(f"ignored tuning cache {path}: malformed: {exc}",))
    section, why = select_section(sections, cache_key(environment, registry))
    if section is None:
        return Tuning(notes=(f"ignored tuning cache {path}: {why}; {again}",))
    cache = TuningCache.of(str(path), section)
    return Tuning(cache, (f"tuning cache {path} (measured {cache.dates()}) breaks ties between "
                          "equally exact experts backends",))


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


@attrs.frozen
class TuningCache:
    """The measurements of this machine's section, by (layer shape, candidate, tokens)."""

    path: str
    table: dict = attrs.field(eq=False)

    @classmethod
    def of(cls, path: str, section: Section) -> TuningCache:
        return cls(path, {m.where: m for m in section.measurements})

    def dates(self) -> str:
        days = sorted({m.measured_at[:10] for m in self.table.values()})
        if not days:
            return "nothing"
        return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"

    def token_counts(self, problem: dict) -> list[int]:
        shape = _frozen(problem)
        return sorted({t for (p, _, t) in self.table if p == shape})

    def lookup(self, problem: dict, plan: LayerPlan, tokens: int) -> Measurement | None:
        return self.table.get((_frozen(problem), _frozen(candidate_key(plan, tokens)), tokens))

    def fastest(self, plans: Sequence[LayerPlan], dep: Deployment) -> tuple[int | None, str]:
        """Index of the plan measured fastest at the deployment's bucket, and a note for the
        plan; ``None`` (declared order stands) when the declared choice ``plans[0]`` has no good
        measurement there. Plans without one take no part (nothing says they are faster).

        The bucket is the smallest measured token count at or above ``max_tokens_per_rank``,
        else the largest measured."""
        problem = problem_key(plans[0].problem, dep.ep_size)
        counts = self.token_counts(problem)
        if not counts:
            sizes = sorted({dict(p)["ep_size"] for (p, _, _) in self.table
                            if {**dict(p), "ep_size": dep.ep_size} == problem})
            other = (f" at ep_size {dep.ep_size} (it measured this shape at ep_size "
                     f"{', '.join(map(str, sizes))})" if sizes else "")
            return None, (f"declared priority decides; cache {self.path} has no measurement of "
                          f"this layer shape{other}")
        bucket = next((t for t in counts if t >= dep.max_tokens_per_rank), counts[-1])
        found = [self.lookup(problem, lp, bucket) for lp in plans]
        timed = [i for i, m in enumerate(found) if m is not None and m.median_us is not None]
        if 0 not in timed:
            m = found[0]
            why = "no measurement" if m is None else f"a failed measurement ({m.error})"
            return None, (f"declared priority decides; cache {self.path} has {why} of "
                          f"{plans[0].experts} at {_tokens(bucket)} per rank")
        how, key = compared_times([(plans[i].experts, found[i]) for i in timed])
        ranked = sorted(timed, key=lambda i: (key(found[i]), i))
        day = max(found[i].measured_at for i in timed)[:10]
        ranking = ", ".join(f"{plans[i].experts} {key(found[i]):.1f} us" for i in ranked)
        left = [plans[i].experts for i in range(len(plans)) if i not in timed]
        return ranked[0], (f"chosen by measurement (cache {self.path}, measured {day}): "
                           f"{ranking} at {_tokens(bucket)} per rank, {how}"
                           + (f" (not measured: {', '.join(left)})" if left else ""))


    def ranges(self, plans: Sequence[LayerPlan], dep: Deployment, *, margin: float = 0.05):
        """Per measured batch size below the deployment's bucket, the fastest of ``plans`` (the
        chosen plan first, the others on the same path): ``(ranges, note)``, the ranges in
        increasing bound, consecutive buckets of one winner merged, none past the last one that
        differs from ``plans[0]`` (those batches run on it anyway). Another backend wins a bucket
        only when it is faster than ``plans[0]`` by more than ``margin`` (a fraction) there, with
        both measured (like with like: :func:`compared_times`); a batch uses the smallest
        measured count at or above its size, as :meth:`fastest` does."""
        from moe_runtime.planner import ExpertsRange

        problem = problem_key(plans[0].problem, dep.ep_size)
        counts = self.token_counts(problem)
        chosen = plans[0].experts
        if not counts:
            return (), ""
        bucket = next((t for t in counts if t >= dep.max_tokens_per_rank), counts[-1])
        wins: list[tuple[int, int, str]] = []  # (bound, plan index, why)
        for t in (c for c in counts if c < bucket):
            found = [self.lookup(problem, lp, t) for lp in plans]
            timed = [i for i, m in enumerate(found) if m is not None and m.median_us is not None]
            if 0 not in timed or len(timed) < 2:
                wins.append((t, 0, ""))
                continue
            how, key = compared_times([(plans[i].experts, found[i]) for i in timed])
            best = min(timed, key=lambda i: (key(found[i]), i))
            if best != 0 and key(found[best]) < (1.0 - margin) * key(found[0]):
                wins.append((t, best, f"{plans[best].experts} {key(found[best]):.1f} us, "
                                      f"{chosen} {key(found[0]):.1f} us at {_tokens(t)}, {how}"))
            else:
                wins.append((t, 0, ""))
        merged: list[tuple[int, int, list[str]]] = []
        for t, i, why in wins:
            if merged and merged[-1][1] == i:
                merged[-1] = (t, i, merged[-1][2] + ([why] if why else []))
            else:
                merged.append((t, i, [why] if why else []))
        while merged and merged[-1][1] == 0:
            merged.pop()
        if not merged:
            return (), (f"one experts backend for every batch size (--token-ranges): no other "
                        f"backend measured more than {margin:.0%} faster than {chosen} below "
                        f"{_tokens(bucket)} per rank (cache {self.path})")
        ranges = tuple(ExpertsRange(t, plans[i].experts, plans[i].prepared_bytes_per_weight,
                                    "; ".join(whys))
                       for t, i, whys in merged)
        spans, low = [], 0
        for r in ranges:
            spans.append(f"{low + 1}-{r.max_tokens_per_rank} tokens per rank on {r.experts}")
            low = r.max_tokens_per_rank
        others = sorted({r.experts for r in ranges} - {chosen})
        return ranges, (f"experts backend by batch size, chosen by measurement (cache {self.path}"
                        f"): {', '.join(spans)}, larger batches on {chosen}; the weights are "
                        f"prepared for {chosen} and for {', '.join(others)} (held side by side)")


def _eager_reasons(named: Sequence[tuple[str, Measurement]], *, every: bool = False) -> str:
    """Why each was timed eagerly, grouped by reason; one reason for ``every`` one: just it."""
    by_reason: dict[str, list[str]] = {}
    for name, m in named:
        by_reason.setdefault(m.timed.removeprefix("eager: "), []).append(name)
    if every and len(by_reason) == 1:
        return next(iter(by_reason))
    return "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items())


def compared_times(named: Sequence[tuple[str, Measurement]]):
    """How measurements of one bucket are compared, like with like: ``(words, time_of)``.

    All graph replays: their medians. None: the eager medians. A mix: every candidate's eager
    median (each graph-timed measurement has one), since an eager time includes host launch
    work that a replay does not; the words name who was not replayed and why, and give the
    replays' times."""
    graphed = [(n, m) for n, m in named if m.graphed]
    if len(graphed) == len(named):
        return "CUDA-graph replays", lambda m: m.median_us
    if not graphed:
        return f"eager calls ({_eager_reasons(named, every=True)})", lambda m: m.median_us
    replays = ", ".join(f"{n} {m.median_us:.1f} us" for n, m in graphed)
    eager = [(n, m) for n, m in named if not m.graphed]
    return (f"eager calls compared, like with like ({_eager_reasons(eager)}; replayed from a CUDA "
            f"graph: {replays})", lambda m: m.eager_us)
