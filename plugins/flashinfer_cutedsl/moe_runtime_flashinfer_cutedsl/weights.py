"""Weight preparation for FlashInfer's CuTe-DSL NVFP4 MoE, done once at load, in plain torch.

From :class:`moe_runtime.backend_api.ExpertWeights` in the checkpoint's NVFP4 layout to a
:class:`PreparedExperts` holding exactly the tensors the kernels take, in steps each tested alone:
:func:`local_experts`, :func:`up_gate_interleaved` (token-major only), :func:`swizzle_block_scales`
(and its view :func:`mma_scale_view`), :func:`gemm_alphas`, :func:`activation_global_scale`. The
target layouts and where they were read: README.md, "Weight preparation". Nothing here imports
FlashInfer.
"""

from __future__ import annotations

import attrs
import torch

from moe_runtime import formats as F
from moe_runtime.backend_api import ExpertsSetup, ExpertWeights

#: Rows per half-chunk of the gate/up interleave of ``CuteDslMoEWrapper``'s GEMM 1 weight.
GATE_UP_CHUNK = 64
#: NVFP4 elements per e4m3 block scale.
SF_VEC_SIZE = 16
#: The 128x4 scale layout: 128 rows (4 groups of 32) by 4 scale columns per tile.
SF_ROW_TILE = 128
SF_COL_TILE = 4

#: GEMM 1 row orders a :class:`PreparedExperts` can hold.
UP_GATE_INTERLEAVED = "up_gate_interleaved_64"  # CuteDslMoEWrapper (token-major)
GATE_UP = "gate_up"  # grouped_gemm_nt_masked + silu_and_mul_scaled_nvfp4_experts_quantize (masked)

_NVFP4 = (F.NVFP4_W4A4, F.NVFP4_W4A16)


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# ------------------------------------------------------------------------------- the steps


def local_experts(weights: ExpertWeights, setup: ExpertsSetup) -> ExpertWeights:
    """This rank's experts: ``weights`` as given when it holds them already, else the slice
    ``[first_local_expert, first_local_expert + num_local_experts)`` of the layer's experts."""
    n_local = setup.num_local_experts
    if weights.num_experts == n_local:
        return weights
    n_all = setup.problem.num_experts
    if weights.num_experts != n_all:
        raise ValueError(
            f"layer {setup.problem.name}: got weights of {weights.num_experts} experts; expected "
            f"the layer's {n_all} experts or this rank's {n_local} (rank {setup.ep_rank} of "
            f"{setup.ep_size})"
        )
    first = setup.first_local_expert
    sl = slice(first, first + n_local)
    per_expert = ("w13", "w2", "w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2")
    return attrs.evolve(
        weights,
        **{name: getattr(weights, name)[sl] for name in per_expert
           if getattr(weights, name) is not None},
    )


