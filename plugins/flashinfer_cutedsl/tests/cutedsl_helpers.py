"""Helpers of this plugin's tests: NVFP4 expert weights made by nvidia-modelopt's quantizer,
setups, the GPU tests' skip reason. A module of its own (not ``conftest``) so that it imports by a
name no other test tree uses, in pytest's ``importlib`` mode too."""

from __future__ import annotations

import importlib.util

import torch

from moe_runtime import formats as F
from moe_runtime.backend_api import ExpertsSetup, ExpertWeights, LayerProblem

E4M3_MAX = 448.0
E2M1_MAX = 6.0


def _modelopt_nvfp4(w: torch.Tensor, weight_scale_2: torch.Tensor):
    """ModelOpt's NVFP4 export of one weight: packed uint8, e4m3 block scales."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    q, scale, _ = NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=weight_scale_2)
    return q._quantized_data, scale


def make_nvfp4_weights(
    num_experts: int = 4,
    hidden: int = 256,
    intermediate: int = 128,
    *,
    fmt: str = F.NVFP4_W4A4,
    seed: int = 0,
) -> ExpertWeights:
    """A layer's NVFP4 expert weights, quantized by nvidia-modelopt (``NVFP4QTensor``).

    Per expert one ``weight_scale_2`` for the fused gate/up weight (ModelOpt's per-tensor
    ``amax / (6 * 448)``), as moe-runtime's ``ExpertWeights`` holds them; W4A4 gets the layer's
    ``input_scale`` from a calibration batch's amax.
    """
    g = torch.Generator().manual_seed(seed)
    w13s, w13_sf, w13_s2, w2s, w2_sf, w2_s2 = [], [], [], [], [], []
    for _ in range(num_experts):
        gate_up = torch.randn(2 * intermediate, hidden, generator=g) / hidden**0.5
        down = torch.randn(hidden, intermediate, generator=g) / intermediate**0.5
        for w, packed, scales, scales_2 in ((gate_up, w13s, w13_sf, w13_s2),
                                            (down, w2s, w2_sf, w2_s2)):
            s2 = (w.abs().amax() / (E2M1_MAX * E4M3_MAX)).to(torch.float32)
            q, sf = _modelopt_nvfp4(w.to(torch.bfloat16), s2)
            packed.append(q)
            scales.append(sf)
            scales_2.append(s2)
    x = torch.randn(64, hidden, generator=g)
    kw = {}
    if fmt == F.NVFP4_W4A4:
        kw = dict(
            a13_scale=(x.abs().amax() / (E2M1_MAX * E4M3_MAX)).to(torch.float32),
            a2_scale=torch.tensor(0.37 / (E2M1_MAX * E4M3_MAX), dtype=torch.float32),
        )
    return ExpertWeights(
        format=fmt,
        activation=F.SILU,
        w13=torch.stack(w13s),
        w2=torch.stack(w2s),
        w13_scale=torch.stack(w13_sf),
        w2_scale=torch.stack(w2_sf),
        w13_scale_2=torch.stack(w13_s2),
        w2_scale_2=torch.stack(w2_s2),
        **kw,
    )


def make_setup(
    weights_or_experts, *, fmt: str = F.NVFP4_W4A4, layout: str = F.TOKEN_MAJOR,
    payload: str = F.UNQUANTIZED, ep_rank: int = 0, ep_size: int = 1, hidden: int = 256,
    intermediate: int = 128, top_k: int = 2, device: str = "cpu", activation: str = F.SILU,
) -> ExpertsSetup:
    n = (weights_or_experts if isinstance(weights_or_experts, int)
         else weights_or_experts.num_experts)
    problem = LayerProblem(
        name="model.layers.0.mlp.experts", format=fmt, activation=activation, num_experts=n,
        top_k=top_k, hidden_size=hidden, intermediate_size=intermediate,
    )
    return ExpertsSetup(problem=problem, runs_as=fmt, payload=payload, layout=layout,
                        ep_rank=ep_rank, ep_size=ep_size, device=device)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, scale_2) -> torch.Tensor:
    """A plain NVFP4 decode (low nibble = even column), float32, for semantic checks."""
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    values = table[codes.long()]
    blocks = values.reshape(*values.shape[:-1], -1, 16)
    sf = scale.view(torch.float8_e4m3fn).float() if scale.dtype == torch.uint8 else scale.float()
    out = blocks * sf.unsqueeze(-1)
    return out.reshape(values.shape) * torch.as_tensor(scale_2, dtype=torch.float32)


def blackwell_kernels_here() -> tuple[bool, str]:
    """Whether the kernels can run on this machine, and if not, why (the GPU tests' skip reason)."""
    from moe_runtime_flashinfer_cutedsl.plugin import supported_capabilities

    want = ", ".join(f"{a}.{b}" for a, b in supported_capabilities())
    if not torch.cuda.is_available():
        return False, f"needs a CUDA device of compute capability {want}; this machine has no CUDA"
    cap = tuple(torch.cuda.get_device_capability())
    if cap not in supported_capabilities():
        return False, (f"needs compute capability {want} (FP4 tensor cores); this device "
                       f"({torch.cuda.get_device_name()}) is {cap[0]}.{cap[1]}")
    missing = [m for m in ("flashinfer", "cutlass") if importlib.util.find_spec(m) is None]
    if missing:
        return False, f"needs the [kernels] extra; {', '.join(missing)} not importable"
    return True, ""
