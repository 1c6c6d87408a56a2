"""Under expert parallelism a forward makes no device-to-host copy of its own.

Two gloo processes on CPU run one MoE layer whose plan has two communication modes (a bounded one
and an unbounded one). Every call that would copy a tensor to the host (``.item()``, ``.tolist()``,
``int(t)``, ``float(t)``, ``bool(t)``, ``.numpy()``) is counted while the layer runs, except inside
the backends' own ``dispatch``/``forward``/``combine`` (the reference all-to-all exchanges its split
sizes on the host, a choice its declaration's authors made): the core adds none.
"""

from __future__ import annotations

import os
import socket
import types
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp

from moe_runtime import CommBackendSpec, CommSupport, hookimpl

# The reference all-to-all declared with two modes: a bounded one first, then an unbounded one.
TWO_MODES_A2A = CommBackendSpec(
    name="a2a_two_modes", factory="moe_runtime.backends.all_to_all:TorchAllToAll", priority=100,
    supports=[CommSupport(layout="token_major", min_world_size=2, max_tokens_per_rank=8,
                          mode="small"),
              CommSupport(layout="token_major", min_world_size=2, mode="large")])

HOST_COPIES = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")


def _registry():
    from moe_runtime.plugin.manager import get_plugin_manager
    from moe_runtime.plugin.registry import Registry

    plugin = types.ModuleType("a2a_two_modes_plugin")

    @hookimpl
    def moe_runtime_register_backends(register):
        register(TWO_MODES_A2A)

    plugin.moe_runtime_register_backends = moe_runtime_register_backends
    return Registry.from_plugin_manager(
        get_plugin_manager(autoload=False, plugins=[plugin], environ={}))


def _counting_host_copies(paths):
    """A context manager that counts host copies outside the backends' own calls."""
    import contextlib

    seen: list[str] = []
    depth = [0]

    def outside_backends(fn):
        def wrapper(*a, **k):
            depth[0] += 1
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
        return wrapper

    for _, comm, experts in paths:
        comm.dispatch = outside_backends(comm.dispatch)
        comm.combine = outside_backends(comm.combine)
        experts.forward = outside_backends(experts.forward)

    def counted(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *a, **k):
            if depth[0] == 0:
                seen.append(name)
            return original(self, *a, **k)
        return wrapper

    stack = contextlib.ExitStack()
    for name in HOST_COPIES:
        stack.enter_context(mock.patch.object(torch.Tensor, name, counted(name)))
    return stack, seen


def _worker(rank, world, port, queue):
    import torch.distributed as dist

    from moe_runtime.backend_api import ExpertsSetup, LayerProblem
    from moe_runtime.environment import Environment
    from moe_runtime.executor import MoELayer, build_executor
    from moe_runtime.planner import Deployment, plan_layer
    from moe_runtime.reference_math import quantize_expert_weights, reference_fused_experts
    from moe_runtime.router import RouterConfig, route

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        reg = _registry()
        problem = LayerProblem("layer", "bf16", "silu", 8, 2, 32, 16, dtype="float32")
        lp, _ = plan_layer(problem, registry=reg, environment=Environment("cpu", None, None, "cpu"),
                           deployment=Deployment(ep_size=world, max_tokens_per_rank=64))
        gen = torch.Generator().manual_seed(0)  # the same weights and gate on every rank
        full = quantize_expert_weights(torch.randn(8, 32, 32, generator=gen) / 6,
                                       torch.randn(8, 32, 16, generator=gen) / 4, "bf16", "silu")
        gate = torch.randn(8, 32, generator=gen)
        setup = ExpertsSetup(problem=problem, runs_as="bf16", payload="unquantized",
                             layout="token_major", ep_rank=rank, ep_size=world)
        first, count = setup.first_local_expert, setup.num_local_experts
        local = type(full)(full.format, full.activation, full.w13[first:first + count],
                           full.w2[first:first + count])
        ex = build_executor(lp, reg, local, ep_rank=rank, ep_size=world, group=dist.group.WORLD,
                            max_tokens_per_rank=64)
        layer = MoELayer(gate, RouterConfig(top_k=2), ex)
        # ranks send different batches: rank 0 fits the bounded mode, rank 1 does not
        x = torch.randn(3 if rank == 0 else 20, 32, generator=torch.Generator().manual_seed(rank))
        stack, seen = _counting_host_copies(ex.paths)
        with stack, torch.no_grad():
            out = layer(x)
            ids, w = route(torch.nn.functional.linear(x, gate), RouterConfig(top_k=2))
            out_bounded = ex(x, ids, w, max_tokens_per_rank=20)  # the engine's bound
        expected = reference_fused_experts(x, ids, w, full)
        queue.put((rank, list(seen), [m.comm_mode for m in lp.modes],
                   float((out - expected).abs().max()),
                   float((out_bounded - expected).abs().max()), None))
    except Exception:
        import traceback

        queue.put((rank, None, None, None, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2])
