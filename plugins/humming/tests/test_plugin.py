"""The plugin as moe-runtime sees it: discovery, the declaration, the plan, the routing the kernels
are fed with, and the conformance suite generated from the declaration (declared combinations run
on a compute capability 9.0 device with humming-kernels installed; elsewhere they are skipped with
the reason; refusals run everywhere)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moe_runtime import formats as F
from moe_runtime.backend_api import LayerProblem
from moe_runtime.environment import Environment
from moe_runtime.planner import Deployment, plan_layer
from moe_runtime.plugin.registry import Registry
from moe_runtime.testing.suite import *  # noqa: F401,F403

MOE_CONFORMANCE_BACKENDS = ["humming"]

H200 = Environment("cuda", (9, 0), available=frozenset({"triton", "torch", "humming"}), name="H200")
LAYER = LayerProblem("model.layers.0.mlp.experts", F.NVFP4_W4A16, "silu", 256, 8, 7168, 2048)


def test_entry_point_registers_humming_without_importing_kernels():
    code = (
        "import sys\n"
        "from moe_runtime.plugin.registry import Registry\n"
        "reg = Registry.load()\n"
        "assert 'humming' in reg.experts, sorted(reg.experts)\n"
        "bad = [m for m in ('humming', 'torch', 'moe_runtime_humming.backend') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_triton_stays_the_default_and_humming_runs_when_pinned():
    reg = Registry.load()
    lp, _ = plan_layer(LAYER, registry=reg, environment=H200, deployment=Deployment())
    if "triton" in reg.experts:
        assert lp.experts == "triton"
    pinned, _ = plan_layer(LAYER, registry=reg, environment=H200,
                           deployment=Deployment(experts_backend="humming"))
    assert pinned.experts == "humming" and pinned.runs_as == F.NVFP4_W4A16
    w4a4 = LayerProblem("l", F.NVFP4_W4A4, "gelu", 256, 8, 7168, 2048)
    lp4, _ = plan_layer(w4a4, registry=reg, environment=H200,
                        deployment=Deployment(experts_backend="humming"))
    assert lp4.experts == "humming" and lp4.runs_as == F.NVFP4_W4A16 and lp4.degradations


@pytest.mark.parametrize("env, why", [
    (Environment("cuda", (9, 0), available=frozenset({"torch"}), name="H100 without humming"),
     "humming"),
    (Environment("cuda", (10, 0), available=frozenset({"torch", "humming"}), name="B200"), "9.0"),
])
def test_pinned_humming_is_refused_where_it_is_not_declared(env, why):
    from moe_runtime_humming.plugin import HUMMING_EXPERTS

    verdict = HUMMING_EXPERTS.check(LAYER, env)
    assert not verdict and why in verdict.describe()


def test_shapes_off_the_declared_multiple_are_refused():
    from moe_runtime_humming.plugin import HUMMING_EXPERTS

    odd = LayerProblem("l", F.NVFP4_W4A16, "silu", 8, 2, 7168, 2112)  # 2112 = 16.5 x 128
    assert not HUMMING_EXPERTS.check(odd, H200)
    assert HUMMING_EXPERTS.check(LAYER, H200)


def _route_by_hand(ids, experts, block_m):
    flat = ids.reshape(-1).tolist()
    rows, blocks = [], []
    for e in range(experts):
        mine = [p for p, x in enumerate(flat) if x == e]
        if not mine:
            continue
        pad = -len(mine) % block_m
        rows += mine + [len(flat)] * pad
        blocks += [e] * ((len(mine) + pad) // block_m)
    return rows, blocks


@pytest.mark.parametrize("n, k, experts, block_m, seed", [
    (1, 1, 4, 16, 0), (7, 3, 8, 16, 1), (64, 8, 16, 32, 2), (5, 2, 32, 64, 3), (0, 2, 4, 16, 4),
])
def test_routing_groups_pairs_by_expert_in_padded_blocks(n, k, experts, block_m, seed):
    from moe_runtime_humming.backend import max_sorted_rows, route

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, experts + 1, (n, k), generator=g)  # -1 and `experts`: not computed here
    sorted_ids, block_experts, used = route(ids, experts, block_m)
    rows, blocks = _route_by_hand(ids, experts, block_m)
    R = max_sorted_rows(n * k, experts, block_m)
    assert sorted_ids.shape == (R,) and block_experts.shape == (R // block_m,)
    assert int(used) == len(rows)
    assert sorted_ids[:len(rows)].tolist() == rows
    assert (sorted_ids[len(rows):] == n * k).all()
    assert block_experts[:len(blocks)].tolist() == blocks
    assert (block_experts[len(blocks):] == -1).all()


def test_backend_refuses_a_setup_its_declaration_does_not_admit():
    from moe_runtime_humming.backend import HummingExperts

    from moe_runtime.backend_api import ExpertsSetup

    setup = ExpertsSetup(problem=LAYER, runs_as=F.NVFP4_W4A16, payload=F.UNQUANTIZED,
                         layout=F.MASKED, device="cuda")
    with pytest.raises(ValueError, match="masked"):
        HummingExperts(setup=setup)


@pytest.mark.parametrize("n, k, experts, seed", [(7, 3, 8, 5), (64, 8, 16, 6), (1, 1, 4, 7)])
def test_one_sort_serves_both_block_sizes_and_cached_ranges_change_nothing(n, k, experts, seed):
    from moe_runtime_humming.backend import cached_index, place_pairs, route, sort_pairs

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, experts + 1, (n, k), generator=g).to(torch.int32)
    sp = sort_pairs(ids, experts, cached_index(1 << 12, "cpu"))
    for block_m in (16, 64):
        shared = place_pairs(sp, block_m, cached_index(1 << 8, "cpu", step=block_m))
        alone = route(ids, experts, block_m)
        for got, want in zip(shared, alone):
            assert got.dtype == want.dtype == torch.int32
            assert torch.equal(got, want)
    # the weights of pairs routed elsewhere are masked by the sort's buckets
    assert torch.equal(sp.bucket < experts, ((ids >= 0) & (ids < experts)).reshape(-1))


def test_routing_makes_no_scalar_copies_that_a_cuda_graph_capture_refuses():
    """``cuda_tensor[i] = 3`` copies a pageable host scalar into device memory, which a CUDA-graph
    capture refuses (the H200 tune of 2026-12-04 found the routing doing it, so humming never
    captured). On CPU the same assignment shows as ``aten.copy_`` from a 0-dim tensor."""
    from moe_runtime_humming.backend import route
    from torch.utils._python_dispatch import TorchDispatchMode

    class ScalarCopies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.copy_ and args[1].dim() == 0:
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    ids = torch.randint(-1, 9, (16, 4), generator=torch.Generator().manual_seed(8))
    with ScalarCopies() as mode:
        route(ids, 8, 16)
    assert mode.seen == []


@pytest.mark.parametrize("n, k, experts, block_m, seed", [
    (1, 8, 128, 16, 10), (7, 3, 8, 16, 11), (64, 8, 16, 32, 12), (300, 2, 32, 64, 13),
])
def test_the_triton_routing_gives_the_torch_routings_blocks(n, k, experts, block_m, seed):
    """On a CUDA device the backend routes with the triton plugin's kernels where installed: the
    same blocks, experts and padding as :func:`route`, pairs in any order within an expert (its
    kernels count with atomics). Checked here through Triton's interpreter."""
    from moe_runtime_humming.backend import route, route_with, triton_router

    ops = triton_router()
    if ops is None:
        pytest.skip("the triton plugin is not installed")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, experts + 1, (n, k), generator=g)  # -1 and `experts`: not here
    want_ids, want_blocks, want_used = route(ids, experts, block_m)
    got_ids, got_blocks, got_used = route_with(ops, ids, experts, block_m)
    used = int(want_used)
    assert int(got_used) == used
    assert torch.equal(got_blocks[:used // block_m], want_blocks[:used // block_m])
    assert (got_blocks[used // block_m:] == -1).all()
    for b in range(used // block_m):  # the same pairs in each block, padding rows included
        rows = slice(b * block_m, (b + 1) * block_m)
        assert sorted(got_ids[rows].tolist()) == sorted(want_ids[rows].tolist()), b
    assert (got_ids[used:] == n * k).all()
