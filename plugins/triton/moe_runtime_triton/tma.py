"""Large-batch path of the Triton experts backend: TMA tiles and persistent grouped GEMMs (issue 14).

Same inputs and output as :func:`ops.fused_moe_prepared` for 16-bit and fp8_w8a8 weights, for
prefill sizes on Hopper: x gathered once into expert-sorted rows, TMA descriptors for both GEMMs,
persistent tile loops, gate and up in one wide tile. Not wired into the backend yet
(``benchmarks/bench_tma.py`` measures it first); the steps, the intended wiring and the TMA
alignment rule are in the plugin's README.md ("Module notes").
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_runtime_triton import kernels as K
from moe_runtime_triton import ops

# formats this path runs: the ones whose weights feed the MMA as they are (no decode in the loop)
TMA_WFMTS = (K.WFMT_16BIT, K.WFMT_FP8)


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


@attrs.frozen
class TmaWeights:
    """:class:`ops.PreparedWeights` plus the 2-D views (and, with ``fused_gu``, the interleaved
    gate/up copy) the TMA kernels read. Built once per layer by :func:`prepare_tma`."""

    pw: ops.PreparedWeights
    fused_gu: bool
    w13: torch.Tensor  # [E * 2I, H]: rows of experts back to back (interleaved gate/up if fused_gu)
    w13_scale: torch.Tensor | None  # fp8: float32 [E * 2I], in w13's row order
    w2: torch.Tensor  # [E * H, I]
    w2_scale: torch.Tensor | None  # fp8: float32 [E * H]


def tma_unavailable(pw: ops.PreparedWeights) -> str | None:
    """Why this path cannot run ``pw`` (``None``: it can)."""
    if pw.wfmt not in TMA_WFMTS:
        return (f"the TMA path runs weights that feed the tensor cores as stored (16-bit, fp8); "
                f"{pw.run_as} weights are decoded in the main loop")
    elt = pw.w13.element_size()
    H, I = pw.hidden_size, pw.intermediate_size
    if (H * elt) % 16 or (I * elt) % 16:
        return (f"TMA needs rows of a multiple of 16 bytes: hidden size {H} and intermediate "
                f"size {I} of {elt}-byte elements")
    if pw.w13.dtype == torch.float32 and not ops.INTERPRET:
        return "float32 weights have no tensor-core path here (16-bit or fp8 weights)"
    return None


def interleave_gate_up(t: torch.Tensor, E: int, I: int) -> torch.Tensor:
    """``[E, 2I, ...]`` (gate rows, then up rows) -> ``[E * 2I, ...]`` with gate row ``j`` at
    ``2j`` and up row ``j`` at ``2j + 1`` of each expert."""
    rest = t.shape[2:]
    return t.reshape(E, 2, I, *rest).transpose(1, 2).reshape(E * 2 * I, *rest).contiguous()


def prepare_tma(pw: ops.PreparedWeights, fused_gu: bool = True) -> TmaWeights:
    """The TMA views of ``pw``; ``fused_gu`` makes an interleaved copy of ``w13`` (in a serving
    process it would replace ``pw.w13``: same bytes)."""
    why = tma_unavailable(pw)
    if why:
        raise ValueError(why)
    E, H, I = pw.num_experts, pw.hidden_size, pw.intermediate_size
    w13 = pw.w13.reshape(E, 2 * I, H)
    s13 = pw.w13_scale.reshape(E, 2 * I) if pw.w13_scale is not None else None
    if fused_gu:
        w13 = interleave_gate_up(w13, E, I)
        s13 = interleave_gate_up(s13, E, I) if s13 is not None else None
    else:
        w13 = w13.reshape(E * 2 * I, H)
        s13 = s13.reshape(-1) if s13 is not None else None
    return TmaWeights(
        pw=pw, fused_gu=fused_gu, w13=w13, w13_scale=s13,
        w2=pw.w2.reshape(E * H, I),
        w2_scale=pw.w2_scale.reshape(-1) if pw.w2_scale is not None else None,
    )


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _used_blocks(bexp_ptr, num_m_blocks, SCAN: tl.constexpr):
    """Row blocks in use (``bexp >= 0``: a prefix of ``bexp``)."""
    used = 0
    for c in range(0, num_m_blocks, SCAN):
        b = c + tl.arange(0, SCAN)
        v = tl.load(bexp_ptr + b, mask=b < num_m_blocks, other=-1)
        used += tl.sum((v >= 0).to(tl.int32), axis=0)
    return used


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def tail_tiles_kernel(bexp_ptr, full_ptr, half_ptr, num_blocks, SCAN: tl.constexpr):
    """The tiles of the half-tail layout (``tail_half``): the routing pads each expert's rows
    to half blocks (``BLOCK_M / 2`` rows); a tile starts at every other half block of an expert
    (its first, third, ...). ``full[t]``: the first half block of each tile that covers two half
    blocks of its expert (``BLOCK_M`` rows), then -1; ``half[t]``: likewise for the tiles of one
    half block (an expert's last, without a partner: the GEMMs compute ``BLOCK_M / 2`` rows
    there, not ``BLOCK_M`` rows of which half are padding). Two lists, so that each GEMM runs
    two persistent loops of one tile height each (a branch between heights inside one loop
    keeps Triton from flattening it). One program, a scan over the half blocks in chunks of
    ``SCAN``."""
    start = tl.zeros((), dtype=tl.int32) - 1  # the current expert's first half block
    prev = tl.zeros((), dtype=tl.int32) - 2  # the expert of the half block before the chunk
    n_full = tl.zeros((), dtype=tl.int32)
    n_half = tl.zeros((), dtype=tl.int32)
    for c in range(0, num_blocks, SCAN):
        j = c + tl.arange(0, SCAN)
        inside = j < num_blocks
        e = tl.load(bexp_ptr + j, mask=inside, other=-1)
        before = tl.load(bexp_ptr + j - 1, mask=inside & (j > 0), other=-2)
        before = tl.where(j == c, prev, before)
        after = tl.load(bexp_ptr + j + 1, mask=j + 1 < num_blocks, other=-1)
        first = (e != before) & (e >= 0)
        s = tl.associative_scan(tl.where(first, j, -1), 0, _max_combine)
        s = tl.maximum(s, start)
        is_tile = (e >= 0) & ((j - s) % 2 == 0)
        is_full = is_tile & (after == e)
        is_half = is_tile & (after != e)
        pos = n_full + tl.cumsum(is_full.to(tl.int32), 0) - 1
        tl.store(full_ptr + pos, j, mask=is_full)
        pos = n_half + tl.cumsum(is_half.to(tl.int32), 0) - 1
        tl.store(half_ptr + pos, j, mask=is_half)
        n_full += tl.sum(is_full.to(tl.int32), axis=0)
        n_half += tl.sum(is_half.to(tl.int32), axis=0)
        start = tl.max(s, axis=0)
        prev = tl.max(tl.where(j == c + SCAN - 1, e, -2), axis=0)
    for c in range(0, num_blocks, SCAN):
        j = c + tl.arange(0, SCAN)
        inside = j < num_blocks
        tl.store(full_ptr + j, tl.full((SCAN,), -1, tl.int32), mask=(j >= n_full) & inside)
        tl.store(half_ptr + j, tl.full((SCAN,), -1, tl.int32), mask=(j >= n_half) & inside)


@triton.jit(do_not_specialize=["P", "topk"])
def tma_gather_kernel(x_ptr, sorted_ptr, bexp_ptr, out_ptr, scale_ptr, P, H, topk,
                      stride_xm, stride_om,
                      QUANT: tl.constexpr, EXACT: tl.constexpr, BLOCK_M: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[row] = x[sorted[row] // topk]`` for the rows of used blocks (zero on padding rows),
    quantized to fp8 with ``scale`` when ``QUANT``. ``ROWS`` divides ``BLOCK_M``."""
    r0 = tl.program_id(0) * ROWS
    e = tl.load(bexp_ptr + r0 // BLOCK_M)
    if e < 0:
        return
    rows = r0 + tl.arange(0, ROWS)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < P
    tok = tl.where(valid, pair // topk, 0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    v = tl.load(x_ptr + tok[:, None] * stride_xm + offs[None, :],
                mask=valid[:, None] & hmask[None, :], other=0.0)
    if QUANT:
        sc = tl.load(scale_ptr)
        v = K._quant_fp8(v, sc, 1.0 / sc, EXACT)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs[None, :],
             v.to(out_ptr.dtype.element_ty), mask=hmask[None, :])


