"""Timing the planner's candidates: the timer, random routed inputs, and the tuning loop.

For each distinct layer shape, :func:`tune` asks the planner for the layer plans it would choose
among (:func:`moe_runtime.planner.layer_candidates`), builds each plan's real executor
(:func:`moe_runtime.executor.build_executor`: the backends' own ``prepare``) on random weights of
the layer's format, and times ``dispatch -> forward -> combine`` on random routed batches of each
token count: CUDA events after warm-up on CUDA, the wall clock on CPU, the median of the repeats.

Each measurement is timed eagerly (the call from Python) and, where the candidate captures and the
batch is within the graph bound, again as replays of CUDA graphs captured from the same call (one
graph per input batch, replayed in turn), as engines run decode: :func:`capture_graphs`. A capture
that fails, or a replay whose output differs from the eager call's, leaves the eager time with the
reason recorded (``Measurement.timed``).
"""

from __future__ import annotations

import datetime
import math
import statistics
import time
from typing import Callable, Iterable, Sequence

import attrs
import torch

from moe_runtime.backend_api import ExpertWeights, LayerProblem
from moe_runtime.environment import Environment
from moe_runtime.planner import Deployment, LayerPlan, PlanError, layer_candidates
from moe_runtime.tuning.cache import GRAPH, Measurement, _tokens, candidate_key, problem_key

DEFAULT_TOKENS = (1, 16, 128, 1024, 4096)
TUNED_EP_SIZE = 1  # a local layer: every expert on this device, local communication
GRAPH_MAX_TOKENS = 1024  # larger batches (prefill) run eagerly in engines: timed eagerly only
ACT_AMAX = 4.0  # activation scales of random weights: about the largest of a unit-normal batch


@attrs.frozen
class Timing:
    """The median of ``repeats`` timed calls, in microseconds, and the timer that took them."""

    median_us: float
    repeats: int
    timer: str


@attrs.frozen
class TuneCase:
    """One measurement to make: a candidate plan of a layer shape at a token count."""

    plan: LayerPlan
    tokens: int
    device: str


@attrs.frozen
class Timer:
    """Times a call: ``warmup`` untimed calls, then up to ``repeats`` timed ones (fewer when they
    would take more than ``budget_s`` seconds at the last warm-up call's pace: at least 3, or
    ``repeats`` if that is fewer), the median. The first calls may compile kernels (JIT), so only
    the last warm-up call paces."""

    warmup: int = 3
    repeats: int = 20
    budget_s: float = 10.0

    def __call__(self, fn: Callable[[], object], case: TuneCase) -> Timing:
        cuda = case.device.startswith("cuda")
        per_call = 0.0
        for _ in range(max(1, self.warmup)):
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(case.device)
            per_call = time.perf_counter() - start
        n = self.timed_calls(per_call)
        samples = self._cuda(fn, n, case.device) if cuda else self._wall(fn, n)
        return Timing(statistics.median(samples), n, "cuda_events" if cuda else "wall_clock")

    def timed_calls(self, per_call_s: float) -> int:
        """How many calls are timed at ``per_call_s`` seconds a call: never more than
        ``repeats`` (``--repeats 1`` times one call), and the budget cuts no further than 3."""
        fit = int(self.budget_s / max(per_call_s, 1e-9))
        return max(1, min(self.repeats, max(3, fit)))

    @staticmethod
    def _wall(fn, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    @staticmethod
    def _cuda(fn, n: int, device: str) -> list[float]:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) * 1e3 for start, end in events]


# ------------------------------------------------------------------------------ random inputs


