"""Running one conformance case: build inputs, run the backend, run the reference, compare."""

from __future__ import annotations

import os
import subprocess
import sys

import attrs
import torch

from moe_runtime import formats as F
from moe_runtime.backend_api import CommSetup, Dispatched, ExpertsSetup, LayerProblem
from moe_runtime.declarations import load_factory
from moe_runtime.environment import Environment
from moe_runtime.placement import local_experts
from moe_runtime.planner import Deployment, PlanError, plan_layer
from moe_runtime.plugin.registry import Registry
from moe_runtime.testing.cases import CommCase, ExpertsCase, Shape, TokenBoundCase, case_seed

KERNEL_MODULES = ("triton", "flashinfer", "deep_ep", "cutlass", "deep_gemm")


class ConformanceSkip(Exception):
    """The machine lacks what the declaration needs: the case is skipped, with this reason."""


def routing(shape: Shape, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    n, e, k = shape.tokens, shape.experts, shape.top_k
    if shape.routing == "one_expert":
        ids = torch.full((n, k), 3 % e, dtype=torch.int32)
    elif shape.routing == "every_expert":  # each expert gets n*k/e slots, distinct in each row
        assert e % k == 0 and (n * k) % e == 0, shape
        perms = [torch.randperm(e, generator=gen) for _ in range(n * k // e)]
        ids = torch.cat(perms).reshape(n, k).to(torch.int32)
    else:
        pool = e if shape.routing == "random" else max(k, e // 2)  # upper experts idle
        scores = torch.rand((n, pool), generator=gen)
        ids = scores.topk(k, dim=-1).indices.to(torch.int32)
    if shape.routing == "remote_slots":
        remote = torch.rand((n, k), generator=gen) < 0.4
        remote[0] = True  # a token none of whose experts is local
        ids = ids.masked_fill(remote, -1)
    w = torch.rand((n, k), generator=gen) + 0.1
    # Rows sum to 0.5-1.5, not 1: routers without top-k renormalization (norm_topk_prob=False,
    # a routed scaling factor) send such weights, and a backend that renormalizes them is wrong.
    w = w / w.sum(-1, keepdim=True) * (0.5 + torch.rand((n, 1), generator=gen))
    return ids, w.float()


def _reference_format(registry: Registry | None, fmt: str) -> str:
    """The built-in format the suite quantizes and references ``fmt`` as (itself if built-in)."""
    if registry is None or fmt not in registry.formats:
        return fmt
    return F.builtin_twin(registry.formats[fmt].spec)


# The gelu_tail case's gates: centre, spread (of the random part) and the constant input column.
GELU_TAIL_CENTRE, GELU_TAIL_SPREAD, GELU_TAIL_INPUT = -3.5, 0.2, 2.0


def make_layer(case: ExpertsCase, gen: torch.Generator, registry: Registry | None = None):
    """Random float weights and inputs for a case, quantized to the case's format's storage."""
    from moe_runtime.reference_math import quantize_expert_weights

    s = case.shape
    h, i, e = s.hidden, s.intermediate, s.experts
    w13 = torch.randn((e, 2 * i, h), generator=gen) / h**0.5
    w2 = torch.randn((e, h, i), generator=gen) / i**0.5
    hidden = torch.randn((s.tokens, h), generator=gen)
    if s.input_scale != 1.0:
        hidden = hidden * s.input_scale
    if s.gates == "gelu_tail":
        # gate = -3.5 + about N(0, 0.2^2): a constant input column and a gate weight on it carry
        # the offset, the others the spread (up keeps its N(0, 1))
        hidden[:, 0] = GELU_TAIL_INPUT
        w13[:, :i] *= GELU_TAIL_SPREAD
        w13[:, :i, 0] = GELU_TAIL_CENTRE / GELU_TAIL_INPUT
    a13_amax = hidden.abs().max() if s.tokens else torch.tensor(1.0)
    a13_amax = torch.maximum(a13_amax, torch.tensor(1e-3))
    gate, up = torch.einsum("nh,eoh->eno", hidden, w13).split(i, dim=-1)
    act = torch.nn.functional.silu(gate) if case.activation == F.SILU else (
        torch.nn.functional.gelu(gate))
    inter = act * up
    a2_amax = torch.maximum(inter.abs().max() if s.tokens else torch.tensor(1.0),
                            torch.tensor(1e-3))
    twin = _reference_format(registry, case.format)
    weights = quantize_expert_weights(w13, w2, twin, case.activation,
                                      a13_amax=a13_amax, a2_amax=a2_amax)
    return weights, hidden


def model_dtype(registry: Registry | None, fmt: str) -> torch.dtype:
    """The activation dtype a layer of ``fmt`` is tried in: its own 16-bit storage, else bf16."""
    from moe_runtime.dtypes import torch_dtype
    from moe_runtime.testing.cases import activation_dtype

    spec = registry.formats[fmt].spec if registry is not None and fmt in registry.formats else (
        {f.name: f for f in F.BUILTIN_FORMATS}[fmt])
    return torch_dtype(activation_dtype(spec))


def device_for(hardware, env: Environment) -> str:
    return "cuda" if env.device == "cuda" and "cuda" in hardware.devices else "cpu"


# --------------------------------------------------------------------------- error budgets
# The budget of a case is measured, not picked per format: a legitimate low-precision emulation of
# the same computation (model-dtype rounding of GEMM 1's output, of the gated intermediate before
# GEMM 2 and its activation quantization, of each expert's output and of the result) is run on the
# same inputs, and a backend may be off by at most BUDGET_MULTIPLE times its error plus one
# rounding of the model dtype. A bias check then catches systematic errors that the maximum hides.

BUDGET_MULTIPLE = 3.0
SCALE_BOUND = 2.5e-3  # |<out,ref>/<ref,ref> - 1| allowed beyond the emulation's own (1% fails)
COLUMN_BOUND = 5e-3  # mean signed error of a column / rms(ref), beyond noise
# A scale bound under this, with the noise counted per element, is applied as it is (a 1% scale
# error fails it). Where it would exceed this (activation quantization: a code flip moves a whole
# row's outputs together, so the elements are not independent samples), the noise is counted per
# row instead: each token's row of the emulation's error is one sample of the scale's error. The
# check is applied either way: quantization noise must not hide a systematic error (a tanh-GELU
# backend was 11-16% small on the gelu_tail case of fp8_w8a8 and nvfp4_w4a4, inside their max
# budget, and the check was not applied there).
RELIABLE_SCALE = 6e-3
MIN_ELEMENTS_FOR_SCALE = 4096
MIN_ROWS_FOR_COLUMNS = 256


def emulate_low_precision(weights, hidden, ids, tw, run_as: str, dtype: torch.dtype, *,
                          stage_weights: bool = False):
    """The layer as an honest kernel in ``dtype`` would compute it (token-major, float32 out).

    ``stage_weights`` also rounds the dequantized weights to ``dtype`` (a dequantize-to-16-bit
    staging path, as W4A16 kernels do; the suite uses it only for formats that do not quantize
    activations, whose kernels compute on exact quantized operands)."""
    from moe_runtime.reference_math import (
        _activate,
        _quantize_activation,
        _run_format,
        dequantize_expert_weights,
    )

    fmt = _run_format(weights, run_as)
    w13, w2 = dequantize_expert_weights(weights, torch.float32)
    if stage_weights:
        w13, w2 = w13.to(dtype).float(), w2.to(dtype).float()
    i = weights.intermediate_size
    x = _quantize_activation(hidden.to(dtype), fmt, weights.a13_scale)
    out = torch.zeros((hidden.shape[0], weights.hidden_size), dtype=torch.float32)
    for e in range(weights.num_experts):
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        gu = (x[rows] @ w13[e].T).to(dtype).float()
        inter = (_activate(gu[:, :i], weights.activation) * gu[:, i:]).to(dtype).float()
        inter = _quantize_activation(inter, fmt, weights.a2_scale)
        y = (inter @ w2[e].T).to(dtype).float()
        out.index_add_(0, rows, y * tw[rows, slots].float().unsqueeze(1))
    return out.to(dtype).float()


def quantization_envelope(weights, hidden, ids, tw, run_as: str, dtype: torch.dtype):
    """How far an honest kernel may land from the reference through the format's own activation
    quantization: an intermediate value within one model-dtype rounding (relative ``eps``) of a
    quantization threshold may round to the neighbouring code, and a block's scale may move with
    its largest element. Per output element, the sum of the largest such steps over a few
    perturbations (all up, all down, random signs) through GEMM 2 (``[N, H]``, float32; zero for
    formats that do not quantize activations)."""
    from moe_runtime.reference_math import (
        _activate,
        _format,
        _quantize_activation,
        _run_format,
        dequantize_expert_weights,
    )

    fmt = _run_format(weights, run_as)
    out = torch.zeros((hidden.shape[0], weights.hidden_size), dtype=torch.float32)
    if _format(fmt).activation_payload == F.UNQUANTIZED:
        return out
    eps = torch.finfo(dtype).eps
    w13, w2 = dequantize_expert_weights(weights, torch.float32)
    i = weights.intermediate_size
    x = _quantize_activation(hidden.float(), fmt, weights.a13_scale)
    for e in range(weights.num_experts):
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        gu = x[rows] @ w13[e].T
        inter = _activate(gu[:, :i], weights.activation) * gu[:, i:]
        q = _quantize_activation(inter, fmt, weights.a2_scale)
        gen = torch.Generator().manual_seed(e)
        signs = [torch.ones_like(inter), -torch.ones_like(inter)] + [
            torch.randint(0, 2, inter.shape, generator=gen).float() * 2 - 1 for _ in range(2)]
        step = torch.zeros_like(inter)
        for sign in signs:
            moved = _quantize_activation(inter * (1 + eps * sign), fmt, weights.a2_scale)
            step = torch.maximum(step, (moved - q).abs())
        y = step @ w2[e].abs().T
        out.index_add_(0, rows, y * tw[rows, slots].float().abs().unsqueeze(1))
    return out


def _stats(out: torch.Tensor, ref: torch.Tensor) -> dict:
    if ref.numel() == 0:
        return {"max": 0.0, "scale": 1.0, "rms": 0.0, "columns": 0.0, "scale_row_noise": 0.0}
    scale = max(ref.abs().max().item(), 1e-12)
    err = out - ref
    rms_ref = max(ref.pow(2).mean().sqrt().item(), 1e-12)
    energy = max(ref.pow(2).sum().item(), 1e-30)
    lsq = (out * ref).sum().item() / energy
    # the standard error of the scale with each row one sample: sqrt(sum_n <err_n, ref_n>^2) / <ref, ref>
    per_row = (err * ref).reshape(err.shape[0], -1).sum(-1) if err.dim() else err.reshape(1)
    return {
        "max": err.abs().max().item() / scale,
        "scale": lsq,
        "rms": err.pow(2).mean().sqrt().item() / rms_ref,
        "columns": err.mean(0).abs().max().item() / rms_ref,
        "scale_row_noise": per_row.pow(2).sum().sqrt().item() / energy,
    }


def error_budget(emul: dict, numel: int, rows: int, dtype: torch.dtype,
                 envelope: float = 0.0) -> dict:
    """Bounds derived from the emulation's own errors on the same inputs, the format's activation
    quantization envelope (relative to the reference's range) and the sample size."""
    ulp = torch.finfo(dtype).eps / 2  # one rounding to the model dtype, relative
    noise = emul["rms"] / max(numel, 1) ** 0.5
    scale_bound = SCALE_BOUND + 3 * abs(emul["scale"] - 1) + 4 * noise
    if scale_bound > RELIABLE_SCALE:  # quantization noise: count it per row, and still check
        scale_bound = SCALE_BOUND + 3 * abs(emul["scale"] - 1) + 4 * max(
            noise, emul.get("scale_row_noise", 0.0))
    column_bound = COLUMN_BOUND + 3 * emul["columns"] + 4 * emul["rms"] / max(rows, 1) ** 0.5
    return {
        "max": BUDGET_MULTIPLE * emul["max"] + envelope + ulp,
        "scale": scale_bound if numel >= MIN_ELEMENTS_FOR_SCALE else None,
        "columns": column_bound if rows >= MIN_ROWS_FOR_COLUMNS else None,
    }


def judge(case_id: str, got: torch.Tensor, ref: torch.Tensor, emuls: list[torch.Tensor],
          dtype: torch.dtype, envelope: torch.Tensor | None = None) -> dict:
    """Compare the backend with the reference under the budgets; ``failures`` lists each miss.

    The budgets come from the worst of the legitimate emulations ``emuls`` on the same inputs."""
    mine = _stats(got, ref)
    each = [_stats(e, ref) for e in emuls]
    honest = {k: max(st[k] for st in each) for k in ("max", "rms", "columns", "scale_row_noise")}
    honest["scale"] = max((st["scale"] for st in each), key=lambda v: abs(v - 1))
    rows = int(ref.shape[0]) if ref.dim() else 0
    env = 0.0
    if envelope is not None and envelope.numel():
        env = envelope.max().item() / max(ref.abs().max().item(), 1e-12)
    budget = error_budget(honest, ref.numel(), rows, dtype, env)
    failures = []
    if mine["max"] > budget["max"]:
        failures.append(
            f"max error {mine['max']:.3e} of the reference's range exceeds the budget "
            f"{budget['max']:.3e} ({BUDGET_MULTIPLE:g} x the low-precision emulation's "
            f"{honest['max']:.3e}" + (f" + activation-quantization envelope {env:.3e}" if env
                                       else "")
            + f" + one {str(dtype).replace('torch.', '')} rounding)")
    if budget["scale"] is not None and abs(mine["scale"] - 1) > budget["scale"]:
        failures.append(
            f"bias: least-squares scale <out,ref>/<ref,ref> = {mine['scale']:.5f}, off by "
            f"{abs(mine['scale'] - 1):.2e}; the bound is {budget['scale']:.2e} (the emulation is "
            f"off by {abs(honest['scale'] - 1):.2e} on {ref.numel()} elements)")
    if budget["columns"] is not None and mine["columns"] > budget["columns"]:
        failures.append(
            f"bias: a column's mean signed error is {mine['columns']:.2e} of rms(ref); the bound "
            f"is {budget['columns']:.2e} (emulation {honest['columns']:.2e}, {rows} rows)")
    return {"error": mine["max"], "tolerance": budget["max"], "scale": mine["scale"],
            "scale_bound": budget["scale"], "columns": mine["columns"],
            "columns_bound": budget["columns"], "emulation_error": honest["max"],
            "failures": failures, "ratio": mine["max"] / budget["max"] if budget["max"] else 0.0}


def run_experts_case(registry: Registry, case: ExpertsCase, env: Environment,
                     seed: int = 0) -> dict:
    """Run one declared combination on the backend, the reference and the emulation; judge it."""
    spec = registry.experts_spec(case.backend)
    support = spec.supports[case.support_index]
    dtype = model_dtype(registry, case.format)
    problem = LayerProblem("conformance.layer", case.format, case.activation,
                           case.shape.global_experts, case.shape.top_k, case.shape.hidden,
                           case.shape.intermediate, dtype=str(dtype).replace("torch.", ""))
    failure = support.hardware.check(env)
    if not failure:
        raise ConformanceSkip(
            f"{case.backend} declares {case.format} on {support.hardware.describe_capabilities()}"
            f" ({', '.join(sorted(support.hardware.devices))}); this machine: {failure.message}")
    device = device_for(support.hardware, env)
    gen = torch.Generator().manual_seed(case_seed(case.id, seed))
    weights, hidden_f = make_layer(case, gen, registry)
    hidden = hidden_f.to(dtype)
    ids, tw = routing(case.shape, gen)

    replay = replay_command(case.backend, case.id, seed)

    def run(backend_name: str, w, payload: str, dev: str, runs_as: str, x, checked=False,
            route=None):
        route = ids if route is None else route
        bspec = registry.experts_spec(backend_name)
        setup = ExpertsSetup(problem=attrs.evolve(problem, format=w.format), runs_as=runs_as,
                             payload=payload, layout=case.layout, device=dev,
                             ep_rank=case.shape.ep_rank, ep_size=case.shape.ep_size)
        cls = load_factory(bspec.factory, backend_name)
        w = w.to(dev)
        # dispatched to this rank's experts (ids are local already: masked builds their blocks)
        d, handle, comm = _dispatch_locally(
            attrs.evolve(problem, num_experts=case.shape.experts), case.layout, x.to(dev),
            route.to(dev), tw.to(dev))
        d = _with_payload(d, payload, w)
        if not checked:
            out = cls(setup=setup)
            out.prepare(w)
            return comm.combine(out.forward(d), handle).float().cpu()
        weights_before = _tensors_of(w)
        stage = "construction"

        def failed(exc):
            return AssertionError(
                f"{case.id}: {backend_name}'s {stage} raised {type(exc).__name__}: {exc}. "
                f"Replay: {replay}")

        try:
            backend = cls(setup=setup)
            stage = "prepare"
            backend.prepare(w)
            # another layer of the same shape, prepared after it, with other weights (the
            # experts' order rolled by one): instances must share no state (a module-level cache
            # keyed by the shape gives every layer the first one's weights)
            stage = "construction"
            neighbour = cls(setup=setup)
            stage = "prepare"
            neighbour.prepare(_experts_rolled(w))
        except Exception as exc:
            raise failed(exc) from exc
        _unchanged(case, "prepare", "ExpertWeights", weights_before, _tensors_of(w), replay)
        inputs_before = _tensors_of(d)
        earlier = _earlier_batch(d, w.num_experts)
        stage = "forward"
        try:
            # the judged forward is the instance's second: its first runs on other inputs (other
            # experts, rows and weights; half the tokens in token_major), as in serving, where
            # one instance runs every batch (a grouping or size kept from a forward is caught)
            backend.forward(earlier)
            out = backend.forward(d)
        except Exception as exc:
            raise failed(exc) from exc
        _unchanged(case, "forward", "Dispatched", inputs_before, _tensors_of(d), replay)
        # the weights too: a backend may keep them from prepare (the reference reads them next)
        _unchanged(case, "forward", "ExpertWeights", weights_before, _tensors_of(w), replay)
        _check_output(case, d, out, dtype, replay)
        # combined before any replay: a backend may hand back a buffer a replay rewrites
        eager = comm.combine(out, handle).float().cpu()
        mine = _valid_rows(d, out).clone()
        relabelled = _relabelled(d, w.num_experts)
        try:
            theirs = _experts_unrolled(d, neighbour.forward(_clone_dispatched(relabelled)))
        except Exception as exc:
            raise AssertionError(
                f"{case.id}: {backend_name}'s forward raised {type(exc).__name__}: {exc} in a "
                f"second instance (another layer of the same shape, its experts' order rolled). "
                f"Replay: {replay}") from exc
        if not isinstance(theirs, torch.Tensor) or theirs.shape != out.shape:
            gap = (float("inf"), 0.0)
        else:
            from moe_runtime.tuning.measure import replay_gap

            gap = replay_gap(_valid_rows(d, theirs), mine)
        if gap:
            pristine = _clone_dispatched(d)

            def again():  # the judged instance once more, after a third one took its weights
                cls(setup=setup).prepare(w)
                return comm.combine(backend.forward(_clone_dispatched(pristine)),
                                    handle).float().cpu()

            def alone():  # a fresh instance of the judged layer: its first forward, on d
                other = cls(setup=setup)
                other.prepare(w)
                return comm.combine(other.forward(_clone_dispatched(pristine)),
                                    handle).float().cpu()

            def first_on_theirs():  # the judged instance on the second one's inputs, d's order
                out = _experts_unrolled(d, backend.forward(_clone_dispatched(relabelled)))
                return comm.combine(out, handle).float().cpu()

            neighbours.append((gap, comm.combine(theirs, handle).float().cpu()
                               if gap[0] != float("inf") else None, earlier,
                               {"again": again, "alone": alone,
                                "first_on_theirs": first_on_theirs}))
        # declared capturable: what serve does with decode steps on a CUDA device
        if bspec.cuda_graphs and out.is_cuda and d.hidden.shape[0]:
            def fresh():  # a new instance: whatever the first keeps of its inputs, it lacks
                other = cls(setup=setup)
                other.prepare(w)
                return other

            from_graph, differs = _graph_replay(case, backend, d, out, replay,
                                                lambda o: comm.combine(o, handle).float().cpu(),
                                                fresh, w.num_experts)
            replayed.append(from_graph)
            if differs:
                graph_problems.append(differs)
        return eager

    # the backend gets the weights under the case's own format name; the reference its twin's
    labelled = attrs.evolve(weights, format=case.format)
    replayed: list[torch.Tensor] = []  # the CUDA-graph replay's output, on CUDA devices
    graph_problems: list[str] = []  # a replay on new inputs that differs from the eager call
    neighbours: list = []  # the same inputs through a second instance, where it differs
    got = run(case.backend, labelled, case.payload, device, case.runs_as, hidden, checked=True)
    ref_runs_as = _reference_format(registry, case.runs_as)
    ref = run("reference", weights, F.UNQUANTIZED, "cpu", ref_runs_as, hidden.float())
    if got.shape != ref.shape:
        raise AssertionError(f"{case.id}: output shape {tuple(got.shape)}, reference "
                             f"{tuple(ref.shape)}. Replay: {replay}")
    _check_finite(case, got, ref, dtype, replay)
    valid = torch.where(ids >= 0, ids, weights.num_experts)  # remote slots match no expert
    weight_only = registry.formats[case.runs_as].spec.activation_payload == F.UNQUANTIZED
    emuls = [emulate_low_precision(weights, hidden, valid, tw, ref_runs_as, dtype,
                                   stage_weights=staged)
             for staged in ((False, True) if weight_only else (False,))]
    envelope = quantization_envelope(weights, hidden, valid, tw, ref_runs_as, dtype)
    result = judge(case.id, got, ref, emuls, dtype, envelope)
    for g in replayed:  # the replay is judged like the eager call, with the same budgets
        again = judge(case.id, g, ref, emuls, dtype, envelope)
        result["failures"] += [f"CUDA-graph replay: {f}" for f in again["failures"]]
        if not torch.isfinite(g).all():
            result["failures"].append("CUDA-graph replay: output has NaN or inf (poisoned before "
                                      "the replay: the captured forward does not write it all)")
        result["ratio"] = max(result["ratio"], again["ratio"])
    result["failures"] += graph_problems
    for (diff, scale), theirs, earlier, probes in neighbours:
        def meets(out, ref=ref, emuls=emuls, envelope=envelope):
            return (out is not None and bool(torch.isfinite(out).all())
                    and not judge(case.id, out, ref, emuls, dtype, envelope)["failures"])

        def right_on_theirs(out):
            """Whether ``out`` is the judged layer's output on the second instance's inputs: the
            reference with every token's experts numbered one on (what the relabelling does)."""
            shifted = torch.where(ids >= 0, (ids + 1) % weights.num_experts, ids)
            ref_s = run("reference", weights, F.UNQUANTIZED, "cpu", ref_runs_as, hidden.float(),
                        route=shifted)
            valid_s = torch.where(shifted >= 0, shifted, weights.num_experts)
            emuls_s = [emulate_low_precision(weights, hidden, valid_s, tw, ref_runs_as, dtype,
                                             stage_weights=staged)
                       for staged in ((False, True) if weight_only else (False,))]
            env_s = quantization_envelope(weights, hidden, valid_s, tw, ref_runs_as, dtype)
            return meets(out, ref_s, emuls_s, env_s)

        probes["right_on_theirs"] = right_on_theirs

        mine_meets, theirs_meets = not result["failures"], meets(theirs)
        evidence = _state_evidence(mine_meets, theirs_meets, theirs, probes, meets)
        problem = _state_problem(diff, scale, mine_meets, theirs_meets, evidence, earlier)
        if problem:
            result["failures"].append(problem)
    result["device"] = device
    result["graph_replayed"] = bool(replayed)
    return result


def graph_case_unchecked(registry: Registry, case, env: Environment) -> str | None:
    """Why a ``cuda_graphs=True`` promise cannot be checked on this machine (None if it can): the
    capture needs a CUDA device on which the case's block runs."""
    spec = registry.experts_spec(case.backend)
    support = spec.supports[case.experts_case.support_index]
    lead = "needs a CUDA device: the cuda_graphs=True declaration is not checked here"
    if "cuda" not in support.hardware.devices:
        return (f"{lead} ({case.backend}'s block {case.experts_case.support_index} runs on "
                f"{', '.join(sorted(support.hardware.devices))} only, where serve captures no "
                f"graph; this machine: {env.device})")
    if env.device != "cuda":
        return f"{lead} (this machine: {env.device})"
    failure = support.hardware.check(env)
    if not failure:
        return f"{lead} (this machine: {failure.message})"
    return None


def run_graph_case(registry: Registry, case, env: Environment, seed: int = 0) -> dict:
    """The case of a :class:`~moe_runtime.testing.cases.GraphCase` run on CUDA, its forward
    captured and replayed (:func:`_graph_replay`); ``ConformanceSkip`` where that cannot run."""
    why = graph_case_unchecked(registry, case, env)
    if why:
        raise ConformanceSkip(why)
    result = run_experts_case(registry, case.experts_case, env, seed)
    if not result.get("graph_replayed"):
        result["failures"].append(
            f"{case.backend} declares cuda_graphs=True, but the case's forward was not captured "
            f"(device {result.get('device')}, empty batch?)")
    return result


def _check_finite(case, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                  replay: str) -> None:
    """The output must be finite wherever the reference is (NaN or inf anywhere else fails, with
    the reference's magnitude and, for large inputs, what overflows at it)."""
    ref_ok = torch.isfinite(ref)
    bad_rows = ~torch.isfinite(got) & ref_ok
    if bad_rows.dim() >= 2:
        bad_rows = bad_rows.flatten(1).any(-1)
    if not bool(bad_rows.any()):
        return
    bad = bad_rows.nonzero().flatten().tolist()
    big = ref[ref_ok].abs().max().item() if bool(ref_ok.any()) else 0.0
    why = ""
    if case.shape.input_scale != 1.0:
        why = (f": this case's hidden states are about N(0, {case.shape.input_scale:g}^2), in "
               f"range for {str(dtype).replace('torch.', '')}; an intermediate or output kept "
               f"in a narrower dtype (float16's largest value is "
               f"{torch.finfo(torch.float16).max:.0f}) overflows to inf")
    raise AssertionError(
        f"{case.id}: output has NaN or inf in {len(bad)} of {got.shape[0]} rows where the "
        f"reference is finite (first rows {bad[:5]}; max |reference| {big:.3g}){why}. "
        f"Replay: {replay}")


def _state_evidence(mine_meets: bool, theirs_meets: bool, theirs, probes: dict,
                    meets) -> dict:
    """What more runs show about two instances that disagree, only the runs the verdict needs:

    - ``same_as_first``: the second instance's output is what the judged one (its own weights)
      computes, rightly, on the second's inputs, where the second should have computed with
      other weights;
    - ``again``: the judged instance meets the budget once a third instance is prepared with its
      weights (every instance computes with the last prepare's);
    - ``alone``: a fresh instance of the judged layer meets it on its first forward of the same
      inputs (the judged instance's own earlier forward is what changed its result)."""
    from moe_runtime.tuning.measure import replay_gap

    def probe(name):
        try:
            return probes[name]()
        except Exception:  # the probe is evidence only; the failure is reported as it is
            return None

    out: dict = {}
    if mine_meets and not theirs_meets and theirs is not None:
        # the second computes what the first computes on its inputs, and the first is right
        # there (an output that ignores the weights, zeros say, is no evidence of sharing them)
        first = probe("first_on_theirs")
        out["same_as_first"] = (first is not None and first.shape == theirs.shape
                                and not replay_gap(theirs, first)
                                and bool(probes["right_on_theirs"](first)))
    if not mine_meets and theirs_meets:
        out["again"] = meets(probe("again"))
        if not out["again"]:
            out["alone"] = meets(probe("alone"))
    return out


def _state_problem(diff: float, scale: float, mine_meets: bool, theirs_meets: bool,
                   evidence: dict, earlier: Dispatched) -> str | None:
    """Why the same inputs through two instances of one layer shape differ, in words: the judged
    instance (prepared first; the judged forward is its second) and a second one (prepared after
    it with the experts' order rolled; its first forward, on the inputs relabelled to match).

    State is claimed only where :func:`_state_evidence` shows it; where the judged instance is
    itself wrong against the reference and nothing shows state, nothing is added (its own failure
    says what is wrong)."""
    if earlier.layout == F.MASKED:
        first = "its first ran on other rows, one fewer per expert"
    else:
        n = int(earlier.hidden.shape[0])
        first = f"its first ran on {n} other token{'s' if n != 1 else ''}, routed to other experts"
    what = ("returned no tensor of the first one's shape" if diff == float("inf") else
            f"differs from it by {diff:.3g} (max |out| {scale:.3g})")
    rule = ("A forward must depend only on its own instance's prepare and its own Dispatched")
    second = ("a second instance (another layer of the same shape, prepared after this one with "
              "the experts' order rolled; its first forward, on the same inputs relabelled)")
    if mine_meets and not theirs_meets:
        if evidence.get("same_as_first"):
            return (f"state shared between instances: {second} misses the budget and {what}, "
                    f"while this one meets it, and the second's output is what this one "
                    f"computes on the second's inputs: the second computes with the first one's "
                    f"weights or state (a module- or class-level cache, e.g. keyed by the shape, "
                    f"gives every layer the first layer's weights). {rule}")
        return (f"the two instances disagree: {second} misses the budget and {what}, while this "
                f"one meets it. The second is the same computation with the experts numbered "
                f"one on; possible causes: a result that depends on which expert holds which "
                f"rows or weights (e.g. one expert's row count, offset or id read for all, wrong "
                f"only for some expert orders), non-deterministic output, or state shared "
                f"between instances")
    if not mine_meets and theirs_meets:
        if evidence.get("again"):
            return (f"state shared between instances: this instance misses the budget once "
                    f"{second} was prepared ({what}), and meets it again once a third instance "
                    f"is prepared with this one's weights: every instance computes with the last "
                    f"prepare's weights (module- or class-level state). {rule}")
        if evidence.get("alone"):
            return (f"state kept between forwards: this instance's second forward ({first}) "
                    f"misses the budget, where {second} meets it ({what}) and a fresh instance "
                    f"of this layer meets it on its first forward of the same inputs: the "
                    f"backend keeps something of an earlier forward (a grouping, a size, a "
                    f"buffer's contents). {rule}")
        return (f"a fresh instance of this layer misses the budget on these inputs too, while "
                f"{second} meets it ({what}): the error depends on which expert holds which rows "
                f"or weights (or the output is not deterministic)")
    if not mine_meets:  # both wrong against the reference: the budget failure says it all
        return None
    return (f"the two instances disagree although each meets the budget: {second} {what}. "
            f"Possible causes: non-deterministic output (unseeded randomness, an order of "
            f"atomic additions that changes the result by more than 1% of its scale), state "
            f"kept from an earlier forward ({first}), or state shared between instances. {rule}")


def _clone_dispatched(d: Dispatched) -> Dispatched:
    """``d`` with every tensor (``extra`` too) copied."""
    return attrs.evolve(
        d, **{f.name: getattr(d, f.name).clone() for f in attrs.fields(Dispatched)
              if isinstance(getattr(d, f.name), torch.Tensor)},
        extra={k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in d.extra.items()})


def _earlier_batch(d: Dispatched, num_experts: int) -> Dispatched:
    """Other inputs for an instance's forward before the judged one (:func:`_other_inputs` on a
    copy); token-major with an unquantized or fp8 payload keeps the first half of its tokens."""
    e = _clone_dispatched(d)
    _other_inputs(e, num_experts)
    if e.layout == F.MASKED or e.payload not in (F.UNQUANTIZED, F.FP8):
        return e
    n = int(e.hidden.shape[0])
    m = (n + 1) // 2

    def half(t):
        return t[:m].contiguous() if isinstance(t, torch.Tensor) and t.dim() >= 1 and (
            t.shape[0] == n) else t

    for name in ("hidden", "hidden_scale", "topk_ids", "topk_weights"):
        setattr(e, name, half(getattr(e, name)))
    e.extra = {k: half(v) for k, v in e.extra.items()}
    return e


def _rolled(t: torch.Tensor, shift: int) -> torch.Tensor:
    """A copy of ``t`` rolled along dim 0 (1-byte dtypes through a uint8 view)."""
    if t.element_size() == 1:
        return t.view(torch.uint8).roll(shift, dims=0).view(t.dtype)
    return t.roll(shift, dims=0)


def _experts_rolled(w):
    """The weights of another layer of the same shape: expert ``j`` is ``w``'s expert ``j - 1``."""
    from moe_runtime.backend_api import ExpertWeights

    e = w.num_experts
    return attrs.evolve(w, **{
        f.name: _rolled(getattr(w, f.name), 1) for f in attrs.fields(ExpertWeights)
        if isinstance(getattr(w, f.name), torch.Tensor) and getattr(w, f.name).dim() >= 1
        and getattr(w, f.name).shape[0] == e})


def _relabelled(d: Dispatched, num_experts: int) -> Dispatched:
    """``d``'s inputs for the layer of :func:`_experts_rolled` (a copy): token-major ids ``e``
    become ``e + 1``; masked expert blocks move one expert on."""
    r = _clone_dispatched(d)
    if r.layout == F.MASKED:
        for name in ("hidden", "hidden_scale", "masked_m"):
            t = getattr(r, name)
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == num_experts:
                setattr(r, name, _rolled(t, 1))
        r.extra = {k: _rolled(v, 1) if isinstance(v, torch.Tensor) and v.dim() >= 1
                   and v.shape[0] == num_experts else v for k, v in r.extra.items()}
    elif r.topk_ids is not None and num_experts:
        r.topk_ids = torch.where(r.topk_ids >= 0, (r.topk_ids + 1) % num_experts, r.topk_ids)
    return r


def _experts_unrolled(d: Dispatched, out):
    """The output of :func:`_relabelled` inputs in ``d``'s order (masked: blocks moved back)."""
    if d.layout == F.MASKED and isinstance(out, torch.Tensor) and out.dim() >= 1:
        return _rolled(out, -1)
    return out


def _graph_replay(case, backend, d: Dispatched, eager: torch.Tensor, replay: str,
                  combine, fresh, num_experts: int) -> tuple[torch.Tensor, str]:
    """Capture ``backend.forward(d)`` in a CUDA graph (after warm-up calls on a side stream, as
    serve's decode graphs are made), poison its output with NaN and replay it: ``combine`` of
    that output, judged by the caller like the eager call's. Then, as serve does, write other
    inputs into the captured ones in place (:func:`_other_inputs`: other experts per token, so
    other expert sizes, rolled rows and weights; fewer valid rows per expert for the masked
    layout), replay again and compare with an eager call on those inputs by a ``fresh()``
    instance of the backend: ``""`` when they agree.

    Run for backends that declare ``cuda_graphs=True``: ``moe-runtime serve`` then replays decode
    steps as CUDA graphs on a CUDA device, so a forward that cannot be captured, or that keeps
    values of the captured inputs, would fail every request there."""
    from moe_runtime.tuning.measure import capture_graphs, replay_gap

    try:
        [(again, out)] = capture_graphs(lambda *_: backend.forward(d), [(None, None, None)],
                                        str(eager.device))
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise AssertionError(
            f"{case.id}: {case.backend} declares cuda_graphs=True, but its forward cannot be "
            f"captured in a CUDA graph: "
            f"{type(exc).__name__}: {text[0][:300] if text else ''}. `moe-runtime serve` then replays "
            f"decode steps as CUDA graphs on CUDA devices, so a forward must not synchronize with "
            f"the host (.item(), .tolist(), .cpu(), a data-dependent shape) nor copy from pageable "
            f"host memory (`cuda_tensor[i] = 3` does; `cuda_tensor[i:i + 1].fill_(3)` does not); or "
            f"declare cuda_graphs=False. Replay: {replay}") from None
    if not isinstance(out, torch.Tensor) or out.shape != eager.shape or out.dtype != eager.dtype:
        raise AssertionError(f"{case.id}: {case.backend}'s captured forward returned "
                             f"{getattr(out, 'shape', type(out).__name__)}, the eager one "
                             f"{tuple(eager.shape)} {eager.dtype}. Replay: {replay}")

    def replayed() -> torch.Tensor:
        if out.is_floating_point():
            out.fill_(float("nan"))
        again()
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        return out.clone()

    first = combine(replayed())
    _other_inputs(d, num_experts)
    second = replayed()
    want = fresh().forward(d)  # eager, on the inputs now in the captured tensors
    gap = replay_gap(_valid_rows(d, second), _valid_rows(d, want))
    if gap:
        return first, (f"CUDA-graph replay on new inputs written into the captured ones differs "
                       f"from the eager call on them (max |diff| {gap[0]:.3g}, max |eager| "
                       f"{gap[1]:.3g}): the captured forward keeps something of the inputs it was "
                       "captured with (a size, an index, a host-side value)")
    return first, ""


def _roll(t: torch.Tensor, shift: int, dim: int) -> None:
    """``t`` rolled in place; 1-byte dtypes through a uint8 view (CUDA has no float8 roll)."""
    v = t.view(torch.uint8) if t.element_size() == 1 else t
    v.copy_(v.roll(shift, dims=dim))


def _other_inputs(d: Dispatched, num_experts: int) -> None:
    """Other valid inputs written in place into ``d``'s tensors (what a replay of a captured
    decode step sees). Token-major: each token's experts shifted by one plus its row (its slots
    stay distinct, ``-1`` stays), so the experts' sizes change; rows rolled by one (hidden,
    per-token scales) and each token's routing weights rolled over its slots. Masked: every
    expert holding several rows holds one fewer, and its rows rolled by one."""
    if d.layout == F.MASKED:
        _roll(d.hidden, 1, 1)
        if isinstance(d.hidden_scale, torch.Tensor) and d.hidden_scale.dim() >= 2:
            _roll(d.hidden_scale, 1, 1)
        if d.masked_m is not None:
            d.masked_m.copy_(torch.where(d.masked_m > 1, d.masked_m - 1, d.masked_m))
        return
    n = d.hidden.shape[0]
    for t in (d.hidden, d.hidden_scale, *d.extra.values()):
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == n and n > 1:
            _roll(t, 1, 0)
    ids = d.topk_ids
    rows = torch.arange(n, device=ids.device, dtype=ids.dtype).view(-1, *([1] * (ids.dim() - 1)))
    ids.copy_(torch.where(ids >= 0, (ids + 1 + rows) % max(1, num_experts), ids))
    if d.topk_weights.dim() == 2 and d.topk_weights.shape[1] > 1:
        _roll(d.topk_weights, 1, 1)


def _valid_rows(d: Dispatched, out: torch.Tensor) -> torch.Tensor:
    """The rows of ``forward``'s output that count: all (token-major), or each expert's first
    ``masked_m`` rows (masked), as float32 on the CPU."""
    out = out.float().cpu()
    if d.layout != F.MASKED or d.masked_m is None:
        return out
    m = d.masked_m.cpu().tolist()
    return torch.cat([out[e, :int(m[e])] for e in range(out.shape[0])]) if m else out


def _tensors_of(record) -> dict[str, torch.Tensor]:
    """Copies of every tensor field of an ``ExpertWeights`` or ``Dispatched`` (``extra`` too)."""
    out = {}
    for field in attrs.fields(type(record)):
        value = getattr(record, field.name)
        if isinstance(value, torch.Tensor):
            out[field.name] = value.detach().clone()
        elif isinstance(value, dict):
            out.update({f"{field.name}[{k!r}]": v.detach().clone() for k, v in value.items()
                        if isinstance(v, torch.Tensor)})
    return out


def _unchanged(case, stage: str, what: str, before: dict, after: dict, replay: str) -> None:
    """A backend must not write into what it is given: the engine keeps using those tensors (the
    checkpoint's weights, the dispatched hidden states and routing)."""
    changed = [name for name, t in before.items()
               if name not in after or not _same_bits(after[name], t)]
    if changed:
        raise AssertionError(
            f"{case.id}: {case.backend}'s {stage} modified its input in place: {what}."
            f"{', '.join(changed)} changed (a backend must treat the tensors it is given as "
            f"read-only; copy before writing). Replay: {replay}")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.dtype.is_floating_point:  # bitwise: NaN equals NaN, and float8 has no torch.equal on CPU
        a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    return torch.equal(a, b)


def _check_output(case, d: Dispatched, out, dtype: torch.dtype, replay: str) -> None:
    """``forward``'s own result, before combine: a tensor of the layout's shape in ``out_dtype``."""
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"{case.id}: {case.backend}'s forward returned "
                             f"{type(out).__name__}, not a tensor. Replay: {replay}")
    h = case.shape.hidden
    if d.layout == F.MASKED:
        want = (int(d.hidden.shape[0]), int(d.hidden.shape[1]), h)
        what = "[local experts, rows, hidden], unweighted"
    else:
        want = (int(d.hidden.shape[0]), h)
        what = "[tokens, hidden]"
    if tuple(out.shape) != want:
        raise AssertionError(
            f"{case.id}: {case.backend}'s forward returned shape {tuple(out.shape)}; the "
            f"{d.layout} layout needs {want} ({what}). Replay: {replay}")
    want_dtype = d.out_dtype or dtype
    if out.dtype != want_dtype:
        raise AssertionError(
            f"{case.id}: {case.backend}'s forward returned {str(out.dtype).replace('torch.', '')}"
            f"; Dispatched.out_dtype asks for {str(want_dtype).replace('torch.', '')} (the "
            f"model's dtype). Replay: {replay}")


def replay_command(backend: str, case_id: str, seed: int) -> str:
    seed_opt = f" --seed {seed}" if seed else ""
    return f"moe-runtime conformance {backend}{seed_opt} --case '{case_id}'"


def _dispatch_locally(problem, layout, hidden, ids, tw):
    from moe_runtime.backends.local import LocalComm

    comm = LocalComm(setup=CommSetup(problem=problem, payload=F.UNQUANTIZED, layout=layout))
    d, handle = comm.dispatch(hidden, ids, tw)
    return d, handle, comm


def _with_payload(d: Dispatched, payload: str, weights) -> Dispatched:
    if payload == F.UNQUANTIZED:
        return d
    scale = weights.a13_scale
    if payload == F.FP8:
        from moe_runtime.quant.fp8 import quantize_fp8_per_tensor

        d.hidden = quantize_fp8_per_tensor(d.hidden.float(), scale.to(d.hidden.device))
        d.hidden_scale = scale.to(d.hidden.device)
    elif payload == F.NVFP4:
        from moe_runtime.quant.nvfp4 import quantize_nvfp4

        packed, block = quantize_nvfp4(d.hidden.float(), scale.to(d.hidden.device))
        d.hidden, d.hidden_scale = packed, block
        d.extra["global_scale"] = scale.to(d.hidden.device)
    else:
        raise ConformanceSkip(f"the suite cannot make payload {payload!r} (not a built-in payload)")
    d.payload = payload
    return d


def check_refusal(registry: Registry, case) -> str:
    """Plan the undeclared combination with the backend pinned; return the refusal's reason."""
    env = Environment.for_target(case.environment)
    problem = LayerProblem("conformance.layer", case.format, case.activation, 8, 2, case.hidden,
                           case.intermediate)
    try:
        lp, _ = plan_layer(problem, registry=registry, environment=env,
                           deployment=Deployment(experts_backend=case.backend))
    except PlanError as exc:
        own = [r for r in exc.rejections if r.backend == case.backend]
        if not own:
            raise AssertionError(f"{case.id}: refused, but not for {case.backend}: {exc}") from exc
        return own[0].reason.value
    raise AssertionError(
        f"{case.id}: the planner accepted {case.backend} for {case.format}/{case.activation} on "
        f"{case.environment}, which its declaration does not cover (plan: {lp.experts})")


def identity_experts(d: Dispatched) -> torch.Tensor:
    """What an experts backend would return if every expert were the identity."""
    x = d.hidden
    if d.payload == F.FP8:
        x = x.float() * d.hidden_scale.float()
    x = x.float()
    if d.layout == F.MASKED:
        return x.to(d.out_dtype or torch.float32)
    valid = (d.topk_ids >= 0).float()
    return (x * (d.topk_weights.float() * valid).sum(-1, keepdim=True)).to(
        d.out_dtype or torch.float32)


# Token patterns every communication case runs through, in one process group.
COMM_SCENARIOS = ("at_bound", "random_with_an_empty_rank", "all_on_rank_0")
_COMM_EXPERTS, _COMM_TOP_K, _COMM_HIDDEN = 8, 2, 64


def _comm_tokens(case: CommCase, scenario: str, rank: int, gen: torch.Generator):
    world, e = case.world_size, _COMM_EXPERTS
    if scenario == "at_bound":  # every rank sends the mode's declared bound
        n = case.tokens
    elif scenario == "random_with_an_empty_rank":
        n = 0 if (world > 1 and rank == 1) else 5 + 3 * rank
    else:  # every token on rank 0, routed to the experts rank 0 holds
        n = min(case.tokens, 37) if rank == 0 else 0
    x = torch.randn((n, _COMM_HIDDEN), generator=gen)
    pool = e if scenario != "all_on_rank_0" else max(len(local_experts(e, world, 0)), _COMM_TOP_K)
    ids = torch.rand((n, pool), generator=gen).topk(_COMM_TOP_K, dim=-1).indices.to(torch.int32)
    w = torch.rand((n, _COMM_TOP_K), generator=gen)
    return x, ids, w


def comm_round_trip(registry: Registry, case: CommCase, rank: int, group, device: str,
                    seed: int = 0) -> dict[str, float]:
    """Dispatch then combine through identity experts for every scenario; the max error of each."""
    spec = registry.comm_spec(case.backend)
    mode = next(s for s in spec.supports if s.mode == case.mode)
    problem = LayerProblem("conformance.comm", F.FP8_W8A8 if case.payload == F.FP8 else F.BF16,
                           F.SILU, _COMM_EXPERTS, _COMM_TOP_K, _COMM_HIDDEN, 32, dtype="float32")
    bound = mode.max_tokens_per_rank if mode.max_tokens_per_rank is not None else case.tokens
    setup = CommSetup(problem=problem, payload=case.payload, layout=case.layout, ep_rank=rank,
                      ep_size=case.world_size, device=device, group=group,
                      max_tokens_per_rank=bound)
    comm = load_factory(spec.factory, case.backend)(setup=setup)
    errors = {}
    for scenario in COMM_SCENARIOS:
        gen = torch.Generator().manual_seed(case_seed(f"{case.id}/{scenario}/{rank}", seed))
        x, ids, w = _comm_tokens(case, scenario, rank, gen)
        scale = torch.tensor(6.0 / 448.0)  # a layer's static input scale: the same on every rank
        x, ids, w, scale = x.to(device), ids.to(device), w.to(device), scale.to(device)
        d, handle = comm.dispatch(x, ids, w, input_scale=scale)
        got = comm.combine(identity_experts(d), handle).float().cpu()
        xin = x
        if case.payload == F.FP8:
            from moe_runtime.quant.fp8 import fake_quantize_fp8

            xin = fake_quantize_fp8(x, scale).float()
        expected = (xin * w.sum(-1, keepdim=True)).cpu()
        if got.shape != expected.shape:
            errors[scenario] = float("inf")
            errors[scenario + ":shape"] = f"{tuple(got.shape)} != {tuple(expected.shape)}"
            continue
        errors[scenario] = (got - expected).abs().max().item() if got.numel() else 0.0
    return errors


def _comm_worker(rank, world, port, registry_kwargs, case, seed, queue):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        reg = Registry.load(**registry_kwargs)
        queue.put((rank, comm_round_trip(reg, case, rank, None, "cpu", seed), None))
    except Exception as exc:  # reported to the parent test
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def run_comm_case(registry: Registry, case: CommCase, env: Environment,
                  seed: int = 0) -> list[dict[str, float]]:
    """Round-trip errors per rank and scenario (in-process for one rank, gloo processes else)."""
    spec = registry.comm_spec(case.backend)
    mode = next(s for s in spec.supports if s.mode == case.mode)
    failure = mode.hardware.check(env)
    if not failure:
        raise ConformanceSkip(f"{case.backend} mode {case.mode}: {failure.message}")
    if case.world_size == 1:
        return [comm_round_trip(registry, case, 0, None, device_for(mode.hardware, env), seed)]
    if "cpu" not in mode.hardware.devices:
        raise ConformanceSkip(
            f"{case.backend} mode {case.mode} with {case.world_size} ranks needs "
            f"{case.world_size} GPUs; the suite runs multi-rank cases on CPU (gloo) only")
    import queue as queue_mod
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_comm_worker,
                         args=(r, case.world_size, port, {"options": registry.options},
                               case, seed, queue))
             for r in range(case.world_size)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=180) for _ in procs]
    except queue_mod.Empty:
        raise AssertionError(f"{case.id}: a rank did not answer within 180 s (hung in dispatch "
                             "or combine?)") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [r for r in results if r[2]]
    if errors:
        raise AssertionError(f"{case.id}: rank {errors[0][0]} failed: {errors[0][2]}")
    return [r[1] for r in sorted(results, key=lambda r: r[0])]


