"""Running one conformance case: build inputs, run the backend, run the reference, compare."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from moe_runtime import formats as F
from moe_runtime.declarations import load_factory
from moe_runtime.environment import Environment
from moe_runtime.manager import Registry
from moe_runtime.planner import Deployment, PlanError, plan_layer
from moe_runtime.runtime import CommSetup, Dispatched, ExpertsSetup, LayerProblem
from moe_runtime.testing.cases import DEFAULT_TOLERANCE, TOLERANCE, CommCase, ExpertsCase, Shape

KERNEL_MODULES = ("triton", "flashinfer", "deep_ep", "cutlass", "deep_gemm")


class ConformanceSkip(Exception):
    """The machine lacks what the declaration needs: the case is skipped, with this reason."""


def routing(shape: Shape, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    n, e, k = shape.tokens, shape.experts, shape.top_k
    if shape.routing == "one_expert":
        ids = torch.full((n, k), 3 % e, dtype=torch.int32)
    else:
        pool = e if shape.routing == "random" else max(k, e // 2)  # upper experts idle
        scores = torch.rand((n, pool), generator=gen)
        ids = scores.topk(k, dim=-1).indices.to(torch.int32)
    if shape.routing == "remote_slots":
        remote = torch.rand((n, k), generator=gen) < 0.4
        remote[0] = True  # a token none of whose experts is local
        ids = ids.masked_fill(remote, -1)
    w = torch.rand((n, k), generator=gen) + 0.1
    w = w / w.sum(-1, keepdim=True)
    return ids, w.float()


def make_layer(case: ExpertsCase, gen: torch.Generator):
    """Random float weights and inputs for a case, quantized to the case's format."""
    from moe_runtime.formats import BUILTIN_FORMATS
    from moe_runtime.reference_math import quantize_expert_weights

    if case.format not in {f.name for f in BUILTIN_FORMATS}:
        raise ConformanceSkip(
            f"format {case.format!r} is registered by a plugin; the suite can only make weights "
            "of the built-in formats (bf16, fp16, fp8_w8a8, nvfp4_w4a4, nvfp4_w4a16)")
    s = case.shape
    h, i, e = s.hidden, s.intermediate, s.experts
    w13 = torch.randn((e, 2 * i, h), generator=gen) / h**0.5
    w2 = torch.randn((e, h, i), generator=gen) / i**0.5
    hidden = torch.randn((s.tokens, h), generator=gen)
    a13_amax = hidden.abs().max() if s.tokens else torch.tensor(1.0)
    a13_amax = torch.maximum(a13_amax, torch.tensor(1e-3))
    gate, up = torch.einsum("nh,eoh->eno", hidden, w13).split(i, dim=-1)
    act = torch.nn.functional.silu(gate) if case.activation == F.SILU else (
        torch.nn.functional.gelu(gate))
    inter = act * up
    a2_amax = torch.maximum(inter.abs().max() if s.tokens else torch.tensor(1.0),
                            torch.tensor(1e-3))
    weights = quantize_expert_weights(w13, w2, case.format, case.activation,
                                      a13_amax=a13_amax, a2_amax=a2_amax)
    return weights, hidden


def _dtype_for(fmt: str) -> torch.dtype:
    return torch.float16 if fmt == F.FP16 else torch.bfloat16


def device_for(hardware, env: Environment) -> str:
    return "cuda" if env.device == "cuda" and "cuda" in hardware.devices else "cpu"


def run_experts_case(registry: Registry, case: ExpertsCase, env: Environment) -> dict:
    """Run one declared combination on the backend and on the reference; return the errors."""
    spec = registry.experts_spec(case.backend)
    support = spec.supports[case.support_index]
    problem = LayerProblem("conformance.layer", case.format, case.activation, case.shape.experts,
                           case.shape.top_k, case.shape.hidden, case.shape.intermediate,
                           dtype=str(_dtype_for(case.format)).replace("torch.", ""))
    failure = support.hardware.check(env)
    if not failure:
        raise ConformanceSkip(
            f"{case.backend} declares {case.format} on {support.hardware.describe_capabilities()}"
            f" ({', '.join(sorted(support.hardware.devices))}); this machine: {failure.message}")
    device = device_for(support.hardware, env)
    gen = torch.Generator().manual_seed(hash(case.id) % (2**31))
    weights, hidden_f = make_layer(case, gen)
    dtype = _dtype_for(case.format)
    hidden = hidden_f.to(dtype)
    ids, tw = routing(case.shape, gen)

    def run(backend_name: str, payload: str, dev: str):
        bspec = registry.experts_spec(backend_name)
        setup = ExpertsSetup(problem=problem, runs_as=case.runs_as, payload=payload,
                             layout=case.layout, device=dev)
        backend = load_factory(bspec.factory)(setup=setup)
        backend.prepare(weights.to(dev))
        d, handle, comm = _dispatch_locally(problem, case.layout, hidden.to(dev), ids.to(dev),
                                            tw.to(dev))
        d = _with_payload(d, payload, weights)
        out = backend.forward(d)
        return comm.combine(out, handle).float().cpu()

    got = run(case.backend, case.payload, device)
    ref = run("reference", F.UNQUANTIZED, "cpu")
    if got.shape != ref.shape:
        raise AssertionError(f"{case.id}: output shape {tuple(got.shape)}, reference "
                             f"{tuple(ref.shape)}")
    if not torch.isfinite(got).all():
        raise AssertionError(f"{case.id}: output has NaN or inf")
    scale = ref.abs().max().item() if ref.numel() else 0.0
    err = (got - ref).abs().max().item() / max(scale, 1e-6) if ref.numel() else 0.0
    tol = TOLERANCE.get(case.runs_as, DEFAULT_TOLERANCE)
    return {"error": err, "tolerance": tol, "device": device}


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
    problem = LayerProblem("conformance.layer", case.format, case.activation, 8, 2, 128, 64)
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