def random_weights(p: LayerProblem, registry, device: str, seed: int = 0) -> ExpertWeights:
    """Weights of ``p``'s format for its experts, from random floats quantized a few experts at
    a time on ``device`` (memory stays near one layer's stored size)."""
    from moe_runtime import formats as F
    from moe_runtime.reference_math import quantize_expert_weights

    twin = F.builtin_twin(registry.formats[p.format].spec)
    e, h, i = p.num_experts, p.hidden_size, p.intermediate_size
    chunk = max(1, (1 << 28) // (3 * h * i))  # about 1 GiB of float32 per step
    gen = torch.Generator(device=device).manual_seed(seed)
    parts = []
    for first in range(0, e, chunk):
        n = min(chunk, e - first)
        w13 = torch.randn((n, 2 * i, h), generator=gen, device=device) / h**0.5
        w2 = torch.randn((n, h, i), generator=gen, device=device) / i**0.5
        parts.append(quantize_expert_weights(w13, w2, twin, p.activation, a13_amax=ACT_AMAX,
                                             a2_amax=ACT_AMAX))
        del w13, w2
    return attrs.evolve(join_experts(parts), format=p.format)


def join_experts(parts: list[ExpertWeights]) -> ExpertWeights:
    """Experts of several :class:`ExpertWeights` in one; per-layer (0-dim) scales are shared."""
    first = parts[0]
    fields = {}
    for f in attrs.fields(ExpertWeights):
        value = getattr(first, f.name)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            value = torch.cat([getattr(w, f.name) for w in parts]) if len(parts) > 1 else value
        fields[f.name] = value
    return ExpertWeights(**fields)


def routed_batches(p: LayerProblem, tokens: int, device: str, seed: int, count: int = 3):
    """``count`` random batches of ``tokens``: hidden states in the model dtype, top-k ids drawn
    uniformly over the experts, and weights summing to one (batches rotate, so repeated calls do
    not all read the same activations from cache)."""
    from moe_runtime.dtypes import torch_dtype

    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(count):
        hidden = torch.randn((tokens, p.hidden_size), generator=gen, device=device)
        scores = torch.rand((tokens, p.num_experts), generator=gen, device=device)
        ids = scores.topk(p.top_k, dim=-1).indices.to(torch.int32)
        w = torch.rand((tokens, p.top_k), generator=gen, device=device) + 0.1
        out.append((hidden.to(torch_dtype(p.dtype)), ids, (w / w.sum(-1, keepdim=True)).float()))
    return out


# ------------------------------------------------------------------------------ the tuning loop


def distinct_problems(problems: Iterable[LayerProblem]) -> list[LayerProblem]:
    """One layer per distinct shape (the first met); layers of one shape share measurements."""
    seen: dict[tuple, LayerProblem] = {}
    for p in problems:
        seen.setdefault(tuple(sorted(problem_key(p, TUNED_EP_SIZE).items())), p)
    return list(seen.values())


@attrs.frozen
class Shape:
    """A layer shape to tune: its representative problem and the planner's candidates for it."""

    problem: LayerProblem
    plans: tuple[LayerPlan, ...]
    skipped: str = ""  # why the planner found no candidate, when it found none


def shapes_to_tune(problems: Iterable[LayerProblem], *, registry, environment: Environment,
                   tokens: Sequence[int], backends: Sequence[str] | None = None) -> list[Shape]:
    """The candidates of each distinct layer shape, as the planner computes them for a local
    deployment sending up to ``max(tokens)`` tokens; ``backends`` keeps only those named."""
    dep = Deployment(max_tokens_per_rank=max(tokens))
    out = []
    for p in distinct_problems(problems):
        try:
            found = layer_candidates(p, registry=registry, environment=environment,
                                     deployment=dep)
        except PlanError as exc:
            out.append(Shape(p, (), str(exc).splitlines()[0]))
            continue
        plans = tuple(lp for lp in found.plans if not backends or lp.experts in backends)
        out.append(Shape(p, plans, "" if plans else "none of the named backends runs it"))
    return out


class GraphUnavailable(Exception):
    """No CUDA graph can be tried here (the message says why: the device, the token bound)."""


def capture_graphs(executor, batches, device: str) -> list[tuple[Callable[[], None], object]]:
    """One CUDA graph per batch of ``executor``'s call: ``[(replay, output)]``, the output being
    the tensor each replay rewrites. The calls run first on a side stream (lazy allocations,
    autotuning and JIT happen outside the capture), as ``torch.cuda.graphs`` recommends.

    Raises :class:`GraphUnavailable` off CUDA, and whatever the capture raises (a host sync such
    as ``.item()`` inside the call, an operation a capture does not permit)."""
    if not str(device).startswith("cuda"):
        raise GraphUnavailable(f"no CUDA graphs on {device}")
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for x, ids, w in batches:
                executor(x, ids, w)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        captured = []
        for x, ids, w in batches:
            graph, inner = torch.cuda.CUDAGraph(), []
            try:
                with torch.cuda.graph(graph):
                    try:
                        out = executor(x, ids, w)
                    except Exception as exc:
                        inner.append(exc)
                        raise
            except Exception as exc:  # the call's own error, not the capture's end after it
                raise (inner[0] if inner else exc) from None
            captured.append((graph, out))
        torch.cuda.synchronize()
    return [(graph.replay, out) for graph, out in captured]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}".rstrip(": ")


def replay_gap(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float] | None:
    """``(max |got - want|, max |want|)`` when a replay's output ``got`` is not the eager call's
    ``want`` within 1% of its scale (+1e-3: split reductions may add in another order; NaN is
    never within), else ``None``."""
    if not want.numel():
        return None
    diff = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    return None if diff <= 0.01 * scale + 1e-3 else (diff, scale)


def replay_differs(executor, batches, captured) -> str:
    """Why the replays do not reproduce the eager calls' outputs (``""`` when they do, within
    1% of the output's scale: split reductions may add in another order)."""
    for (x, ids, w), (replay, out) in zip(batches, captured):
        replay()
        want = executor(x, ids, w)
        got = out.float() if isinstance(out, torch.Tensor) else None
        if got is None or got.shape != want.shape:
            return "the captured call returned no tensor of the eager call's shape"
        gap = replay_gap(got, want)
        if gap:
            return f"a replay's output differs from the eager call's (max |diff| {gap[0]:.3g})"
    return ""