@triton.jit
def _act(g, u, ACT: tl.constexpr):
    if ACT == 0:
        return g / (1.0 + tl.exp(-g)) * u
    else:
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476)) * u


@triton.jit
def _a_tile(a_desc, x_ptr, tok, row_valid, row0, k0, H, stride_xm, A_GATHER: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """GEMM 1's activation tile: a TMA box of the sorted rows, or (``A_GATHER``) the tokens' rows
    of ``x`` through pointers (zero on padding rows and past ``H``)."""
    if A_GATHER:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        return tl.load(x_ptr + tok[:, None] * stride_xm + offs_k[None, :],
                       mask=row_valid[:, None] & (offs_k < H)[None, :], other=0.0)
    else:
        return a_desc.load([row0, k0])


@triton.jit
def _full_tile(tiles_ptr, bexp_ptr, pid_m, TAIL: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(expert, first row)`` of full-height row tile ``pid_m``: a row block of ``bexp``, or
    with ``TAIL`` a two-half-block tile of ``tiles`` (:func:`tail_tiles_kernel`)."""
    if TAIL:
        blk = tl.load(tiles_ptr + pid_m)
        return tl.load(bexp_ptr + blk), blk * (BLOCK_M // 2)
    else:
        return tl.load(bexp_ptr + pid_m), pid_m * BLOCK_M


@triton.jit
def _gemm1_tile(a_desc, b_desc, inter_ptr, ws_ptr, a_scale_ptr, a2_scale_ptr, x_ptr, sorted_ptr,
                e, row0, pid_n, P, topk, H, I, stride_im, stride_xm,
                WFMT: tl.constexpr, ACT: tl.constexpr, OUT_FP8: tl.constexpr,
                EXACT: tl.constexpr, FUSED_GU: tl.constexpr, A_GATHER: tl.constexpr,
                BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One tile of GEMM 1: ``BM`` rows from ``row0`` (``a_desc``'s box height), expert ``e``."""
    OUT_N: tl.constexpr = BLOCK_N // 2 if FUSED_GU else BLOCK_N
    k_tiles = tl.cdiv(H, BLOCK_K)
    cols = pid_n * OUT_N + tl.arange(0, OUT_N)
    tok = tl.zeros((BM,), dtype=tl.int64)
    row_valid = tl.zeros((BM,), dtype=tl.int1)
    if A_GATHER:
        pair = tl.load(sorted_ptr + row0 + tl.arange(0, BM))
        row_valid = pair < P
        tok = tl.where(row_valid, pair // topk, 0).to(tl.int64)
    if FUSED_GU:
        brow = e * (2 * I) + pid_n * BLOCK_N
        acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            a = _a_tile(a_desc, x_ptr, tok, row_valid, row0, kk * BLOCK_K, H, stride_xm,
                        A_GATHER, BLOCK_K)
            b = b_desc.load([brow, kk * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        if WFMT == 1:
            wc = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            s = tl.load(ws_ptr + e * (2 * I) + wc, mask=wc < 2 * I, other=0.0)
            acc = acc * (s * tl.load(a_scale_ptr))[None, :]
        g, u = tl.split(tl.reshape(acc, (BM, OUT_N, 2)))
    else:
        brow = e * (2 * I) + pid_n * BLOCK_N
        g = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
        u = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
        for kk in range(k_tiles):
            a = _a_tile(a_desc, x_ptr, tok, row_valid, row0, kk * BLOCK_K, H, stride_xm,
                        A_GATHER, BLOCK_K)
            bg = b_desc.load([brow, kk * BLOCK_K])
            bu = b_desc.load([brow + I, kk * BLOCK_K])
            g = tl.dot(a, bg.T, g)
            u = tl.dot(a, bu.T, u)
        if WFMT == 1:
            a_scale = tl.load(a_scale_ptr)
            sg = tl.load(ws_ptr + e * (2 * I) + cols, mask=cols < I, other=0.0)
            su = tl.load(ws_ptr + e * (2 * I) + I + cols, mask=cols < I, other=0.0)
            g = g * (sg * a_scale)[None, :]
            u = u * (su * a_scale)[None, :]
    h = _act(g, u, ACT)
    rows = row0 + tl.arange(0, BM)
    i_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_im + cols[None, :]
    if OUT_FP8:
        a2 = tl.load(a2_scale_ptr)
        tl.store(i_ptrs, K._quant_fp8(h, a2, 1.0 / a2, EXACT), mask=(cols < I)[None, :])
    else:
        tl.store(i_ptrs, h.to(inter_ptr.dtype.element_ty), mask=(cols < I)[None, :])


@triton.jit(do_not_specialize=["num_m_blocks", "num_progs", "group_m", "P", "topk"])
def tma_gemm1_kernel(
    a_desc, a_half_desc, b_desc, inter_ptr, ws_ptr, a_scale_ptr, a2_scale_ptr, bexp_ptr,
    tiles_ptr, halves_ptr, x_ptr, sorted_ptr,
    num_m_blocks, num_progs, group_m, P, topk, H, I, stride_im, stride_xm,
    WFMT: tl.constexpr, ACT: tl.constexpr, OUT_FP8: tl.constexpr, EXACT: tl.constexpr,
    FUSED_GU: tl.constexpr, A_GATHER: tl.constexpr, TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """``inter[row, n] = act(xs[row] @ w13[e, n]) * (xs[row] @ w13[e, I + n])`` over the used
    row tiles. ``FUSED_GU``: ``b_desc`` holds interleaved rows, a tile is ``BLOCK_N / 2`` output
    columns; otherwise a tile is ``BLOCK_N`` output columns from two B tiles and two dots.
    ``A_GATHER``: the activation rows are read from ``x`` (``[N, H]``, through ``sorted``) instead
    of the gathered ``a_desc``. ``TAIL``: row tiles from ``tiles`` and ``halves`` over
    ``num_m_blocks`` half blocks (:func:`tail_tiles_kernel`), half tiles through
    ``a_half_desc``; otherwise ``num_m_blocks`` blocks of ``BLOCK_M`` rows."""
    pid = tl.program_id(0)
    OUT_N: tl.constexpr = BLOCK_N // 2 if FUSED_GU else BLOCK_N
    num_n = tl.cdiv(I, OUT_N)
    # full-height tiles: row blocks (``bexp``), or with TAIL the two-half-block tiles
    used = _used_blocks(tiles_ptr if TAIL else bexp_ptr, num_m_blocks, 1024)
    for tile in tl.range(pid, used * num_n, num_progs, flatten=FLATTEN):
        pid_m, pid_n = K._tile_coords(tile, used, num_n, group_m)
        e, row0 = _full_tile(tiles_ptr, bexp_ptr, pid_m, TAIL, BLOCK_M)
        _gemm1_tile(a_desc, b_desc, inter_ptr, ws_ptr, a_scale_ptr, a2_scale_ptr, x_ptr,
                    sorted_ptr, e, row0, pid_n, P, topk, H, I, stride_im, stride_xm, WFMT, ACT,
                    OUT_FP8, EXACT, FUSED_GU, A_GATHER, BLOCK_M, BLOCK_N, BLOCK_K)
    if TAIL:  # then the half tiles, BLOCK_M / 2 rows through a_half_desc
        used_h = _used_blocks(halves_ptr, num_m_blocks, 1024)
        for tile in tl.range(pid, used_h * num_n, num_progs, flatten=FLATTEN):
            pid_m, pid_n = K._tile_coords(tile, used_h, num_n, group_m)
            blk = tl.load(halves_ptr + pid_m)
            _gemm1_tile(a_half_desc, b_desc, inter_ptr, ws_ptr, a_scale_ptr, a2_scale_ptr,
                        x_ptr, sorted_ptr, tl.load(bexp_ptr + blk), blk * (BLOCK_M // 2),
                        pid_n, P, topk, H, I, stride_im, stride_xm, WFMT, ACT, OUT_FP8, EXACT,
                        FUSED_GU, A_GATHER, BLOCK_M // 2, BLOCK_N, BLOCK_K)


@triton.jit
def _gemm2_tile(a_desc, b_desc, ws_ptr, a2_scale_ptr, topk_w_ptr, y_ptr, sorted_ptr,
                e, row0, pid_n, P, H, I, stride_ym,
                WFMT: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """One tile of GEMM 2: ``BM`` rows from ``row0`` (``a_desc``'s box height), expert ``e``."""
    k_tiles = tl.cdiv(I, BLOCK_K)
    brow = e * H + pid_n * BLOCK_N
    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    for kk in range(k_tiles):
        a = a_desc.load([row0, kk * BLOCK_K])
        b = b_desc.load([brow, kk * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < H
    if WFMT == 1:
        s = tl.load(ws_ptr + e * H + cols, mask=cmask, other=0.0)
        acc = acc * (s * tl.load(a2_scale_ptr))[None, :]
    rows = row0 + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < P
    rw = tl.load(topk_w_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    acc = acc * rw[:, None]
    y_ptrs = y_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["P", "num_m_blocks", "num_progs", "group_m"])
def tma_gemm2_kernel(
    a_desc, a_half_desc, b_desc, ws_ptr, a2_scale_ptr, topk_w_ptr, y_ptr, sorted_ptr, bexp_ptr,
    tiles_ptr, halves_ptr, P, num_m_blocks, num_progs, group_m, H, I, stride_ym,
    WFMT: tl.constexpr, TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """``y[pair] = w_route[pair] * (inter[row] @ w2[e]^T)`` for the valid rows of used tiles
    (``TAIL``: as in :func:`tma_gemm1_kernel`)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(H, BLOCK_N)
    used = _used_blocks(tiles_ptr if TAIL else bexp_ptr, num_m_blocks, 1024)
    for tile in tl.range(pid, used * num_n, num_progs, flatten=FLATTEN):
        pid_m, pid_n = K._tile_coords(tile, used, num_n, group_m)
        e, row0 = _full_tile(tiles_ptr, bexp_ptr, pid_m, TAIL, BLOCK_M)
        _gemm2_tile(a_desc, b_desc, ws_ptr, a2_scale_ptr, topk_w_ptr, y_ptr, sorted_ptr, e, row0,
                    pid_n, P, H, I, stride_ym, WFMT, BLOCK_M, BLOCK_N, BLOCK_K)
    if TAIL:  # then the half tiles
        used_h = _used_blocks(halves_ptr, num_m_blocks, 1024)
        for tile in tl.range(pid, used_h * num_n, num_progs, flatten=FLATTEN):
            pid_m, pid_n = K._tile_coords(tile, used_h, num_n, group_m)
            blk = tl.load(halves_ptr + pid_m)
            _gemm2_tile(a_half_desc, b_desc, ws_ptr, a2_scale_ptr, topk_w_ptr, y_ptr,
                        sorted_ptr, tl.load(bexp_ptr + blk), blk * (BLOCK_M // 2), pid_n, P, H,
                        I, stride_ym, WFMT, BLOCK_M // 2, BLOCK_N, BLOCK_K)


# ----------------------------------------------------------------------------------------------
# Configs and the entry
# ----------------------------------------------------------------------------------------------


def _gcfg(bn, bk, group_m, warps, stages):
    return {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "num_warps": warps,
            "num_stages": stages}


def default_config(pw: ops.PreparedWeights, n_tokens: int, topk: int) -> dict:
    """A starting config from the shape (the benchmark sweeps around it). ``g1.BLOCK_N`` counts
    weight rows of a tile: with ``fused_gu`` (the default) half of them are gate, half up.
    ``GROUP_M`` 0: as many row blocks per group as make one wave of the programs
    (``programs // n_tiles``), so the concurrent tiles share their activation and weight tiles.

    64-row blocks below 160 rows per expert: the padding of each expert's last block is computed
    like real rows, and at 4096 tokens of DeepSeek-V3 (routed with its bias: about 215 experts
    touched) 128-row blocks are 34% padding, 64-row blocks 19%."""
    pairs = max(1, n_tokens * topk)
    rows_per_expert = pairs / max(1, min(pw.num_experts, pairs))
    fp8 = pw.wfmt == K.WFMT_FP8
    bk = 128 if fp8 else 64
    if rows_per_expert <= 160:
        return {"BLOCK_M": 64, "fused_gu": True,
                "g1": _gcfg(256, bk, 0, 8, 3), "g2": _gcfg(256, bk, 0, 8, 3)}
    return {"BLOCK_M": 128, "fused_gu": True,
            "g1": _gcfg(256, bk, 0, 8, 3), "g2": _gcfg(256, bk, 0, 8, 3)}


def config_candidates(pw: ops.PreparedWeights, n_tokens: int, topk: int) -> list[dict]:
    """A small sweep for the benchmark: the default first, then what each knob buys (block
    height, warps, stages, tile widths, the activation gathered in the loop instead of once,
    tile grouping, loop flattening, one tile per program instead of persistent programs, half
    tiles at each expert's tail)."""
    base = default_config(pw, n_tokens, topk)
    fp8 = pw.wfmt == K.WFMT_FP8
    bk = 128 if fp8 else 64
    m128 = {"BLOCK_M": 128, "fused_gu": True, "g1": _gcfg(256, bk, 0, 8, 3),
            "g2": _gcfg(256, bk, 0, 8, 3)}
    m64 = {"BLOCK_M": 64, "fused_gu": True, "g1": _gcfg(256, bk, 0, 8, 3),
           "g2": _gcfg(256, bk, 0, 8, 3)}
    m64w4 = {"BLOCK_M": 64, "fused_gu": True, "g1": _gcfg(256, bk, 0, 4, 4),
             "g2": _gcfg(128, bk, 0, 4, 4)}
    other = m64 if base["BLOCK_M"] == 128 else m128
    out = [
        base,
        other,
        {**base, "a_gather": True},
        {**other, "a_gather": True},
        m64w4,
        {**m64w4, "g1": _gcfg(128, bk, 0, 4, 4), "programs_per_sm": 2},
        # two programs per SM, each a 2-stage pipeline: one computes while the other is in its
        # epilogue (ping-pong across programs)
        {**m64w4, "g1": _gcfg(256, bk, 0, 4, 2), "g2": _gcfg(256, bk, 0, 4, 2),
         "programs_per_sm": 2},
        {**base, "g1": {**base["g1"], "GROUP_M": 8}, "g2": {**base["g2"], "GROUP_M": 8}},
        {**base, "flatten": False},
        {**base, "programs": 0},
        # gate and up as two tiles and two dots: no interleaved copy of the weights
        {**base, "fused_gu": False, "g1": {**base["g1"], "BLOCK_N": base["g1"]["BLOCK_N"] // 2}},
    ]
    if base["BLOCK_M"] == 128:
        out.append({**m128, "g1": _gcfg(256, bk, 0, 8, 4), "g2": _gcfg(128, bk, 0, 8, 4)})
    else:
        out.append({**m64, "g1": _gcfg(256, bk, 0, 8, 4), "g2": _gcfg(256, bk, 0, 8, 4)})
    # each expert's last tile of half height where its rows leave half a tile or less: the
    # padding of 64-row blocks with 128-row tiles elsewhere (128-row blocks only: a 32-row
    # half tile runs without wgmma)
    out += [{**m128, "tail_half": True}, {**m128, "tail_half": True, "a_gather": True},
            {**m128, "tail_half": True, "g1": _gcfg(256, bk, 0, 8, 4),
             "g2": _gcfg(128, bk, 0, 8, 4)}]
    return out


def describe(cfg: dict) -> str:
    g1, g2 = cfg["g1"], cfg["g2"]

    def grp(g):
        return f"G{g['GROUP_M'] or 'auto'}"
    return (f"M{cfg['BLOCK_M']} g1[N{g1['BLOCK_N']} K{g1['BLOCK_K']} {grp(g1)} "
            f"w{g1['num_warps']} s{g1['num_stages']}] g2[N{g2['BLOCK_N']} K{g2['BLOCK_K']} "
            f"{grp(g2)} w{g2['num_warps']} s{g2['num_stages']}]"
            + (" gu" if cfg.get("fused_gu", True) else " 2dot")
            + (" a-gather" if cfg.get("a_gather") else "")
            + (" tail/2" if cfg.get("tail_half") else "")
            + (f" P{cfg['programs'] or 'tiles'}" if "programs" in cfg else "")
            + (f" x{cfg['programs_per_sm']}/SM" if cfg.get("programs_per_sm", 1) != 1 else "")
            + ("" if cfg.get("flatten", True) else " noflat"))


def _group_m(g: dict, programs: int, num_n: int) -> int:
    return int(g["GROUP_M"]) or max(1, programs // max(1, num_n))


def _num_programs(device: torch.device, cfg: dict) -> int:
    """Programs of a persistent GEMM: ``programs`` if set (0: one per tile, not persistent),
    else ``programs_per_sm`` (default 1) times the SM count."""
    if "programs" in cfg:
        return int(cfg["programs"]) or 1 << 30
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return sms * int(cfg.get("programs_per_sm", 1))
    return 4  # the interpreter: a few programs, so the persistent loops are exercised


def _launch_opts(g: dict) -> dict:
    opts = {"num_warps": g["num_warps"]}
    if torch.cuda.is_available():
        opts["num_stages"] = g["num_stages"]
    return opts


def fused_moe_tma(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    tw: TmaWeights,
    *,
    hidden_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
    _stages: list | None = None,
) -> torch.Tensor:
    """``[N, H]``, as :func:`ops.fused_moe_prepared` (same arguments, ``tw`` from
    :func:`prepare_tma`): per token, the routing-weighted sum of its valid experts' gated MLP
    outputs. ``config``: :func:`default_config`'s keys (``fused_gu`` must match ``tw``)."""

    def go(name, fn):
        ret = fn()
        if _stages is not None:
            _stages.append((name, fn, ret))
    pw = tw.pw
    N, H = hidden.shape
    E, I = pw.num_experts, pw.intermediate_size
    if H != pw.hidden_size:
        raise ValueError(f"hidden size {H} does not match the weights' {pw.hidden_size}")
    topk = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    hidden, compute, out_dtype = ops._activations(hidden, hidden_scale, pw, out_dtype)
    out = torch.empty((N, H), dtype=out_dtype, device=hidden.device)
    if N == 0:
        return out
    cfg = config or default_config(pw, N, topk)
    if bool(cfg.get("fused_gu", True)) != tw.fused_gu:
        raise ValueError(f"config fused_gu={cfg.get('fused_gu', True)} but the weights were "
                         f"prepared with fused_gu={tw.fused_gu}")
    hidden = hidden.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    dev = hidden.device
    bm = cfg["BLOCK_M"]
    tail = bool(cfg.get("tail_half", False))
    if tail and (bm < 32 or bm & (bm - 1)):
        raise ValueError(f"tail_half needs BLOCK_M a power of two of at least 32 (half tiles of "
                         f"at least 16 rows; 128 for wgmma in both tile heights), got {bm}")
    gran = bm // 2 if tail else bm  # rows each expert is padded to
    P = N * topk
    R = ops.max_sorted_rows(P, E, gran)
    num_m_blocks = R // gran
    sorted_ids = torch.empty(R, dtype=torch.int32, device=dev)
    bexp = torch.empty(num_m_blocks, dtype=torch.int32, device=dev)
    go("route", lambda: ops.route_into(topk_ids, E, gran, sorted_ids, bexp))
    tiles = halves = bexp
    if tail:
        tiles = torch.empty(num_m_blocks, dtype=torch.int32, device=dev)
        halves = torch.empty(num_m_blocks, dtype=torch.int32, device=dev)
        go("tiles", lambda: tail_tiles_kernel[(1,)](bexp, tiles, halves, num_m_blocks,
                                                    SCAN=1024, num_warps=4))

    fp8 = pw.wfmt == K.WFMT_FP8
    if fp8:
        if hidden.dtype == torch.float8_e4m3fn:
            quant, a_scale = False, hidden_scale.reshape(1).to(torch.float32)
        else:
            quant, a_scale = True, pw.a13_scale
        a_dtype = inter_dtype = torch.float8_e4m3fn
    else:
        quant, a_scale = False, None
        a_dtype = inter_dtype = compute
    dummy = bexp
    g1 = cfg["g1"]
    a_gather = bool(cfg.get("a_gather", False))
    if a_gather:
        # GEMM 1 reads the tokens' rows itself; fp8: quantized once per token first
        x = hidden
        if quant:
            x = torch.empty(hidden.shape, dtype=torch.float8_e4m3fn, device=dev)
            blk = 4096
            go("quant_fp8", lambda: K.quant_fp8_kernel[(triton.cdiv(hidden.numel(), blk),)](
                hidden, x, a_scale, hidden.numel(), BLOCK=blk, EXACT=ops.EXACT_FP8,
                num_warps=8))
        # descriptors of the right type for the unused TMA operands
        a1 = TensorDescriptor.from_tensor(tw.w13, [bm, g1["BLOCK_K"]])
        a1h = (TensorDescriptor.from_tensor(tw.w13, [bm // 2, g1["BLOCK_K"]]) if tail
               else a1)  # (unused without tail_half)
    else:
        x = hidden
        xs = torch.empty((R, H), dtype=a_dtype, device=dev)
        bh = min(1024, max(16, ops._p2(H)))
        rows_g = min(gran, 16)
        go("gather", lambda: tma_gather_kernel[(R // rows_g, triton.cdiv(H, bh))](
            hidden, sorted_ids, bexp, xs, a_scale if quant else dummy, P, H, topk,
            hidden.stride(0), xs.stride(0),
            QUANT=quant, EXACT=ops.EXACT_FP8, BLOCK_M=gran, ROWS=rows_g, BLOCK_H=bh,
            num_warps=4))
        a1 = TensorDescriptor.from_tensor(xs, [bm, g1["BLOCK_K"]])
        a1h = TensorDescriptor.from_tensor(xs, [bm // 2, g1["BLOCK_K"]]) if tail else a1

    inter = torch.empty((R, I), dtype=inter_dtype, device=dev)
    nprog = _num_programs(dev, cfg)
    flatten = bool(cfg.get("flatten", True))
    b1 = TensorDescriptor.from_tensor(tw.w13, [g1["BLOCK_N"], g1["BLOCK_K"]])
    out_n1 = g1["BLOCK_N"] // 2 if tw.fused_gu else g1["BLOCK_N"]
    max_tiles1 = num_m_blocks * triton.cdiv(I, out_n1)  # (half blocks with tail: a bound)
    grid1 = max(1, min(nprog, max_tiles1))
    group1 = _group_m(g1, grid1, triton.cdiv(I, out_n1))
    go("gemm1", lambda: tma_gemm1_kernel[(grid1,)](
        a1, a1h, b1, inter, tw.w13_scale if fp8 else dummy, a_scale if fp8 else dummy,
        pw.a2_scale if fp8 else dummy, bexp, tiles, halves, x, sorted_ids,
        num_m_blocks, grid1, group1, P, topk, H, I, inter.stride(0), x.stride(0),
        WFMT=pw.wfmt, ACT=ops._ACT[pw.activation], OUT_FP8=fp8, EXACT=ops.EXACT_FP8,
        FUSED_GU=tw.fused_gu, A_GATHER=a_gather, TAIL=tail, BLOCK_M=bm, BLOCK_N=g1["BLOCK_N"],
        BLOCK_K=g1["BLOCK_K"], FLATTEN=flatten,
        **_launch_opts(g1)))

    y = torch.empty((P, H), dtype=out_dtype, device=dev)
    g2 = cfg["g2"]
    a2d = TensorDescriptor.from_tensor(inter, [bm, g2["BLOCK_K"]])
    a2h = TensorDescriptor.from_tensor(inter, [bm // 2, g2["BLOCK_K"]]) if tail else a2d
    b2d = TensorDescriptor.from_tensor(tw.w2, [g2["BLOCK_N"], g2["BLOCK_K"]])
    max_tiles2 = num_m_blocks * triton.cdiv(H, g2["BLOCK_N"])
    grid2 = max(1, min(nprog, max_tiles2))
    group2 = _group_m(g2, grid2, triton.cdiv(H, g2["BLOCK_N"]))
    go("gemm2", lambda: tma_gemm2_kernel[(grid2,)](
        a2d, a2h, b2d, tw.w2_scale if fp8 else dummy, pw.a2_scale if fp8 else dummy,
        topk_weights, y, sorted_ids, bexp, tiles, halves,
        P, num_m_blocks, grid2, group2, H, I, y.stride(0),
        WFMT=pw.wfmt, TAIL=tail, BLOCK_M=bm, BLOCK_N=g2["BLOCK_N"], BLOCK_K=g2["BLOCK_K"],
        FLATTEN=flatten,
        **_launch_opts(g2)))

    bh = min(1024, max(16, ops._p2(H)))
    go("finalize", lambda: K.moe_finalize_kernel[(N, triton.cdiv(H, bh))](
        y, topk_ids, out, H, E, y.stride(0), out.stride(0), TOPK=topk, BLOCK_H=bh, num_warps=4))
    return out
