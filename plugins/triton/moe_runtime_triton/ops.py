"""Host side of the Triton fused-MoE path: weight preparation, tile configs, launches.

Everything launched by :func:`fused_moe_prepared` is sized from shapes only (``N``, ``topk``, ``E``,
``H``, ``I`` and the config), never from data: no host synchronisation, so a decode step can be
captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import functools
import json
import math
import os
import weakref
from pathlib import Path
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

from moe_runtime import formats as F
from moe_runtime.backend_api import ExpertWeights
from moe_runtime.dtypes import torch_dtype
from moe_runtime_triton import kernels as K
from moe_runtime_triton.plugin import TORCH_GROUPED_GEMMS, TRITON_EXPERTS

_FMT_CODE = {F.BF16: K.WFMT_16BIT, F.FP16: K.WFMT_16BIT, F.FP8_W8A8: K.WFMT_FP8,
             F.NVFP4_W4A16: K.WFMT_NVFP4, F.NVFP4_W4A4: K.WFMT_NVFP4}
# (stored format, run_as) pairs this module executes: read off the declaration, never restated
_RUNS = frozenset((f, s.runs(f)) for s in TRITON_EXPERTS.supports for f in s.formats)
_ACT = {F.SILU: K.ACT_SILU, F.GELU: K.ACT_GELU}
_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

TINY_ROUTE_MAX_PAIRS = 64
DECODE_MAX_PAIRS = 16  # the heuristic's bound for the two-kernel decode path
PACK_SLICE_BYTES = 64 << 20  # NVFP4 weight rewrite at load, per slice
SMALL_ROUTE_MAX_PAIRS = 4096
# large-P counts: sort each program's pairs and take one atomic per (program, expert), from
# ROUTE_SORTED_MIN_PAIRS pairs on: on the H200 one atomic per pair was faster up to 40,960 pairs
# (13.0 vs 15.7 us at 32,768) and the sorted count faster at 163,840 (26.9 vs 35.3 us),
# benchmarks/bench_routing.py, RESULTS.md "Routing kernels timed apart"
ROUTE_SORTED_COUNT = os.environ.get("MOE_TRITON_ROUTE_SORTED", "1") != "0"
ROUTE_SORTED_MIN_PAIRS = 65536
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
EXACT_FP8 = INTERPRET
# inline PTX for the NVFP4 decode on GPUs; the interpreter runs the portable form
USE_ASM = not INTERPRET
CONFIG_FILE = Path(__file__).with_name("configs.json")
# torch grouped GEMM path (plugin.TORCH_GROUPED_GEMMS): "0" never, "1" on every token-major call
# where it can run (e.g. for the conformance suite at small shapes), unset: where the config says.
# Read once, here (grouped_mm_mode); GROUPED_MM_MODE is set below, after the function.
GROUPED_MM_ENV = "MOE_TRITON_GROUPED_MM"
GROUPED_MM_MODES = ("", "0", "1")


@attrs.frozen
class PreparedWeights:
    """Kernel-ready view of one layer's local experts (built once at load)."""

    run_as: str
    wfmt: int
    activation: str
    w13: torch.Tensor  # nvfp4: uint8 codes laid out by pack_nvfp4_for_kernels
    w2: torch.Tensor
    w13_scale: torch.Tensor | None  # fp8: float32 [E, 2I]; nvfp4: uint8 (e4m3 bytes) [E, 2I, H/16]
    w2_scale: torch.Tensor | None
    w13_scale_2: torch.Tensor | None  # nvfp4: float32 [E]
    w2_scale_2: torch.Tensor | None
    a13_scale: torch.Tensor | None  # fp8: float32 [1]
    a2_scale: torch.Tensor | None
    num_experts: int
    hidden_size: int
    intermediate_size: int
    # why the torch grouped GEMM path cannot run these weights where they are (None: it can)
    grouped_mm_unavailable: str | None = None
    # the TMA path's views (tma.TmaWeights) by fused_gu, built once, at prepare (prepare_tma_views)
    # or at the first eager call that asks for them, never inside a CUDA graph capture; and under
    # "why", tma_unavailable's answer
    tma_views: dict = attrs.field(factory=dict, eq=False, repr=False)
    # the W4A16 tile path's repacked weights (w4a16.W4A16Weights) by layout (w4a16_layout_key),
    # built once, at prepare (prepare_w4a16_views) or at the first eager call that asks for them,
    # never inside a CUDA graph capture; and under "why", w4a16_unavailable's answer. Each is a
    # second copy of the layer's 4-bit codes and block scales: made only on opt-in
    w4a16_views: dict = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def weight_dtype_name(self) -> str:
        return self.run_as


def prepare_weights(w: ExpertWeights, run_as: str | None = None) -> PreparedWeights:
    """Check formats and shapes and lay the tensors out for the kernels (contiguous, scale views)."""
    run_as = run_as or w.format
    if (w.format, run_as) not in _RUNS:
        raise ValueError(
            f"the Triton experts path does not run {w.format!r} weights as {run_as!r}; "
            f"it runs {sorted(_RUNS)}"
        )
    if w.activation not in _ACT:
        raise ValueError(f"activation {w.activation!r} is not one of {sorted(_ACT)}")
    wfmt = _FMT_CODE[w.format]
    E, H, I = w.num_experts, w.hidden_size, w.intermediate_size

    def f32(t, shape=None):
        if t is None:
            return None
        t = t.to(torch.float32).contiguous()
        return t.reshape(shape) if shape is not None else t

    w13s = w2s = w13s2 = w2s2 = a13 = a2 = None
    if wfmt == K.WFMT_16BIT:
        want = torch.bfloat16 if w.format == F.BF16 else torch.float16
        if w.w13.dtype not in (want, torch.float32):
            raise ValueError(f"{w.format} weights must be {want}, got {w.w13.dtype}")
    elif wfmt == K.WFMT_FP8:
        if w.w13.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8_w8a8 weights must be float8_e4m3fn, got {w.w13.dtype}")
        for name in ("w13_scale", "w2_scale", "a13_scale", "a2_scale"):
            if getattr(w, name) is None:
                raise ValueError(f"fp8_w8a8 weights need {name}")
        w13s = f32(w.w13_scale).expand(E, 2 * I).contiguous() if w.w13_scale.numel() != E * 2 * I \
            else f32(w.w13_scale, (E, 2 * I))
        w2s = f32(w.w2_scale).expand(E, H).contiguous() if w.w2_scale.numel() != E * H \
            else f32(w.w2_scale, (E, H))
        a13 = f32(w.a13_scale, (1,))
        a2 = f32(w.a2_scale, (1,))
    else:
        if w.w13.dtype != torch.uint8:
            raise ValueError(f"{w.format} weights must be packed uint8, got {w.w13.dtype}")
        for name in ("w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2"):
            if getattr(w, name) is None:
                raise ValueError(f"{w.format} weights need {name}")
        if H % 16 or I % 16:
            raise ValueError(f"nvfp4 needs hidden and intermediate sizes divisible by 16, got {H}, {I}")
        w13s = w.w13_scale.contiguous().view(torch.uint8)
        w2s = w.w2_scale.contiguous().view(torch.uint8)
        w13s2 = f32(w.w13_scale_2).reshape(-1).expand(E).contiguous()
        w2s2 = f32(w.w2_scale_2).reshape(-1).expand(E).contiguous()
    w13, w2 = w.w13.contiguous(), w.w2.contiguous()
    if wfmt == K.WFMT_NVFP4:
        w13, w2 = pack_nvfp4_for_kernels(w13), pack_nvfp4_for_kernels(w2)
    pw = PreparedWeights(
        run_as=run_as, wfmt=wfmt, activation=w.activation,
        w13=w13, w2=w2,
        w13_scale=w13s, w2_scale=w2s, w13_scale_2=w13s2, w2_scale_2=w2s2,
        a13_scale=a13, a2_scale=a2, num_experts=E, hidden_size=H, intermediate_size=I,
    )
    return attrs.evolve(pw, grouped_mm_unavailable=torch_grouped_unavailable(pw, w13.device))