def check_token_bound(registry: Registry, case: TokenBoundCase) -> str:
    """Plan a batch one past the mode's bound: the planner must not hand it to this mode.

    Returns how it was handled: ``"refused"`` (a ``token_bound`` refusal) or the mode it chose.
    """
    problem = LayerProblem("conformance.comm", F.BF16, F.SILU, 8, 2, 64, 32)
    spec = registry.comm_spec(case.backend)
    mode = next(s for s in spec.supports if s.mode == case.mode)
    env = Environment.for_target("cpu" if "cpu" in mode.hardware.devices else "cuda:9.0")
    dep = Deployment(ep_size=case.world_size, comm_backend=case.backend,
                     max_tokens_per_rank=case.bound + 1)
    try:
        lp, _ = plan_layer(problem, registry=registry, environment=env, deployment=dep)
    except PlanError as exc:
        own = [r for r in exc.rejections if r.backend == case.backend]
        if own and all(r.reason.value in ("token_bound", "no_common_layout",
                                           "unsupported_payload") for r in own):
            return "refused"
        raise AssertionError(f"{case.id}: planning {case.bound + 1} tokens per rank failed "
                             f"for another reason: {exc}") from exc
    chosen = lp.mode_for(case.bound + 1)
    if chosen.comm_mode == case.mode:
        raise AssertionError(
            f"{case.id}: the planner gives a batch of {case.bound + 1} tokens per rank to mode "
            f"{case.mode}, which declares at most {case.bound}")
    return chosen.comm_mode


def imports_of_entry_point(backend: str, options=None) -> list[str]:
    """Kernel modules imported by loading every plugin and declaration (in a fresh process that
    loads plugins as ``options``, a :class:`~moe_runtime.plugin.manager.PluginOptions`, say)."""
    code = (
        "import sys, json; from moe_runtime.plugin.registry import Registry; r = Registry.load(); "
        f"spec = (r.experts.get({backend!r}) or r.comms.get({backend!r})).spec; "
        "mod = spec.factory.split(':')[0]; "
        f"bad = [m for m in {KERNEL_MODULES!r} + (mod,) if m in sys.modules]; "
        "print(json.dumps(bad))"
    )
    env = dict(os.environ, **(options.to_environ() if options is not None else {}))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    if out.returncode != 0:
        raise AssertionError(f"loading the plugins failed: {out.stderr[-2000:]}")
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])
