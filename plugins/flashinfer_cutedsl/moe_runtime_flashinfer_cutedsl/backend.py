"""``CuteDslExperts``: FlashInfer's CuTe-DSL NVFP4 MoE kernels behind moe-runtime's experts API.

Two paths, by the plan's layout: token-major through ``flashinfer.CuteDslMoEWrapper`` (W4A4 or
W4A16), masked through ``grouped_gemm_nt_masked`` with FlashInfer's NVFP4 quantizers around it
(unweighted outputs). FlashInfer is imported inside methods, never at import. Not yet run on a
compute-capability 10.x device: README.md, "Running" and "What has run".
"""

from __future__ import annotations

import torch

from moe_runtime import formats as F
from moe_runtime.backend_api import Dispatched, ExpertsBackend, ExpertsSetup, ExpertWeights
from moe_runtime.declarations import format_capability
from moe_runtime.dtypes import model_dtype_name
from moe_runtime_flashinfer_cutedsl import plugin
from moe_runtime_flashinfer_cutedsl.weights import (
    GATE_UP,
    UP_GATE_INTERLEAVED,
    PreparedExperts,
    mma_scale_view,
    prepare_experts,
    swizzle_block_scales,
)

_FP4 = "float4_e2m1fn"
_E4M3 = "float8_e4m3fn"
_C_DTYPES = (torch.bfloat16, torch.float16)  # the kernels' output dtypes


class UnsupportedDeviceError(RuntimeError):
    """The device is not one the declaration names: the kernels must not run there."""


def check_capability(capability: tuple[int, int] | None, device: str = "cuda") -> None:
    """Raise unless ``capability`` is one the declaration names (10.0, 10.3, 10.7).

    The hard guard the declaration alone cannot give: FlashInfer's FP4 quantizers build and run on
    compute capability 9.0 and return garbage without raising, so nothing here may run there even
    when a user pins this backend past the planner.
    """
    allowed = plugin.supported_capabilities()
    if capability is not None and tuple(capability) in allowed:
        return
    have = f"compute capability {format_capability(capability)}" if capability else "no CUDA"
    raise UnsupportedDeviceError(
        f"flashinfer_cutedsl needs a CUDA device of compute capability "
        f"{', '.join(format_capability(c) for c in allowed)} (10.x: FP4 tensor cores); {device} "
        f"has {have}. Below 10.0 FlashInfer's FP4 quantizers return garbage without raising, so "
        "this backend refuses to run; plan without --moe-runner-backend flashinfer_cutedsl."
    )


def _check_setup(setup: ExpertsSetup) -> None:
    """The declaration, checked again at construction (pinning and hand-built setups bypass the
    planner), through the same matching rule the planner uses (``Support.check``)."""
    plugin.SPEC.require_setup(setup)


def global_routes(ids: torch.Tensor, weights: torch.Tensor, first: int, elsewhere: int | None):
    """Token-major routes for the wrapper's ``moe_sort``: int32 *global* expert ids and float32
    weights.

    moe-runtime hands local ids with ``-1`` for experts on other ranks; ``moe_sort`` wants global
    ids and skips those outside ``[first, first + num_local)``, but indexes per-expert counters by
    id, so ``-1`` must not reach it: it becomes ``elsewhere``, a global id off this rank. With every
    expert local (``elsewhere is None``) a stray ``-1`` runs expert 0 with weight 0.
    """
    ids = ids.to(torch.int32)
    weights = weights.to(torch.float32)
    here = ids >= 0
    if elsewhere is not None:
        ids = torch.where(here, ids + first, elsewhere)
    else:
        ids = torch.where(here, ids, 0)
        weights = torch.where(here, weights, 0.0)
    return ids.contiguous(), weights.contiguous()


def id_off_rank(first: int, count: int, total: int) -> int | None:
    """A global expert id outside ``[first, first + count)``, or ``None`` when all are local."""
    end = first + count
    if end < total:
        return end
    return first - 1 if first > 0 else None


