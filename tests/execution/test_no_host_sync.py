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
