"""The backend's own refusals, which hold even when a user pins it past the planner.

These run on CPU: they need neither a GPU nor FlashInfer, and check that FlashInfer is not even
imported on the way to refusing.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from moe_runtime import formats as F
from moe_runtime_flashinfer_cutedsl import plugin
from moe_runtime_flashinfer_cutedsl.backend import (
    CuteDslExperts,
    UnsupportedDeviceError,
    check_capability,
)

from cutedsl_helpers import make_setup


@pytest.mark.parametrize("cap", plugin.supported_capabilities())
def test_the_declared_capabilities_pass_the_guard(cap):
    check_capability(cap)


@pytest.mark.parametrize("cap", [(9, 0), (8, 0), (8, 9), (11, 0), (12, 0), (12, 1), (10, 1)])
def test_every_other_capability_is_refused(cap):
    with pytest.raises(UnsupportedDeviceError) as info:
        check_capability(cap, "cuda:0")
    msg = str(info.value)
    assert "10.0, 10.3, 10.7" in msg and f"{cap[0]}.{cap[1]}" in msg


def test_the_sm90_refusal_says_why_it_must_not_run_there():
    with pytest.raises(UnsupportedDeviceError, match="return garbage without raising"):
        check_capability((9, 0))


def test_no_cuda_is_refused():
    with pytest.raises(UnsupportedDeviceError, match="has no CUDA"):
        check_capability(None, "cpu")


def test_constructing_it_on_cpu_is_refused():
    with pytest.raises(UnsupportedDeviceError, match="needs a CUDA device of compute capability"):
        CuteDslExperts(setup=make_setup(8, device="cpu"))


@pytest.mark.parametrize("kw", [
    dict(fmt=F.FP8_W8A8),
    dict(fmt=F.BF16),
    dict(activation=F.GELU),
    dict(fmt=F.NVFP4_W4A16, layout=F.MASKED),
    dict(layout=F.TOKEN_MAJOR, payload=F.NVFP4),
])
def test_undeclared_combinations_are_refused_at_construction(kw):
    # the guard is the declaration's own matching rule: the refusal names the closed reason
    with pytest.raises(ValueError, match=r"flashinfer_cutedsl cannot run .*: unsupported_\w+: "):
        CuteDslExperts(setup=make_setup(8, device="cuda", **kw))


def test_refusing_imports_no_flashinfer():
    code = (
        "import sys\n"
        "sys.path.insert(0, 'tests')\n"
        "from cutedsl_helpers import make_setup\n"
        "from moe_runtime_flashinfer_cutedsl.backend import CuteDslExperts\n"
        "from moe_runtime_flashinfer_cutedsl.backend import UnsupportedDeviceError\n"
        "try:\n"
        "    CuteDslExperts(setup=make_setup(8, device='cpu'))\n"
        "except UnsupportedDeviceError:\n"
        "    pass\n"
        "print([m for m in ('flashinfer', 'cutlass') if m in sys.modules])\n"
    )
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _cuda_capability():
    import torch

    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


@pytest.mark.skipif(_cuda_capability() is None, reason="needs a CUDA device (none here)")
@pytest.mark.skipif(_cuda_capability() in plugin.supported_capabilities(),
                    reason="this CUDA device is one the backend runs on")
def test_on_this_cuda_device_it_refuses_before_touching_flashinfer():
    """Real hardware below (or beside) 10.x, e.g. an H100 or H200 (9.0): construction raises."""
    import torch

    cap = _cuda_capability()
    with pytest.raises(UnsupportedDeviceError, match=f"has compute capability {cap[0]}.{cap[1]}"):
        CuteDslExperts(setup=make_setup(8, device="cuda"))
    assert torch.cuda.is_available()
    assert "flashinfer" not in sys.modules


# ------------------------------------------------------------- the pure parts of the forward path


def test_local_routes_become_global_ids_and_other_ranks_an_id_off_this_rank():
    import torch

    from moe_runtime_flashinfer_cutedsl.backend import global_routes

    ids = torch.tensor([[0, -1], [2, 1], [-1, -1]], dtype=torch.int64)
    w = torch.tensor([[0.5, 0.5], [0.25, 0.75], [0.1, 0.9]], dtype=torch.bfloat16)
    g, gw = global_routes(ids, w, first=3, elsewhere=6)  # rank holding experts 3, 4, 5
    assert g.dtype == torch.int32 and gw.dtype == torch.float32
    assert g.tolist() == [[3, 6], [5, 4], [6, 6]]
    assert torch.equal(gw, w.float())  # weights of other ranks' routes are never applied here


def test_with_every_expert_local_a_stray_route_gets_weight_zero():
    import torch

    from moe_runtime_flashinfer_cutedsl.backend import global_routes

    g, gw = global_routes(torch.tensor([[1, -1]]), torch.tensor([[0.4, 0.6]]), 0, None)
    assert g.tolist() == [[1, 0]] and gw.tolist() == [[pytest.approx(0.4), 0.0]]


def test_the_expert_id_for_other_ranks_lies_outside_this_ranks_window():
    from moe_runtime_flashinfer_cutedsl.backend import id_off_rank

    for n, ep in ((8, 2), (7, 3), (5, 5), (9, 4)):
        for rank in range(ep):
            s = make_setup(n, ep_rank=rank, ep_size=ep)
            first, count = s.first_local_expert, s.num_local_experts
            elsewhere = id_off_rank(first, count, n)
            assert elsewhere is not None and 0 <= elsewhere < n
            assert not first <= elsewhere < first + count
    assert id_off_rank(0, 8, 8) is None


@pytest.mark.parametrize("given", ["linear", "storage", "view"])
def test_prequantized_activation_scales_are_taken_in_any_of_the_three_layouts(given):
    import torch

    from moe_runtime_flashinfer_cutedsl import weights as W
    from moe_runtime_flashinfer_cutedsl.backend import activation_scales_mma

    linear = torch.randint(1, 120, (4, 96, 8), dtype=torch.uint8).view(torch.float8_e4m3fn)
    storage = W.swizzle_block_scales(linear)
    view = W.mma_scale_view(storage)
    arg = {"linear": linear, "storage": storage.view(torch.float8_e4m3fn), "view": view}[given]
    got = activation_scales_mma(arg)
    assert tuple(got.shape) == (32, 4, 1, 4, 2, 4)
    assert torch.equal(got.contiguous().view(torch.uint8), view.contiguous())