def pack_nvfp4_for_kernels(packed: torch.Tensor) -> torch.Tensor:
    """Rewrite checkpoint-packed E2M1 codes (byte ``j`` holds columns ``2j`` (low nibble) and
    ``2j + 1``) into the kernels' layout: each group of 8 columns becomes one 32-bit word
    (little-endian bytes, same size) whose bit fields (``kernels.NVFP4_GROUP_FIELDS``) let the
    in-loop decode build float16 pairs of adjacent columns with 11 integer operations per 8
    codes. Block scales (16 columns) are unaffected."""
    if packed.shape[-1] % 4:
        raise ValueError(f"packed NVFP4 rows must hold a multiple of 8 columns, got {tuple(packed.shape)}")
    out = torch.empty_like(packed, dtype=torch.uint8)
    flat_in = packed.reshape(-1, packed.shape[-1])
    flat_out = out.view(-1, packed.shape[-1])
    # in slices of rows: the int32 temporaries are 4x the bytes (a DeepSeek-V3 layer is 3.8 GB)
    step = max(1, PACK_SLICE_BYTES // max(1, packed.shape[-1]))
    for r0 in range(0, flat_in.shape[0], step):
        p = flat_in[r0:r0 + step].to(torch.int32)
        codes = torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(p.shape[0], -1, 8)
        word = torch.zeros(codes.shape[:-1], dtype=torch.int32, device=packed.device)
        for col, (eem_bit, sign_bit) in enumerate(K.NVFP4_GROUP_FIELDS):
            c = codes[..., col]
            word |= ((c & 7) << eem_bit) | ((c >> 3) << sign_bit)
        flat_out[r0:r0 + step] = torch.stack([(word >> (8 * b)) & 0xFF for b in range(4)],
                                             dim=-1).reshape(p.shape).to(torch.uint8)
    return out


# ----------------------------------------------------------------------------------------------
# Tile configurations
# ----------------------------------------------------------------------------------------------


def _gemm_cfg(bn, bk, group_m, warps, stages):
    return {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "num_warps": warps,
            "num_stages": stages}


def heuristic_config(fmt_code: int, E: int, H: int, I: int, topk: int, n_tokens: int,
                     allow_decode: bool = True) -> dict:
    """A config from the shape and token count, for shapes the tuned table lacks."""
    pairs = max(1, n_tokens * topk)
    rows_per_expert = pairs / max(1, min(E, pairs))
    on_gpu = torch.cuda.is_available()
    stages = 4 if on_gpu else 1
    if pairs <= DECODE_MAX_PAIRS and allow_decode:
        return decode_config(fmt_code, H, I, stages)
    if rows_per_expert <= 16:
        bm = 16
        g1 = _gemm_cfg(32, 128, 1, 4, stages)
        g2 = _gemm_cfg(64, 128, 1, 4, stages)
    elif rows_per_expert <= 48:
        bm = 32
        g1 = _gemm_cfg(64, 64, 4, 4, stages)
        g2 = _gemm_cfg(64, 64, 4, 4, stages)
    elif rows_per_expert <= 160:
        bm = 64
        g1 = _gemm_cfg(64, 64, 8, 4, min(stages, 4))
        g2 = _gemm_cfg(128, 64, 8, 4, min(stages, 4))
    else:
        bm = 128
        g1 = _gemm_cfg(64, 64, 8, 8, min(stages, 3))
        g2 = _gemm_cfg(128, 64, 8, 8, min(stages, 3))
    if fmt_code == K.WFMT_FP8:
        # fp8 tiles: K twice as deep for the same bytes
        g1["BLOCK_K"] = g2["BLOCK_K"] = 128
    if fmt_code == K.WFMT_NVFP4:
        g1["BLOCK_K"] = max(g1["BLOCK_K"], 64)
        g2["BLOCK_K"] = max(g2["BLOCK_K"], 64)
    return {"BLOCK_M": bm, "g1": g1, "g2": g2, "a_prequant": pairs > 1024}


def decode_config(fmt_code: int, H: int, I: int, stages: int = 4) -> dict:
    """Tiles of the two-kernel decode path: narrow row blocks (enough programs to keep the memory
    system busy with a few pairs), deep K (each program streams long rows)."""
    d1 = {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": stages}
    # GEMM 2's tile holds the rows of all of a token's experts
    d2 = {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4, "num_stages": stages}
    return {"decode": True, "d1": d1, "d2": d2}


@functools.lru_cache(maxsize=1)
def _tuned_table() -> dict:
    path = Path(os.environ.get("MOE_TRITON_CONFIGS", CONFIG_FILE))
    if not path.exists():
        return {}
    with open(path) as fh:
        return json.load(fh)


def table_key(run_as: str, E: int, H: int, I: int, topk: int) -> str:
    return f"{run_as},E={E},H={H},I={I},topk={topk}"


@functools.lru_cache(maxsize=1)
def _table_applies() -> bool:
    """The table was tuned on one device family; other GPUs (other shared-memory sizes) use the
    heuristic."""
    meta = _tuned_table().get("_meta", {})
    want = meta.get("capability")
    if not want or not torch.cuda.is_available():
        return True
    return list(torch.cuda.get_device_capability()) == list(want)


def get_config(run_as: str, E: int, H: int, I: int, topk: int, n_tokens: int) -> dict:
    """The tuned config nearest in log(token count) for this shape, else the heuristic."""
    entry = _tuned_table().get(table_key(run_as, E, H, I, topk)) if _table_applies() else None
    if entry:
        best = min(entry, key=lambda k: abs(math.log2(int(k)) - math.log2(max(1, n_tokens))))
        return entry[best]
    return heuristic_config(_FMT_CODE[run_as], E, H, I, topk, n_tokens)


# ----------------------------------------------------------------------------------------------
# Launches
# ----------------------------------------------------------------------------------------------


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def max_sorted_rows(pairs: int, E: int, block_m: int) -> int:
    """Upper bound of padded rows: every expert adds at most one partial block."""
    return (triton.cdiv(pairs, block_m) + min(E, pairs)) * block_m


def route(topk_ids: torch.Tensor, E: int, block_m: int):
    """``(sorted_ids [R] int32, block_expert [R / block_m] int32, R)`` for ``topk_ids``.

    ``sorted_ids[row]`` is the pair (``token * topk + k``) of a row, ``P`` on padding rows; rows
    of expert ``e`` are contiguous and padded to ``block_m``; ``block_expert[b]`` is the expert of
    row block ``b`` or -1 past the used blocks."""
    P = topk_ids.numel()
    R = max_sorted_rows(P, E, block_m)
    sorted_ids = torch.empty(R, dtype=torch.int32, device=topk_ids.device)
    bexp = torch.empty(R // block_m, dtype=torch.int32, device=topk_ids.device)
    route_into(topk_ids, E, block_m, sorted_ids, bexp)
    return sorted_ids, bexp, R


def route_into(topk_ids: torch.Tensor, E: int, block_m: int, sorted_ids: torch.Tensor,
               bexp: torch.Tensor) -> None:
    """Launch the routing kernels into preallocated ``sorted_ids`` and ``bexp``."""
    ids = topk_ids.reshape(-1)
    P = ids.numel()
    dev = ids.device
    R = sorted_ids.numel()
    e_p2 = _p2(E)
    if P <= TINY_ROUTE_MAX_PAIRS:
        K.route_tiny_kernel[(1,)](
            ids, sorted_ids, bexp, P, E, R,
            BLOCK_M=block_m, P_P2=max(16, _p2(P)), E_P2=max(16, e_p2), FILL=256, num_warps=4,
        )
    elif P <= SMALL_ROUTE_MAX_PAIRS:
        scratch = torch.empty(E, dtype=torch.int32, device=dev)
        p_p2 = max(16, _p2(P))
        K.route_small_kernel[(1,)](
            ids, sorted_ids, bexp, scratch, P, E, R,
            BLOCK_M=block_m, P_P2=p_p2, E_P2=max(16, e_p2), FILL=1024,
            num_warps=4 if p_p2 <= 1024 else 8,
        )
    else:
        counts = torch.zeros(E, dtype=torch.int32, device=dev)
        rank = torch.empty(P, dtype=torch.int32, device=dev)
        starts = torch.empty(E, dtype=torch.int32, device=dev)
        block = 1024
        grid = triton.cdiv(P, block)
        fill_per = triton.cdiv(triton.cdiv(R, grid), block) * block
        if ROUTE_SORTED_COUNT and P >= ROUTE_SORTED_MIN_PAIRS:
            K.route_count_sorted_kernel[(grid,)](ids, counts, rank, sorted_ids, P, E, R, fill_per,
                                                 BLOCK=block, E_P2=max(16, e_p2), num_warps=4)
        else:
            K.route_count_kernel[(grid,)](ids, counts, rank, sorted_ids, P, E, R, fill_per,
                                          BLOCK=block, num_warps=4)
        K.route_offsets_kernel[(1,)](counts, bexp, starts, E, R // block_m, BLOCK_M=block_m,
                                     E_P2=max(16, e_p2), num_warps=4)
        K.route_scatter_kernel[(grid,)](ids, rank, starts, sorted_ids, P, E, BLOCK=block,
                                        num_warps=4)


def _asm_decode(pw: "PreparedWeights", K_dim: int, rows: int, cfg: dict) -> bool:
    """Whether a GEMM over ``K_dim`` with ``rows`` weight rows per tile may take the inline-assembly
    NVFP4 decode (``kernels._e2m1_pairs_asm``). It reads four consecutive bytes of a row per
    instance, which Triton's layout gives only when each thread holds at least four bytes along
    K of a 16-byte aligned row: whole K tiles (``EVEN_K``), rows of a multiple of 32 columns (16
    bytes, Triton's divisibility unit) and at least 4 bytes per thread of the tile. Otherwise the
    portable decode runs (same values; seen on the H200: K = 16, K = 48 with partial tiles, and
    16 x 32 tiles over 4 warps decoded wrong through the assembly)."""
    if not (USE_ASM and pw.wfmt == K.WFMT_NVFP4):
        return False
    bk = cfg["BLOCK_K"]
    tile_bytes = rows * bk // 2
    return K_dim % bk == 0 and K_dim % 32 == 0 and tile_bytes >= 4 * 32 * cfg["num_warps"]


def _launch_opts(cfg: dict) -> dict:
    opts = {"num_warps": cfg["num_warps"]}
    if torch.cuda.is_available():
        opts["num_stages"] = cfg["num_stages"]
    return opts


def nvfp4_compute_dtype(activations: torch.dtype) -> torch.dtype:
    """The MMA dtype of NVFP4 weights (decoded exactly into either, kernels._scale_codes) with
    activations of ``activations``: bfloat16 for bfloat16 activations, whose range the operands
    and the intermediate between the GEMMs then keep (float16's largest value, 65504, is inside
    what a bf16 model's gated intermediate reaches: the conformance suite's large_activations
    case); else float16, as the interpreter always takes (it runs no inline assembly, and the
    bfloat16 decode's scale multiply is one). float32 activations are rounded to float16."""
    if activations == torch.bfloat16 and not INTERPRET:
        return torch.bfloat16
    return torch.float16


def _activations(hidden, hidden_scale, pw: PreparedWeights, out_dtype):
    """Check the activations against the weights' format: ``(hidden in the compute dtype where it
    is 16-bit, the MMA's compute dtype, the output dtype)``."""
    prequant_in = hidden.dtype == torch.float8_e4m3fn
    if prequant_in and (pw.wfmt != K.WFMT_FP8 or hidden_scale is None):
        raise ValueError("fp8 activations are accepted only for fp8_w8a8 with their hidden_scale")
    if out_dtype is None:
        out_dtype = torch.bfloat16 if prequant_in else hidden.dtype
    if pw.wfmt == K.WFMT_16BIT:
        compute = pw.w13.dtype
        if hidden.dtype != compute:
            hidden = hidden.to(compute)
    elif pw.wfmt == K.WFMT_NVFP4:
        compute = nvfp4_compute_dtype(hidden.dtype)
    else:
        compute = torch.float8_e4m3fn
    return hidden, compute, out_dtype


def masked_config(pw: PreparedWeights, max_tokens: int) -> dict:
    """The sorted-path config of a masked batch of ``max_tokens`` rows per expert."""
    return heuristic_config(pw.wfmt, pw.num_experts, pw.hidden_size, pw.intermediate_size, 1,
                            pw.num_experts * max_tokens, allow_decode=False)


def fused_moe_prepared(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    pw: PreparedWeights,
    *,
    hidden_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
    _stages: list | None = None,
) -> torch.Tensor:
    """``[N, H]``: per token, the routing-weighted sum of its valid experts' gated MLP outputs.

    ``hidden`` is 16-bit (or float32), or float8_e4m3fn with ``hidden_scale`` (fp8_w8a8 only).
    ``_stages`` (profiling): a list that receives ``(name, relaunch, compiled_kernel)`` for every
    stage, so each can be timed alone.
    """

    def go(name, fn):
        ret = fn()
        if _stages is not None:
            _stages.append((name, fn, ret))
    N, H = hidden.shape
    E, I = pw.num_experts, pw.intermediate_size
    if H != pw.hidden_size:
        raise ValueError(f"hidden size {H} does not match the weights' {pw.hidden_size}")
    topk = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    cfg = config or get_config(pw.run_as, E, H, I, topk, N)
    if N and not (wants_torch_grouped(cfg) and pw.grouped_mm_unavailable is None):
        tma_cfg = tma_config(pw, cfg, N, topk)
        if tma_cfg is not None:
            from moe_runtime_triton import tma

            return tma.fused_moe_tma(hidden, topk_ids, topk_weights,
                                     tma_weights(pw, bool(tma_cfg.get("fused_gu", True))),
                                     hidden_scale=hidden_scale, out_dtype=out_dtype,
                                     config=tma_cfg, _stages=_stages)
        w4_cfg = w4a16_config(pw, cfg, N, topk)
        if w4_cfg is not None and hidden_scale is None:
            from moe_runtime_triton import w4a16

            ww = w4a16_weights(pw, w4a16_layout(pw, w4_cfg))
            return w4a16.fused_moe_w4a16(hidden, topk_ids, topk_weights, ww, out_dtype=out_dtype,
                                         config=w4a16_call_config(ww, w4_cfg, N, topk),
                                         _stages=_stages)
    hidden, compute, out_dtype = _activations(hidden, hidden_scale, pw, out_dtype)
    out = torch.empty((N, H), dtype=out_dtype, device=hidden.device)
    if N == 0:
        return out
    if not hidden.is_contiguous():
        hidden = hidden.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()

    if wants_torch_grouped(cfg) and pw.grouped_mm_unavailable is None:
        _torch_grouped_path(hidden, hidden_scale, topk_ids, topk_weights, pw, out, go)
        return out
    if cfg.get("decode"):
        _decode_path(hidden, topk_ids, topk_weights, pw, cfg, out, go, hidden_scale)
        return out
    bm = cfg["BLOCK_M"]
    P = N * topk
    R = max_sorted_rows(P, E, bm)
    sorted_ids = torch.empty(R, dtype=torch.int32, device=hidden.device)
    bexp = torch.empty(R // bm, dtype=torch.int32, device=hidden.device)
    go("route", lambda: route_into(topk_ids, E, bm, sorted_ids, bexp))
    y = torch.empty((P, H), dtype=out_dtype, device=hidden.device)
    _sorted_gemms(hidden, hidden_scale, compute, sorted_ids, bexp, P, topk, topk_weights, y, pw,
                  cfg, go)

    bh = min(1024, max(16, _p2(H)))
    go("finalize", lambda: K.moe_finalize_kernel[(N, triton.cdiv(H, bh))](
        y, topk_ids, out, H, E, y.stride(0), out.stride(0), TOPK=topk, BLOCK_H=bh,
        num_warps=4,
    ))
    return out


def fused_moe_masked(
    hidden: torch.Tensor,
    masked_m: torch.Tensor,
    pw: PreparedWeights,
    *,
    hidden_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Masked layout: ``out[e, j] = expert_e(hidden[e, j])`` for ``j < masked_m[e]``, unweighted
    (rows past an expert's count are left unwritten: the layout ignores them).

    ``hidden [E, M, H]`` is 16-bit (or float32), or float8_e4m3fn with ``hidden_scale`` (fp8_w8a8
    only); ``masked_m [E]`` int. No host synchronisation: CUDA-graph capturable. ``config`` is a
    sorted-path config (``BLOCK_M``, ``g1``, ``g2``); by default the heuristic's for ``M`` rows per
    expert."""
    if hidden.dim() != 3:
        raise ValueError(f"masked hidden must be [experts, max_tokens, hidden], got {tuple(hidden.shape)}")
    E, M, H = hidden.shape
    if E != pw.num_experts or H != pw.hidden_size:
        raise ValueError(f"masked hidden {tuple(hidden.shape)} does not match the weights' "
                         f"{pw.num_experts} experts of hidden size {pw.hidden_size}")
    if masked_m.numel() != E:
        raise ValueError(f"masked_m must hold one count per expert ({E}), got {masked_m.numel()}")
    hidden, compute, out_dtype = _activations(hidden, hidden_scale, pw, out_dtype)
    out = torch.empty((E, M, H), dtype=out_dtype, device=hidden.device)
    if E * M == 0:
        return out
    x = hidden.reshape(E * M, H)
    if not x.is_contiguous():
        x = x.contiguous()
    cfg = config or masked_config(pw, M)
    if cfg.get("decode"):
        raise ValueError("the masked layout runs the sorted path; pass a config with BLOCK_M, g1, g2")
    bm = cfg["BLOCK_M"]
    Mp = triton.cdiv(M, bm) * bm
    sorted_ids = torch.empty(E * Mp, dtype=torch.int32, device=hidden.device)
    bexp = torch.empty(E * Mp // bm, dtype=torch.int32, device=hidden.device)
    blk = 1024
    K.route_masked_kernel[(triton.cdiv(E * Mp, blk),)](
        masked_m.contiguous(), sorted_ids, bexp, M, Mp, E, BLOCK_M=bm, BLOCK=blk, num_warps=4)
    ones = torch.ones(E * M, dtype=torch.float32, device=hidden.device)
    _sorted_gemms(x, hidden_scale, compute, sorted_ids, bexp, E * M, 1, ones,
                  out.view(E * M, H), pw, cfg, lambda name, fn: fn())
    return out


def _sorted_gemms(hidden, hidden_scale, compute, sorted_ids, bexp, P: int, topk: int, topk_weights,
                  y, pw: PreparedWeights, cfg: dict, go) -> None:
    """GEMM 1 and GEMM 2 over rows in sorted order: ``y[pair] = topk_weights[pair] *
    expert(hidden[pair // topk])`` for the valid rows of ``sorted_ids`` (``P`` marks padding;
    row blocks whose ``bexp`` is -1 are skipped)."""
    H = hidden.shape[1]
    E, I = pw.num_experts, pw.intermediate_size
    bm = cfg["BLOCK_M"]
    R = sorted_ids.numel()
    num_m_blocks = R // bm
    ctype = _TL_DTYPE.get(compute, tl.bfloat16)
    prequant_in = hidden.dtype == torch.float8_e4m3fn

    # activations into GEMM 1
    a_scale = pw.a13_scale
    if pw.wfmt == K.WFMT_FP8:
        if prequant_in:
            x, a_quant, a_scale = hidden, 1, hidden_scale.reshape(1).to(torch.float32)
        elif cfg.get("a_prequant", False):
            x = torch.empty(hidden.shape, dtype=torch.float8_e4m3fn, device=hidden.device)
            blk = 4096
            go("quant_fp8", lambda: K.quant_fp8_kernel[(triton.cdiv(hidden.numel(), blk),)](
                hidden, x, a_scale, hidden.numel(), BLOCK=blk, EXACT=EXACT_FP8, num_warps=8))
            a_quant = 1
        else:
            x, a_quant = hidden, 2
        inter_dtype = torch.float8_e4m3fn
    else:
        x, a_quant = hidden, 0
        inter_dtype = compute
    inter = torch.empty((R, I), dtype=inter_dtype, device=hidden.device)
    dummy = sorted_ids  # placeholder pointer for absent tensors

    g1 = cfg["g1"]
    even_k1 = H % g1["BLOCK_K"] == 0
    grid1 = (num_m_blocks * triton.cdiv(I, g1["BLOCK_N"]),)
    go("gemm1", lambda: K.moe_gemm1_kernel[grid1](
        x, pw.w13, pw.w13_scale if pw.w13_scale is not None else dummy,
        pw.w13_scale_2 if pw.w13_scale_2 is not None else dummy,
        a_scale if a_scale is not None else dummy,
        pw.a2_scale if pw.a2_scale is not None else dummy,
        inter, sorted_ids, bexp,
        P, E, H, I, num_m_blocks, topk,
        x.stride(0), pw.w13.stride(0), pw.w13.stride(1),
        pw.w13_scale.stride(0) if pw.wfmt != K.WFMT_16BIT else 0,
        pw.w13_scale.stride(1) if pw.wfmt != K.WFMT_16BIT else 0,
        inter.stride(0),
        WFMT=pw.wfmt, A_QUANT=a_quant, OUT_FP8=pw.wfmt == K.WFMT_FP8,
        ACT=_ACT[pw.activation], EVEN_K=even_k1, EXACT=EXACT_FP8,
        BLOCK_M=bm, BLOCK_N=g1["BLOCK_N"], BLOCK_K=g1["BLOCK_K"], GROUP_M=g1["GROUP_M"],
        compute_dtype=ctype, USE_ASM=_asm_decode(pw, H, g1["BLOCK_N"], g1), **_launch_opts(g1),
    ))

    g2 = cfg["g2"]
    even_k2 = I % g2["BLOCK_K"] == 0
    grid2 = (num_m_blocks * triton.cdiv(H, g2["BLOCK_N"]),)
    go("gemm2", lambda: K.moe_gemm2_kernel[grid2](
        inter, pw.w2, pw.w2_scale if pw.w2_scale is not None else dummy,
        pw.w2_scale_2 if pw.w2_scale_2 is not None else dummy,
        pw.a2_scale if pw.a2_scale is not None else dummy,
        topk_weights, y, sorted_ids, bexp,
        P, E, H, I, num_m_blocks,
        inter.stride(0), pw.w2.stride(0), pw.w2.stride(1),
        pw.w2_scale.stride(0) if pw.wfmt != K.WFMT_16BIT else 0,
        pw.w2_scale.stride(1) if pw.wfmt != K.WFMT_16BIT else 0,
        y.stride(0),
        WFMT=pw.wfmt, EVEN_K=even_k2,
        BLOCK_M=bm, BLOCK_N=g2["BLOCK_N"], BLOCK_K=g2["BLOCK_K"], GROUP_M=g2["GROUP_M"],
        compute_dtype=ctype, USE_ASM=_asm_decode(pw, I, g2["BLOCK_N"], g2), **_launch_opts(g2),
    ))


def _decode_path(hidden, topk_ids, topk_weights, pw: PreparedWeights, cfg: dict, out, go,
                 hidden_scale=None) -> None:
    """Two launches for a few tokens (see ``kernels`` "Decode path"): GEMM 1 per pair, GEMM 2 per
    token with the combine; float32 intermediate."""
    N, H = hidden.shape
    E, I = pw.num_experts, pw.intermediate_size
    topk = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    P = N * topk
    d1, d2 = cfg["d1"], cfg["d2"]
    inter = torch.empty((P, I), dtype=torch.float32, device=hidden.device)
    ids = topk_ids.reshape(-1)
    dummy = ids
    scale_strides13 = (pw.w13_scale.stride(0), pw.w13_scale.stride(1)) if pw.wfmt != K.WFMT_16BIT else (0, 0)
    scale_strides2 = (pw.w2_scale.stride(0), pw.w2_scale.stride(1)) if pw.wfmt != K.WFMT_16BIT else (0, 0)
    x = hidden if pw.wfmt != K.WFMT_16BIT or hidden.dtype == pw.w13.dtype else hidden.to(pw.w13.dtype)
    a_scale, a_quant = pw.a13_scale, 0
    if pw.wfmt == K.WFMT_FP8:
        if hidden.dtype == torch.float8_e4m3fn:
            a_scale, a_quant = hidden_scale.reshape(1).to(torch.float32), 1
        else:
            a_quant = 2
    go("decode_gemm1", lambda: K.moe_decode_gemm1_kernel[(P, triton.cdiv(I, d1["BLOCK_N"]))](
        x, ids, pw.w13, pw.w13_scale if pw.w13_scale is not None else dummy,
        pw.w13_scale_2 if pw.w13_scale_2 is not None else dummy,
        a_scale if a_scale is not None else dummy,
        pw.a2_scale if pw.a2_scale is not None else dummy,
        inter, P, E, H, I, topk,
        x.stride(0), pw.w13.stride(0), pw.w13.stride(1), *scale_strides13, inter.stride(0),
        WFMT=pw.wfmt, A_QUANT=a_quant, ACT=_ACT[pw.activation], EVEN_K=H % d1["BLOCK_K"] == 0,
        EXACT=EXACT_FP8,
        BLOCK_N=d1["BLOCK_N"], BLOCK_K=d1["BLOCK_K"], USE_ASM=_asm_decode(pw, H, d1["BLOCK_N"], d1),
        **_launch_opts(d1),
    ))
    go("decode_gemm2", lambda: K.moe_decode_gemm2_kernel[(N, triton.cdiv(H, d2["BLOCK_N"]))](
        inter, ids, topk_weights, pw.w2, pw.w2_scale if pw.w2_scale is not None else dummy,
        pw.w2_scale_2 if pw.w2_scale_2 is not None else dummy,
        pw.a2_scale if pw.a2_scale is not None else dummy,
        out, E, H, I,
        inter.stride(0), pw.w2.stride(0), pw.w2.stride(1), *scale_strides2, out.stride(0),
        TOPK=topk, WFMT=pw.wfmt, EVEN_K=I % d2["BLOCK_K"] == 0,
        BLOCK_N=d2["BLOCK_N"], BLOCK_K=d2["BLOCK_K"],
        USE_ASM=_asm_decode(pw, I, triton.next_power_of_2(topk) * d2["BLOCK_N"], d2),
        **_launch_opts(d2),
    ))


# ----------------------------------------------------------------------------------------------
# Torch grouped GEMM path (plugin.TORCH_GROUPED_GEMMS)
# ----------------------------------------------------------------------------------------------


def grouped_mm_mode(value: str | None = None) -> str:
    """``MOE_TRITON_GROUPED_MM`` (or ``value``): ``"0"`` never, ``"1"`` wherever it can run, unset or
    empty: where the tile config (the tuned table's entry) has ``"grouped_mm": true``."""
    mode = (os.environ.get(GROUPED_MM_ENV, "") if value is None else value).strip()
    if mode not in GROUPED_MM_MODES:
        raise ValueError(f"{GROUPED_MM_ENV}={mode!r}: accepted values are '0' (never), '1' (every "
                         "call where torch's grouped GEMM can run) or unset (the tuned table)")
    return mode


GROUPED_MM_MODE = grouped_mm_mode()


def wants_torch_grouped(cfg: dict) -> bool:
    """Whether a call with this config asks for the torch grouped GEMM path."""
    return GROUPED_MM_MODE == "1" or (GROUPED_MM_MODE == "" and bool(cfg.get("grouped_mm")))


def torch_grouped_unavailable(pw: PreparedWeights, device) -> str | None:
    """Why the torch grouped GEMM path cannot run these weights on ``device`` (``None``: it can)."""
    device = torch.device(device)
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return _grouped_unavailable(pw.run_as, pw.hidden_size, pw.intermediate_size, pw.w13.dtype,
                                device.type, cap)


@functools.lru_cache(maxsize=64)
def _grouped_unavailable(run_as, H, I, dtype, device_type, cap) -> str | None:
    spec = TORCH_GROUPED_GEMMS.get(run_as)
    if spec is None:
        return (f"{run_as} has no torch grouped GEMM path (declared for "
                f"{sorted(TORCH_GROUPED_GEMMS)})")
    if not hasattr(torch, spec.op):
        return f"torch {torch.__version__} has no torch.{spec.op}"
    if H % spec.size_multiple or I % spec.size_multiple:
        return (f"torch.{spec.op} needs hidden and intermediate sizes divisible by "
                f"{spec.size_multiple}, got {H} and {I}")
    if device_type == "cpu":
        return None  # torch's CPU grouped GEMM (tests; fp8 through the portable form)
    if device_type != "cuda":
        return f"no torch grouped GEMM path on {device_type}"
    if not any(r.contains(cap) for r in spec.cuda_capabilities):
        return (f"torch.{spec.op} runs without a host synchronisation on compute capability "
                f"{', '.join(r.describe() for r in spec.cuda_capabilities)}; this GPU has "
                f"{cap[0]}.{cap[1]}")
    if dtype != torch_dtype(spec.compute):
        return f"torch.{spec.op} runs {spec.compute} operands here, the weights are {dtype}"
    return None


# ----------------------------------------------------------------------------------------------
# TMA / persistent path (moe_runtime_triton.tma)
# ----------------------------------------------------------------------------------------------

TMA_ENV = "MOE_TRITON_TMA"


def tma_mode(value: str | None = None) -> str:
    """``MOE_TRITON_TMA`` (or ``value``): ``"0"`` never, ``"1"`` on every token-major call where the
    path can run (the tuned entry's ``"tma"`` config, else :func:`tma.default_config`), unset or
    empty: where the tile config (the tuned table's entry) has a ``"tma"`` config."""
    mode = (os.environ.get(TMA_ENV, "") if value is None else value).strip()
    if mode not in GROUPED_MM_MODES:
        raise ValueError(f"{TMA_ENV}={mode!r}: accepted values are '0' (never), '1' (every "
                         "token-major call where the TMA path can run) or unset (the tuned table)")
    return mode


TMA_MODE = tma_mode()


def tma_unavailable(pw: PreparedWeights) -> str | None:
    """Why the TMA path cannot run ``pw`` (``None``: it can): weights decoded in the main loop,
    rows not a multiple of 16 bytes, or a device without TMA (compute capability below 9.0)."""
    if "why" in pw.tma_views:  # once per prepared weights: it is asked on every call
        return pw.tma_views["why"]
    from moe_runtime_triton import tma

    why = tma.tma_unavailable(pw)
    if why is None and pw.w13.device.type == "cuda":
        cap = torch.cuda.get_device_capability(pw.w13.device)
        if cap < (9, 0):
            why = (f"the TMA path needs compute capability 9.0 or newer (tensor memory "
                   f"accelerator); this GPU has {cap[0]}.{cap[1]}")
    pw.tma_views["why"] = why
    return why


def _path_asked(mode: str, cfg: dict, key: str, unavailable, pw: PreparedWeights) -> bool:
    """Whether an opt-in path runs a call: its variable (``mode``) is not ``0``, it is ``1`` or
    the tile config has the path's entry ``key``, and ``unavailable(pw)`` finds nothing that
    keeps it from these weights (checked last: it reads the weights)."""
    if mode == "0" or (mode == "" and not cfg.get(key)):
        return False
    return unavailable(pw) is None


def tma_config(pw: PreparedWeights, cfg: dict, n_tokens: int, topk: int) -> dict | None:
    """The TMA path's config for a call with tile config ``cfg``, or ``None`` where the sorted,
    decode or torch grouped path runs instead (:data:`TMA_MODE`, the entry's ``"tma"``, and
    whether the path can run these weights)."""
    if not _path_asked(TMA_MODE, cfg, "tma", tma_unavailable, pw):
        return None
    if cfg.get("tma"):
        return cfg["tma"]
    from moe_runtime_triton import tma

    return tma.default_config(pw, n_tokens, topk)


def tma_weights(pw: PreparedWeights, fused_gu: bool):
    """The TMA views of ``pw`` (``tma.TmaWeights``), built on first use and kept with ``pw``.
    ``fused_gu`` keeps an interleaved copy of ``w13`` (gate and up rows alternating): the memory of
    ``w13`` once more, for as long as the weights live. The views kept with ``pw`` reach it through
    a weak proxy (``pw`` -> views -> ``pw`` would be a cycle that reference counting never frees:
    deleted weights and their views' copies stayed allocated until the cyclic collector ran), so
    they are for use while ``pw`` is held (``tma.prepare_tma`` makes views that hold it)."""
    def build():
        from moe_runtime_triton import tma

        return tma.prepare_tma(weakref.proxy(pw), fused_gu=fused_gu)

    return _built_once(pw, pw.tma_views, fused_gu, build, "the TMA path's weight views",
                       "prepare_tma_views")


def _built_once(pw: PreparedWeights, views: dict, key, build, what: str, prepare: str):
    """``views[key]``, made by ``build()`` on first use (never inside a CUDA-graph capture: the
    error names ``what`` and the ``ops.<prepare>`` that makes it at the backend's prepare)."""
    made = views.get(key)
    if made is None:
        if pw.w13.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{what} are built outside CUDA graph capture: call ops.{prepare}(pw, ...) (the "
                "backend's prepare does) or run the call once eagerly before capturing it")
        made = views[key] = build()
    return made


def prepare_tma_views(pw: PreparedWeights, topk: int) -> list[bool]:
    """Build, at load, the TMA views that the calls on these weights will ask for: those of the
    tuned table's entries with a ``"tma"`` config for this shape, and with ``MOE_TRITON_TMA=1`` the
    default config's. Returns the ``fused_gu`` values built (none where the path cannot run)."""
    if TMA_MODE == "0" or tma_unavailable(pw) is not None:
        return []
    E, H, I = pw.num_experts, pw.hidden_size, pw.intermediate_size
    entry = _tuned_table().get(table_key(pw.run_as, E, H, I, topk)) if _table_applies() else None
    wanted = {bool(c["tma"].get("fused_gu", True)) for c in (entry or {}).values()
              if isinstance(c, dict) and c.get("tma")}
    if TMA_MODE == "1":
        wanted.add(True)  # tma.default_config's
    for gu in sorted(wanted):
        tma_weights(pw, gu)
    return sorted(wanted)


# ----------------------------------------------------------------------------------------------
# W4A16 tile-layout path (moe_runtime_triton.w4a16), NVFP4 weights
# ----------------------------------------------------------------------------------------------

W4A16_ENV = "MOE_TRITON_W4A16"
# keys of a tuned entry's "w4a16" config: "layout" (fixed at load, w4a16_layout) and the keys of
# w4a16.default_config's dict and its optional overrides (those benchmarks/bench_w4a16.py measures)
W4A16_CONFIG_KEYS = ("layout", "fused", "BLOCK_T", "num_warps", "num_stages", "mma_sync", "x_f16",
                     "pairs", "split_k", "fold")
W4A16_LAYOUT_FIELDS = ("gate_up_rows", "gate_up_cols", "down_rows", "down_cols", "interleave")


def w4a16_mode(value: str | None = None) -> str:
    """``MOE_TRITON_W4A16`` (or ``value``): ``"0"`` never, ``"1"`` on every token-major call where the
    path can run (the tuned entry's ``"w4a16"`` config, else :func:`w4a16.default_config` on
    :func:`w4a16.default_layout`), unset or empty: where the tile config (the tuned table's entry)
    has a ``"w4a16"`` config."""
    mode = (os.environ.get(W4A16_ENV, "") if value is None else value).strip()
    if mode not in GROUPED_MM_MODES:
        raise ValueError(f"{W4A16_ENV}={mode!r}: accepted values are '0' (never), '1' (every "
                         "token-major call where the W4A16 tile path can run) or unset (the tuned "
                         "table)")
    return mode


W4A16_MODE = w4a16_mode()


def w4a16_unavailable(pw: PreparedWeights) -> str | None:
    """Why the W4A16 tile path cannot run ``pw`` (``None``: it can): it reads NVFP4 weights only
    (the same decode and compute capabilities as the sorted path's NVFP4 kernels)."""
    if "why" in pw.w4a16_views:  # once per prepared weights: it is asked on every call
        return pw.w4a16_views["why"]
    why = None
    if pw.wfmt != K.WFMT_NVFP4:
        why = f"the W4A16 tile path reads NVFP4 weights; these run as {pw.run_as}"
    pw.w4a16_views["why"] = why
    return why


def _check_w4a16_config(w4_cfg) -> None:
    if not isinstance(w4_cfg, dict):
        raise ValueError(f"a tuned entry's \"w4a16\" must be a dict of {list(W4A16_CONFIG_KEYS)}, "
                         f"got {w4_cfg!r}")
    bad = sorted(set(w4_cfg) - set(W4A16_CONFIG_KEYS))
    if bad:
        raise ValueError(f"unknown key(s) {bad} in a \"w4a16\" config; accepted: "
                         f"{list(W4A16_CONFIG_KEYS)}")


def w4a16_layout(pw: PreparedWeights, w4_cfg: dict):
    """The ``w4a16.W4A16Layout`` of a ``"w4a16"`` config: its ``"layout"``, a list
    ``[gate_up_rows, gate_up_cols, down_rows, down_cols]`` (optionally ``interleave`` fifth, the
    tuples of ``benchmarks/bench_w4a16.py``'s ``LAYOUTS``) or a dict of those fields; absent or
    null: ``w4a16.default_layout`` of the shape. Checked (powers of two, fused-compatible)."""
    from moe_runtime_triton import w4a16

    _check_w4a16_config(w4_cfg)
    spec = w4_cfg.get("layout")
    if spec is None:
        lo = w4a16.default_layout(pw.hidden_size, pw.intermediate_size)
    elif isinstance(spec, dict):
        bad = sorted(set(spec) - set(W4A16_LAYOUT_FIELDS))
        if bad:
            raise ValueError(f"unknown W4A16 layout field(s) {bad}; accepted: "
                             f"{list(W4A16_LAYOUT_FIELDS)}")
        lo = w4a16.W4A16Layout(**spec)
    elif isinstance(spec, (list, tuple)) and 4 <= len(spec) <= 5:
        lo = w4a16.W4A16Layout(*spec)
    else:
        raise ValueError(f"a \"w4a16\" layout is [gate_up_rows, gate_up_cols, down_rows, "
                         f"down_cols(, interleave)] or a dict of {list(W4A16_LAYOUT_FIELDS)}, "
                         f"got {spec!r}")
    lo.check()
    if not lo.fused:
        raise ValueError(f"W4A16 layout {spec!r}: down_cols ({lo.down_cols}) must equal the "
                         f"intermediate columns of a GEMM 1 tile ({lo.inter_cols})")
    return lo


def w4a16_config(pw: PreparedWeights, cfg: dict, n_tokens: int, topk: int) -> dict | None:
    """The W4A16 tile path's ``"w4a16"`` config for a call with tile config ``cfg`` (the entry's,
    ``{}`` for the defaults under ``MOE_TRITON_W4A16=1``), or ``None`` where the sorted, decode,
    torch grouped or TMA path runs instead (:data:`W4A16_MODE`, the entry's ``"w4a16"``, and
    whether the path can run these weights)."""
    if not _path_asked(W4A16_MODE, cfg, "w4a16", w4a16_unavailable, pw):
        return None
    return cfg.get("w4a16") or {}


def w4a16_call_config(ww, w4_cfg: dict, n_tokens: int, topk: int) -> dict:
    """The ``w4a16.fused_moe_w4a16`` config of one call: ``w4a16.default_config`` for this token
    count with the ``"w4a16"`` config's keys over it (as ``benchmarks/bench_w4a16.py`` builds its
    variants). A config whose one-launch (``fused``) or pairs path cannot take this many tokens
    (an entry serves the token counts nearest to its own) runs the grouped path instead."""
    from moe_runtime_triton import w4a16

    _check_w4a16_config(w4_cfg)
    cfg = {**w4a16.default_config(ww, n_tokens, topk),
           **{k: v for k, v in w4_cfg.items() if k != "layout"}}
    P = n_tokens * topk
    if cfg.get("fused") and n_tokens > ww.acc.shape[0]:
        cfg["fused"] = False
    if cfg.get("pairs") and not cfg.get("fused"):
        split = w4a16.split_k(ww, P, cfg.get("split_k", 1))
        if (split > 1 and P > ww.ws.shape[0]) or (cfg.get("fold") and n_tokens > ww.acc.shape[0]):
            cfg["pairs"] = False
    return cfg


def w4a16_layout_key(lo) -> tuple:
    return attrs.astuple(lo)


def w4a16_weights(pw: PreparedWeights, lo):
    """The repacked weights of ``pw`` in layout ``lo`` (``w4a16.W4A16Weights``), built on first use
    and kept with ``pw``: a second copy of the layer's 4-bit codes and block scales, for as long as
    the weights live."""
    def build():
        from moe_runtime_triton import w4a16

        return w4a16.from_prepared(pw, lo)

    return _built_once(pw, pw.w4a16_views, w4a16_layout_key(lo), build,
                       "the W4A16 path's repacked weights", "prepare_w4a16_views")


def prepare_w4a16_views(pw: PreparedWeights, topk: int) -> list[tuple]:
    """Build, at load, the repacked weights that the calls on these weights will ask for: one per
    layout of the tuned table's entries with a ``"w4a16"`` config for this shape, and with
    ``MOE_TRITON_W4A16=1`` the default layout's. Returns the layout keys built (none where the
    path cannot run or nothing opts in: memory unchanged)."""
    if W4A16_MODE == "0" or w4a16_unavailable(pw) is not None:
        return []
    E, H, I = pw.num_experts, pw.hidden_size, pw.intermediate_size
    entry = _tuned_table().get(table_key(pw.run_as, E, H, I, topk)) if _table_applies() else None
    layouts = [w4a16_layout(pw, c["w4a16"]) for c in (entry or {}).values()
               if isinstance(c, dict) and c.get("w4a16")]
    if W4A16_MODE == "1":
        layouts.append(w4a16_layout(pw, {}))  # w4a16.default_config's, on the default layout
    built = []
    for lo in layouts:
        key = w4a16_layout_key(lo)
        if key not in built:
            w4a16_weights(pw, lo)
            built.append(key)
    return built


def _grouped_gemm(op: str, a, b, offs, scale_a=None, scale_b=None):
    """``a [M, K]`` rows grouped by ``offs`` (cumulative ends, int32) times ``b [G, K, N]``
    (a transposed view of the ``[G, N, K]`` weights). Rows past ``offs[-1]`` are left unwritten."""
    if op == "_grouped_mm":
        return torch._grouped_mm(a, b, offs=offs)
    if a.device.type != "cpu":
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)
    # CPU (tests): no kernel there; the same product from the exact fp8 values in float32
    prod = torch._grouped_mm(a.float(), b.float(), offs=offs)
    rows = torch.arange(a.shape[0], device=a.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, rows, right=True).clamp_(max=b.shape[0] - 1)
    return prod * scale_a[:, None] * scale_b[group]


def _torch_grouped_path(hidden, hidden_scale, topk_ids, topk_weights, pw: PreparedWeights, out,
                        go) -> None:
    """Both GEMMs through torch's grouped GEMM: pairs sorted by expert (stable, unpadded; pairs of
    other ranks last and unused), their rows gathered (and quantized for fp8), GEMM 1, the
    activation (fp8: quantized with ``a2_scale``), GEMM 2, then the weighted combine in float32 in
    a fixed order. No host synchronisation."""
    N, H = hidden.shape
    E, I = pw.num_experts, pw.intermediate_size
    spec = TORCH_GROUPED_GEMMS[pw.run_as]
    topk = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    P = N * topk
    dev = hidden.device
    fp8 = spec.op == "_scaled_grouped_mm"
    flat = topk_ids.reshape(-1)
    # newer torch reads a 1-D scale of exactly G elements as per-tensor: keep M != G
    M = P + 1 if fp8 and P == E else P
    st = {}

    def route():
        key = torch.where((flat >= 0) & (flat < E), flat, torch.full_like(flat, E))
        skey, order = torch.sort(key, stable=True)
        bounds = torch.arange(1, E + 1, device=dev, dtype=skey.dtype)
        st["offs"] = torch.searchsorted(skey, bounds, out_int32=True)
        st["order"] = order
        st["pos"] = torch.empty_like(order).scatter_(
            0, order, torch.arange(P, device=dev, dtype=order.dtype))
    go("route", route)
    offs, order, pos = st["offs"], st["order"], st["pos"]
    n_valid = offs[E - 1:]

    quant = fp8 and hidden.dtype != torch.float8_e4m3fn
    a_dtype = torch.float8_e4m3fn if fp8 else hidden.dtype
    a = torch.empty((M, H), dtype=a_dtype, device=dev)
    a_scale = (hidden_scale.reshape(1).to(torch.float32) if fp8 and not quant else pw.a13_scale)
    bh = min(1024, max(16, _p2(H)))
    rows = 4
    go("gather", lambda: K.gather_rows_kernel[(triton.cdiv(P, rows), triton.cdiv(H, bh))](
        hidden, order, n_valid, a, a_scale if quant else n_valid, P, H, hidden.stride(0),
        a.stride(0), TOPK=topk, QUANT=quant, EXACT=EXACT_FP8, ROWS=rows, BLOCK_H=bh,
        num_warps=4))
    sa1 = a_scale.expand(M).contiguous() if fp8 else None
    sa2 = pw.a2_scale.expand(M).contiguous() if fp8 else None
    go("gemm1", lambda: st.__setitem__("gu", _grouped_gemm(
        spec.op, a, pw.w13.transpose(1, 2), offs, sa1, pw.w13_scale)))
    gu = st["gu"]
    h = torch.empty((M, I), dtype=torch.float8_e4m3fn if fp8 else gu.dtype, device=dev)
    bi = min(1024, max(16, _p2(I)))
    go("act", lambda: K.act_mul_kernel[(triton.cdiv(P, rows), triton.cdiv(I, bi))](
        gu, h, n_valid, pw.a2_scale if fp8 else n_valid, P, I, gu.stride(0), h.stride(0),
        ACT=_ACT[pw.activation], OUT_FP8=fp8, EXACT=EXACT_FP8, ROWS=rows, BLOCK_I=bi,
        num_warps=4))
    go("gemm2", lambda: st.__setitem__("y", _grouped_gemm(
        spec.op, h, pw.w2.transpose(1, 2), offs, sa2, pw.w2_scale)))
    y = st["y"]
    go("combine", lambda: K.combine_sorted_kernel[(N, triton.cdiv(H, bh))](
        y, pos, topk_ids, topk_weights, out, H, E, y.stride(0), out.stride(0), TOPK=topk,
        BLOCK_H=bh, num_warps=4))


def fused_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w: ExpertWeights,
    *,
    run_as: str,
    config: dict | None = None,
) -> torch.Tensor:
    """One-shot form: prepares ``w`` for ``run_as`` and runs the fused MoE (``[N, H]``)."""
    return fused_moe_prepared(hidden, topk_ids, topk_weights, prepare_weights(w, run_as),
                              config=config)


def describe_config(cfg: dict[str, Any]) -> str:
    if cfg.get("decode"):
        d1, d2 = cfg["d1"], cfg["d2"]
        return (("grouped_mm, else " if cfg.get("grouped_mm") else "")
                + f"decode d1[N{d1['BLOCK_N']} K{d1['BLOCK_K']} w{d1['num_warps']} s{d1['num_stages']}] "
                f"d2[N{d2['BLOCK_N']} K{d2['BLOCK_K']} w{d2['num_warps']} s{d2['num_stages']}]"
                + (f" w4a16[{_w4a16_describe(cfg['w4a16'])}]" if cfg.get("w4a16") else ""))
    g1, g2 = cfg["g1"], cfg["g2"]
    return (f"M{cfg['BLOCK_M']} g1[N{g1['BLOCK_N']} K{g1['BLOCK_K']} G{g1['GROUP_M']} "
            f"w{g1['num_warps']} s{g1['num_stages']}] g2[N{g2['BLOCK_N']} K{g2['BLOCK_K']} "
            f"G{g2['GROUP_M']} w{g2['num_warps']} s{g2['num_stages']}]"
            + (" preq" if cfg.get("a_prequant") else "")
            + (" grouped_mm" if cfg.get("grouped_mm") else "")
            + (f" tma[{_tma_describe(cfg['tma'])}]" if cfg.get("tma") else "")
            + (f" w4a16[{_w4a16_describe(cfg['w4a16'])}]" if cfg.get("w4a16") else ""))


def _w4a16_describe(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def _tma_describe(cfg: dict) -> str:
    from moe_runtime_triton import tma

    return tma.describe(cfg)