def up_gate_interleaved(w13: torch.Tensor, chunk: int = GATE_UP_CHUNK) -> torch.Tensor:
    """``[E, 2I, X]`` rows ``[gate; up]`` -> ``[up 0:c, gate 0:c, up c:2c, gate c:2c, ...]``.

    Works on any per-row tensor (packed weights and their block scales alike); ``I`` must be a
    multiple of ``chunk``.
    """
    e, two_i = w13.shape[0], w13.shape[1]
    i = two_i // 2
    if two_i % 2 or i % chunk:
        raise ValueError(
            f"the gate/up interleave needs an intermediate size that is a multiple of {chunk}; "
            f"got {two_i} GEMM 1 rows"
        )
    rest = w13.shape[2:]
    gate, up = w13[:, :i], w13[:, i:]
    pairs = torch.stack((up.reshape(e, i // chunk, chunk, *rest),
                         gate.reshape(e, i // chunk, chunk, *rest)), dim=2)
    return pairs.reshape(e, two_i, *rest).contiguous()


def swizzle_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales ``[E, M, K]`` (e4m3 or its uint8 bytes) -> uint8 ``[E, M/128, K/4, 32, 4, 4]``.

    ``M`` is padded to a multiple of 128 and ``K`` to a multiple of 4 with zero bytes; element
    ``(e, m, k)`` lands at ``[e, m // 128, k // 4, m % 32, (m % 128) // 32, k % 4]``: the 128x4
    layout of FlashInfer's ``fp4_quantize(..., is_sf_swizzled_layout=True)``, per expert.
    """
    if scale.dim() != 3:
        raise ValueError(f"block scales must be [experts, rows, K/16], got {tuple(scale.shape)}")
    raw = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    e, m, k = raw.shape
    mp, kp = _ceil_to(m, SF_ROW_TILE), _ceil_to(k, SF_COL_TILE)
    padded = raw.new_zeros((e, mp, kp))
    padded[:, :m, :k] = raw
    tiles = padded.reshape(e, mp // SF_ROW_TILE, 4, 32, kp // SF_COL_TILE, SF_COL_TILE)
    return tiles.permute(0, 1, 4, 3, 2, 5).contiguous()


def mma_scale_view(swizzled: torch.Tensor) -> torch.Tensor:
    """The 6-d MMA view ``(32, 4, M/128, 4, K/4, E)`` of :func:`swizzle_block_scales`' storage.

    A strided view, not a copy: the kernels read the storage through its data pointer, as
    FlashInfer's ``convert_sf_to_mma_layout`` hands it over.
    """
    if swizzled.dim() != 6 or tuple(swizzled.shape[3:]) != (32, 4, 4):
        raise ValueError(f"expected [E, M/128, K/4, 32, 4, 4] storage, got {tuple(swizzled.shape)}")
    return swizzled.permute(3, 4, 1, 5, 2, 0)


def gemm_alphas(weight_scale_2: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    """float32 ``[E]``: ``input_scale * weight_scale_2``, or ``weight_scale_2`` without one."""
    ws2 = weight_scale_2.to(torch.float32).reshape(-1)
    if input_scale is None:
        return ws2.contiguous()
    return (input_scale.to(torch.float32).reshape(()) * ws2).contiguous()


def activation_global_scale(input_scale: torch.Tensor) -> torch.Tensor:
    """float32 ``[1]``: ``1 / input_scale``, the global scale of FlashInfer's NVFP4 quantizers."""
    return (1.0 / input_scale.to(torch.float32).reshape(1)).contiguous()


# --------------------------------------------------------------------------- the prepared record


@attrs.frozen
class PreparedExperts:
    """What the kernels take, for this rank's experts.

    :param gate_up_order: :data:`UP_GATE_INTERLEAVED` (token-major wrapper) or :data:`GATE_UP`
        (masked path).
    :param w13: uint8 ``[E, 2I, H/2]`` in ``gate_up_order``.
    :param w13_scale: uint8 ``[E, 2I/128, H/64, 32, 4, 4]``, the swizzled block scales of ``w13``.
    :param w2: uint8 ``[E, H, I/2]``; ``w2_scale`` uint8 ``[E, H/128, I/64, 32, 4, 4]``.
    :param w13_alpha: float32 ``[E]``; ``w2_alpha`` likewise.
    :param a13_gscale: float32 ``[1]``, ``1 / input_scale`` of GEMM 1, ``None`` for W4A16;
        ``a2_gscale`` likewise for GEMM 2.
    """

    runs_as: str
    gate_up_order: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w13_alpha: torch.Tensor
    w2_alpha: torch.Tensor
    a13_gscale: torch.Tensor | None = None
    a2_gscale: torch.Tensor | None = None

    @property
    def w13_scale_mma(self) -> torch.Tensor:
        return mma_scale_view(self.w13_scale)

    @property
    def w2_scale_mma(self) -> torch.Tensor:
        return mma_scale_view(self.w2_scale)

    def to(self, device: torch.device | str) -> PreparedExperts:
        return attrs.evolve(self, **{
            f.name: getattr(self, f.name).to(device)
            for f in attrs.fields(PreparedExperts)
            if isinstance(getattr(self, f.name), torch.Tensor)
        })


def check_weights(weights: ExpertWeights, setup: ExpertsSetup) -> None:
    """Refuse weights this preparation cannot turn into the kernels' inputs, saying why."""
    p = setup.problem
    if weights.format not in _NVFP4:
        raise ValueError(
            f"layer {p.name}: flashinfer_cutedsl prepares NVFP4 expert weights, got "
            f"{weights.format}"
        )
    if setup.runs_as not in _NVFP4:
        raise ValueError(f"layer {p.name}: flashinfer_cutedsl cannot run format {setup.runs_as}")
    needed = ["w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2"]
    if setup.runs_as == F.NVFP4_W4A4:
        needed += ["a13_scale", "a2_scale"]
    missing = [n for n in needed if getattr(weights, n) is None]
    if missing:
        raise ValueError(
            f"layer {p.name}: {setup.runs_as} needs {', '.join(missing)} in the expert weights"
        )
    if weights.w13.dtype != torch.uint8 or weights.w2.dtype != torch.uint8:
        raise ValueError(f"layer {p.name}: NVFP4 weights are packed uint8, got {weights.w13.dtype}")
    e, two_i, h_half = weights.w13.shape
    if (weights.w2.shape[0] != e or weights.w2.shape[1] != 2 * h_half
            or weights.w2.shape[2] * 4 != two_i):
        raise ValueError(
            f"layer {p.name}: w13 {tuple(weights.w13.shape)} and w2 {tuple(weights.w2.shape)} do "
            "not describe one MoE layer ([E, 2I, H/2] and [E, H, I/2])"
        )
    for name, w in (("w13_scale", weights.w13), ("w2_scale", weights.w2)):
        s = getattr(weights, name)
        want = (w.shape[0], w.shape[1], w.shape[2] * 2 // SF_VEC_SIZE)
        if tuple(s.shape) != want:
            raise ValueError(f"layer {p.name}: {name} has shape {tuple(s.shape)}, expected {want}")
    if 2 * h_half != p.hidden_size or two_i // 2 != p.intermediate_size:
        raise ValueError(
            f"layer {p.name}: weights have hidden {2 * h_half}, intermediate {two_i // 2}; the "
            f"plan was made for hidden {p.hidden_size}, intermediate {p.intermediate_size}"
        )


def prepare_experts(weights: ExpertWeights, setup: ExpertsSetup) -> PreparedExperts:
    """Every step above, in order, for the layout ``setup`` asks for."""
    check_weights(weights, setup)
    w = local_experts(weights, setup)
    if setup.layout == F.TOKEN_MAJOR:
        order = UP_GATE_INTERLEAVED
        w13 = up_gate_interleaved(w.w13)
        w13_sf = up_gate_interleaved(w.w13_scale.view(torch.uint8))
    elif setup.layout == F.MASKED:
        order = GATE_UP
        w13, w13_sf = w.w13.contiguous(), w.w13_scale
    else:
        raise ValueError(f"flashinfer_cutedsl has no layout {setup.layout!r}")
    quantized_acts = setup.runs_as == F.NVFP4_W4A4
    return PreparedExperts(
        runs_as=setup.runs_as,
        gate_up_order=order,
        num_experts=w.num_experts,
        hidden_size=w.hidden_size,
        intermediate_size=w.intermediate_size,
        w13=w13,
        w13_scale=swizzle_block_scales(w13_sf),
        w2=w.w2.contiguous(),
        w2_scale=swizzle_block_scales(w.w2_scale),
        w13_alpha=gemm_alphas(w.w13_scale_2, w.a13_scale if quantized_acts else None),
        w2_alpha=gemm_alphas(w.w2_scale_2, w.a2_scale if quantized_acts else None),
        a13_gscale=activation_global_scale(w.a13_scale) if quantized_acts else None,
        a2_gscale=activation_global_scale(w.a2_scale) if quantized_acts else None,
    )