def test_an_expert_parallel_forward_makes_no_host_copy_outside_the_backends(world):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, seen, modes, err_default, err_bounded, error in results:
        assert error is None, f"rank {rank} failed:\n{error}"
        assert modes == ["small", "large"]
        assert seen == [], f"rank {rank}: host copies on the forward path: {seen}"
        assert err_default < 1e-5 and err_bounded < 1e-5


# --------------------------------------------------------- the engine's bound, through load_model


def _load_model_worker(rank, world, port, path, queue):
    import torch.distributed as dist

    from moe_runtime.integration.transformers import load_model
    from moe_runtime.planner import Deployment

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        reg = _registry()
        deployment = Deployment(ep_size=world, max_tokens_per_rank=64)
        results = {}
        for bound in (6, None):  # the engine's promise: at most 6 tokens per forward
            loaded = load_model(path, registry=reg, deployment=deployment, dtype="float32",
                                ep_rank=rank, ep_size=world, group=dist.group.WORLD,
                                max_tokens_per_forward=bound)
            seen, modes = _count_in_moe_layers(loaded.model)
            # the ranks' batches differ (3 and 6 tokens): each picks its mode from the bound
            ids = torch.arange(3 if rank == 0 else 6).reshape(1, -1) + 5
            with torch.no_grad():
                logits = loaded.model(ids).logits
            results[bound] = (list(seen), sorted(set(modes)), logits)
        alone = load_model(path, dtype="float32")  # one rank, the built-in plan
        with torch.no_grad():
            expected = alone.model(ids).logits
        queue.put((rank, {b: (s, m, float((lg - expected).abs().max()))
                          for b, (s, m, lg) in results.items()}, None))
    except Exception:
        import traceback

        queue.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _count_in_moe_layers(model):
    """Count host copies made inside the MoE layers' experts calls (outside the backends), and
    record the communication mode each call used."""
    seen: list[str] = []
    modes: list[str] = []
    inside = [0]

    def counted(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *a, **k):
            if inside[0] == 1:  # in an MoE layer, not in a backend's own call
                seen.append(name)
            return original(self, *a, **k)
        return wrapper

    def entering(fn, depth, mode=None):
        def wrapper(*a, **k):
            if mode is not None:
                modes.append(mode)
            inside[0] += depth
            try:
                return fn(*a, **k)
            finally:
                inside[0] -= depth
        return wrapper

    for module in model.modules():
        ex = getattr(module, "_moe_runtime_executor", None)
        if ex is None:
            continue
        for mode, comm, experts in ex.paths:
            comm.dispatch = entering(comm.dispatch, 1, mode.comm_mode)
            comm.combine = entering(comm.combine, 1)
            if not hasattr(experts.forward, "_wrapped"):
                experts.forward = entering(experts.forward, 1)
                experts.forward._wrapped = True
        module._moe_runtime_executor = entering(ex, 1)
    for name in HOST_COPIES:
        patcher = mock.patch.object(torch.Tensor, name, counted(name))
        patcher.start()
    return seen, modes


def test_load_model_hands_the_engines_token_bound_to_every_layer(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", "bf16")
    world = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_load_model_worker, args=(r, world, port, str(path), queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, by_bound, error in results:
        assert error is None, f"rank {rank} failed:\n{error}"
        seen, modes, err = by_bound[6]
        assert seen == [], f"rank {rank}: host copies in the MoE layers: {seen}"
        assert modes == ["small"], f"rank {rank}: the bound of 6 tokens picks the bounded mode"
        assert err < 1e-4
        seen, modes, err = by_bound[None]
        assert seen == [] and modes == ["large"], "without a bound every rank uses the last mode"
        assert err < 1e-4


def test_a_forward_over_the_engines_bound_is_refused(tiny_checkpoint):
    from moe_runtime.integration.transformers import load_model

    loaded = load_model(tiny_checkpoint("qwen3_moe", "bf16"), dtype="float32",
                        max_tokens_per_forward=4)
    with torch.no_grad():
        loaded.model(torch.arange(4).reshape(1, -1))  # at the bound: served
        with pytest.raises(ValueError, match="forward of 5 tokens .* max_tokens_per_forward=4"):
            loaded.model(torch.arange(5).reshape(1, -1))


@pytest.mark.parametrize("bound, needle", [
    (65, "exceeds the plan's max_tokens_per_rank=64.*--max-tokens-per-rank 65"),
    (0, "max_tokens_per_forward must be a positive int, got 0"),
])
def test_a_bound_the_plan_cannot_serve_is_refused_before_loading(tiny_checkpoint, bound, needle):
    from moe_runtime.integration.transformers import load_model
    from moe_runtime.planner import Deployment

    with pytest.raises(ValueError, match=needle):
        load_model(tiny_checkpoint("qwen3_moe", "bf16"), ep_size=2,
                   deployment=Deployment(ep_size=2, max_tokens_per_rank=64),
                   max_tokens_per_forward=bound)