def graph_timing(executor, batches, case: TuneCase, timer, capture=capture_graphs,
                 graph_max_tokens: int = GRAPH_MAX_TOKENS) -> tuple[Timing | None, str]:
    """The timing of CUDA-graph replays of ``executor`` on ``batches`` (in turn) and
    :data:`GRAPH`, or ``None`` and ``"eager: <why not>"``."""
    if case.tokens > graph_max_tokens:
        return None, (f"eager: {_tokens(case.tokens)} is above the graph bound of "
                      f"{graph_max_tokens} (engines run such batches eagerly)")
    try:
        captured = capture(executor, batches, case.device)
    except GraphUnavailable as exc:
        return None, f"eager: {exc}"
    except Exception as exc:  # noqa: BLE001 - a call that cannot be captured is a result
        _settle(case.device)
        return None, f"eager: capture failed: {_first_line(exc)}"
    try:
        wrong = replay_differs(executor, batches, captured)
        if wrong:
            return None, f"eager: {wrong}"
        return timer(_rotating_replays([r for r, _ in captured]), case), GRAPH
    except Exception as exc:  # noqa: BLE001
        _settle(case.device)
        return None, f"eager: replay failed: {_first_line(exc)}"
    finally:
        del captured


def _settle(device: str) -> None:
    """Wait for the device after a failed capture, so its error does not surface later."""
    if str(device).startswith("cuda"):
        try:
            torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001 - the capture's own error was recorded already
            pass


def _rotating_replays(replays) -> Callable[[], None]:
    turn = iter(range(1 << 62))

    def call():
        replays[next(turn) % len(replays)]()

    return call


def rotating_call(executor, batches) -> Callable[[], object]:
    """A call of ``executor`` on the next of ``batches`` each time."""
    turn = iter(range(1 << 62))

    def call():
        x, ids, w = batches[next(turn) % len(batches)]
        return executor(x, ids, w)

    return call


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def measure_plan(plan: LayerPlan, weights: ExpertWeights, tokens: Sequence[int], *, registry,
                 device: str, timer, seed: int = 0, step: Callable[[], None] = lambda: None,
                 capture=capture_graphs, graph_max_tokens: int = GRAPH_MAX_TOKENS
                 ) -> list[Measurement]:
    """Time one candidate at every token count, eagerly and, where it captures, as CUDA-graph
    replays (:func:`graph_timing`); an error (building or running) is recorded in the
    measurement instead of stopping the run."""
    from moe_runtime.executor import build_executor

    problem = problem_key(plan.problem, TUNED_EP_SIZE)

    def record(t: int, eager: Timing | None, error: str | None = None,
               graph: Timing | None = None, timed: str = "eager: it failed") -> Measurement:
        step()
        used = graph or eager
        return Measurement(problem, candidate_key(plan, t), t,
                           used.median_us if used else None, used.repeats if used else 0,
                           used.timer if used else "none", _now(), error, timed,
                           eager.median_us if eager else None)

    try:
        executor = build_executor(plan, registry, weights, device=device,
                                  max_tokens_per_rank=max(tokens))
    except Exception as exc:  # noqa: BLE001 - a backend that cannot prepare is a result
        return [record(t, None, f"prepare: {type(exc).__name__}: {exc}") for t in tokens]
    out = []
    for t in tokens:
        case = TuneCase(plan, t, device)
        try:
            batches = routed_batches(plan.problem, t, device, seed + t)
            eager = timer(rotating_call(executor, batches), case)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory at one token count
            out.append(record(t, None, f"forward: {type(exc).__name__}: {exc}"))
            continue
        if not_a_time(eager):  # what plan would refuse as malformed is not written
            out.append(record(t, None, not_a_time(eager)))
            continue
        graph, timed = graph_timing(executor, batches, case, timer, capture, graph_max_tokens)
        if not_a_time(graph):
            graph, timed = None, f"eager: replays: {not_a_time(graph)}"
        out.append(record(t, eager, None, graph, timed))
        del batches
    return out


def not_a_time(timing: Timing | None) -> str:
    """Why ``timing``'s median cannot be a measurement (``""``: it can): it must be a positive
    finite number of microseconds, as a cache reader requires."""
    if timing is None or (math.isfinite(timing.median_us) and timing.median_us > 0):
        return ""
    return (f"timer: median {timing.median_us} us, not a positive time (below the timer's "
            "resolution?)")


def tune(shapes: Sequence[Shape], tokens: Sequence[int], *, registry, device: str, timer=None,
         seed: int = 0, progress=None, capture=capture_graphs,
         graph_max_tokens: int = GRAPH_MAX_TOKENS) -> list[Measurement]:
    """Every measurement of ``shapes`` at ``tokens``; ``progress(n)`` is told of each one.
    ``capture`` makes the CUDA graphs (:func:`capture_graphs`) of batches up to
    ``graph_max_tokens`` tokens."""
    timer = timer or Timer()
    step = (lambda: progress(1)) if progress else (lambda: None)
    out: list[Measurement] = []
    for shape in shapes:
        if not shape.plans:
            continue
        weights = random_weights(shape.problem, registry, device, seed)
        for plan in shape.plans:
            out += measure_plan(plan, weights, tokens, registry=registry, device=device,
                                timer=timer, seed=seed, step=step, capture=capture,
                                graph_max_tokens=graph_max_tokens)
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        del weights
    return out