def comm_round_trip(registry: Registry, case: CommCase, rank: int, group, device: str,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch then combine through identity experts: returns (got, expected) on this rank."""
    spec = registry.comm_spec(case.backend)
    problem = LayerProblem("conformance.comm", F.FP8_W8A8 if case.payload == F.FP8 else F.BF16,
                           F.SILU, 8, 2, 64, 32, dtype="float32")
    setup = CommSetup(problem=problem, payload=case.payload, layout=case.layout, ep_rank=rank,
                      ep_size=case.world_size, device=device, group=group,
                      max_tokens_per_rank=64)
    comm = load_factory(spec.factory)(setup=setup)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    n = 0 if rank == 1 else 5 + 3 * rank  # a rank with no tokens at all must work too
    x = torch.randn((n, 64), generator=gen)
    ids = torch.rand((n, 8), generator=gen).topk(2, dim=-1).indices.to(torch.int32)
    w = torch.rand((n, 2), generator=gen)
    scale = torch.tensor(6.0 / 448.0)  # a layer's static input scale: the same on every rank
    x, ids, w, scale = x.to(device), ids.to(device), w.to(device), scale.to(device)
    d, handle = comm.dispatch(x, ids, w, input_scale=scale)
    got = comm.combine(identity_experts(d), handle).float()
    xin = x
    if case.payload == F.FP8:
        from moe_runtime.quant.fp8 import fake_quantize_fp8

        xin = fake_quantize_fp8(x, scale).float()
    return got.cpu(), (xin * w.sum(-1, keepdim=True)).cpu()


def _comm_worker(rank, world, port, registry_kwargs, case, queue):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        reg = Registry.load(**registry_kwargs)
        got, exp = comm_round_trip(reg, case, rank, None, "cpu")
        queue.put((rank, (got - exp).abs().max().item() if got.numel() else 0.0, None))
    except Exception as exc:  # reported to the parent test
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def run_comm_case(registry: Registry, case: CommCase, env: Environment) -> list[float]:
    """Round-trip errors per rank (in-process for one rank, gloo processes for more)."""
    spec = registry.comm_spec(case.backend)
    mode = next(s for s in spec.supports if s.mode == case.mode)
    failure = mode.hardware.check(env)
    if not failure:
        raise ConformanceSkip(f"{case.backend} mode {case.mode}: {failure.message}")
    if case.world_size == 1:
        got, exp = comm_round_trip(registry, case, 0, None, device_for(mode.hardware, env))
        return [(got - exp).abs().max().item() if got.numel() else 0.0]
    if "cpu" not in mode.hardware.devices:
        raise ConformanceSkip(
            f"{case.backend} mode {case.mode} with {case.world_size} ranks needs "
            f"{case.world_size} GPUs; the suite runs multi-rank cases on CPU (gloo) only")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_comm_worker, args=(r, case.world_size, port, {}, case, queue))
             for r in range(case.world_size)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [r for r in results if r[2]]
    if errors:
        raise AssertionError(f"{case.id}: rank {errors[0][0]} failed: {errors[0][2]}")
    return [r[1] for r in sorted(results)]


def imports_of_entry_point(backend: str) -> list[str]:
    """Kernel modules imported by loading every plugin and declaration (in a fresh process)."""
    code = (
        "import sys, json; from moe_runtime.manager import Registry; r = Registry.load(); "
        f"spec = (r.experts.get({backend!r}) or r.comms.get({backend!r})).spec; "
        "mod = spec.factory.split(':')[0]; "
        f"bad = [m for m in {KERNEL_MODULES!r} + (mod,) if m in sys.modules]; "
        "print(json.dumps(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        raise AssertionError(f"loading the plugins failed: {out.stderr[-2000:]}")
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])