def activation_scales_mma(scale: torch.Tensor | None) -> torch.Tensor:
    """Block scales of NVFP4 activations delivered by the dispatch, as the masked GEMM's 6-d view.

    Accepted: that view itself (what ``scaled_fp4_grouped_quantize`` returns, logical
    ``(32, 4, M/128, 4, K/4, E)``), its ``[E, M/128, K/4, 32, 4, 4]`` storage, or linear
    ``[E, M, H/16]`` scales (swizzled here).
    """
    if scale is None:
        raise ValueError("an nvfp4 payload needs hidden_scale (the e4m3 block scales)")
    if scale.dim() == 6 and tuple(scale.shape[3:]) == (32, 4, 4):  # storage (its dim 3 is 32)
        return mma_scale_view(scale.view(torch.uint8))
    if scale.dim() == 6 and tuple(scale.shape[:2]) == (32, 4) and scale.shape[3] == 4:  # view
        return scale
    if scale.dim() == 3:
        return mma_scale_view(swizzle_block_scales(scale))
    raise ValueError(f"nvfp4 hidden_scale of shape {tuple(scale.shape)} is not a known layout")


class CuteDslExperts(ExpertsBackend):
    """Experts backend over FlashInfer's CuTe-DSL NVFP4 kernels (compute capability 10.x only)."""

    def __init__(self, *, setup: ExpertsSetup) -> None:
        super().__init__(setup=setup)
        _check_setup(setup)
        self.device = torch.device(setup.device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            check_capability(None, str(self.device))
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        check_capability(tuple(torch.cuda.get_device_capability(self.device)), str(self.device))
        self._require_kernels()
        self.prepared: PreparedExperts | None = None
        self._wrapper = None
        p = setup.problem
        self._first = setup.first_local_expert
        self._n_local = setup.num_local_experts
        self._elsewhere = id_off_rank(self._first, self._n_local, p.num_experts)

    # ----------------------------------------------------------------------------------- load

    @staticmethod
    def _require_kernels() -> None:
        import importlib.util

        def importable(name: str) -> bool:
            try:  # a dotted name imports its parent: `cutlass.cute` imports `cutlass`
                return importlib.util.find_spec(name) is not None
            except ImportError:
                return False

        # `cutlass.cute` tells the CuTe DSL from the unrelated `nvidia-cutlass` (also `cutlass`).
        missing = [m for m in ("flashinfer", "cutlass", "cutlass.cute") if not importable(m)]
        if missing:
            raise ImportError(
                f"flashinfer_cutedsl needs {', '.join(missing)} importable; install "
                "moe-runtime-flashinfer-cutedsl[kernels] (flashinfer-python, nvidia-cutlass-dsl)"
            )

    def prepare(self, weights: ExpertWeights) -> None:
        """Build the kernels' weight layout once (see :mod:`.weights`) and the wrapper."""
        prepared = prepare_experts(weights, self.setup).to(self.device)
        self.prepared = prepared
        if self.setup.layout == F.TOKEN_MAJOR:
            assert prepared.gate_up_order == UP_GATE_INTERLEAVED
            from flashinfer import CuteDslMoEWrapper

            p = self.setup.problem
            self._wrapper = CuteDslMoEWrapper(
                num_experts=p.num_experts,
                top_k=p.top_k,
                hidden_size=p.hidden_size,
                intermediate_size=p.intermediate_size,
                num_local_experts=self._n_local,
                local_expert_offset=self._first,
                # GEMM 2 writes bfloat16 (W4A16 accepts nothing else); the result is cast back.
                output_dtype=torch.bfloat16,
                device=str(self.device),
                quant_mode="w4a4" if prepared.runs_as == F.NVFP4_W4A4 else "w4a16",
                # activation_type left at its default, ActivationType.Swiglu with alpha 1, beta 0
                # and no clamp: silu(gate) * up.
            )
        else:
            assert prepared.gate_up_order == GATE_UP
            n = prepared.num_experts
            # The grouped quantizers index their global scale by expert.
            self._a13_gscale_e = prepared.a13_gscale.expand(n).contiguous()
            self._a2_gscale_e = prepared.a2_gscale.expand(n).contiguous()

    # -------------------------------------------------------------------------------- forward

    def forward(self, dispatched: Dispatched) -> torch.Tensor:
        if self.prepared is None:
            raise RuntimeError("flashinfer_cutedsl: prepare() must run before forward()")
        if dispatched.hidden.device != self.device:
            raise UnsupportedDeviceError(
                f"flashinfer_cutedsl was prepared on {self.device}; got activations on "
                f"{dispatched.hidden.device}"
            )
        if dispatched.layout == F.TOKEN_MAJOR:
            return self._token_major(dispatched)
        if dispatched.layout == F.MASKED:
            return self._masked(dispatched)
        raise ValueError(f"flashinfer_cutedsl has no layout {dispatched.layout!r}")

    def _token_major(self, d: Dispatched) -> torch.Tensor:
        from flashinfer import fp4_quantize

        pr = self.prepared
        x = d.hidden
        out_dtype = d.out_dtype or x.dtype
        if x.shape[0] == 0:
            return x.new_zeros((0, pr.hidden_size), dtype=out_dtype)
        ids, weights = global_routes(d.topk_ids, d.topk_weights, self._first, self._elsewhere)
        if pr.runs_as == F.NVFP4_W4A4:
            x16 = x if x.dtype in _C_DTYPES else x.to(torch.bfloat16)
            x_q, x_sf = fp4_quantize(x16.contiguous(), global_scale=pr.a13_gscale,
                                     sf_vec_size=16, is_sf_swizzled_layout=False)
            x_sf = x_sf.unsqueeze(-1)  # [N, H/16, 1]: the gather GEMM's linear per-token scales
            fc2_gscale = pr.a2_gscale
        else:
            x_q, x_sf, fc2_gscale = x.to(torch.bfloat16).contiguous(), None, None
        out = self._wrapper.run(
            x=x_q,
            x_sf=x_sf,
            token_selected_experts=ids,
            token_final_scales=weights,
            w1_weight=pr.w13,
            w1_weight_sf=pr.w13_scale_mma,
            w1_alpha=pr.w13_alpha,
            fc2_input_scale=fc2_gscale,
            w2_weight=pr.w2,
            w2_weight_sf=pr.w2_scale_mma,
            w2_alpha=pr.w2_alpha,
        )
        return out.to(out_dtype)

    def _masked(self, d: Dispatched) -> torch.Tensor:
        from flashinfer import (
            scaled_fp4_grouped_quantize,
            silu_and_mul_scaled_nvfp4_experts_quantize,
        )
        from flashinfer.gemm import grouped_gemm_nt_masked

        pr = self.prepared
        masked_m = d.masked_m.to(torch.int32).contiguous()
        e, m = d.hidden.shape[0], d.hidden.shape[1]
        if e != pr.num_experts:
            raise ValueError(f"masked layout has {e} experts; this rank holds {pr.num_experts}")
        if d.payload == F.NVFP4:
            act_dtype = d.out_dtype if d.out_dtype in _C_DTYPES else torch.bfloat16
            # the kernels read raw pointers: physical [E, M, H/2] -> logical (M, H/2, E)
            a_q = d.hidden.contiguous().permute(1, 2, 0)
            a_sf = activation_scales_mma(d.hidden_scale)
        else:
            x = d.hidden if d.hidden.dtype in _C_DTYPES else d.hidden.to(torch.bfloat16)
            act_dtype = x.dtype
            a_q, a_sf = scaled_fp4_grouped_quantize(x.contiguous(), masked_m, self._a13_gscale_e)
        out_dtype = d.out_dtype or act_dtype
        c_dtype = model_dtype_name(act_dtype)
        common = dict(ab_dtype=_FP4, sf_dtype=_E4M3, c_dtype=c_dtype, sf_vec_size=16,
                      alpha_dtype="float32")

        # GEMM 1: [gate | up] per row, written as logical (M, 2I, E) over physical [E, M, 2I].
        gate_up = torch.empty((e, m, 2 * pr.intermediate_size), dtype=act_dtype,
                              device=self.device).permute(1, 2, 0)
        grouped_gemm_nt_masked((a_q, a_sf), (pr.w13.permute(1, 2, 0), pr.w13_scale_mma),
                               gate_up, masked_m, alpha=pr.w13_alpha, **common)
        # silu(gate) * up, quantized to NVFP4 with GEMM 2's global scale.
        inter_q, inter_sf = silu_and_mul_scaled_nvfp4_experts_quantize(
            gate_up.permute(2, 0, 1), masked_m, self._a2_gscale_e)
        # GEMM 2.
        out = torch.empty((e, m, pr.hidden_size), dtype=act_dtype,
                          device=self.device).permute(1, 2, 0)
        grouped_gemm_nt_masked((inter_q, inter_sf), (pr.w2.permute(1, 2, 0), pr.w2_scale_mma),
                               out, masked_m, alpha=pr.w2_alpha, **common)
        return out.permute(2, 0, 1).to(out_dtype)
