"""NVFP4 experts as W4A16 for 1-128 tokens: weights repacked at load into tiles, swap-AB GEMMs.

The issue-20 tile-layout path (load-time repack by :func:`prepare_w4a16`, weights as the MMA's M
operand, a one-launch path for few pairs), exact: the decoded operand equals the reference
dequantization bit for bit (:func:`decode_w4a16`). The GEMMs run ``mma.sync`` (wgmma sent each
decoded tile through shared memory at one CTA per SM: :func:`_mma`); ``r128k128 sync s3`` was
1.12-1.37x the default path at 16 and 128 tokens on the H200 (benchmarks/RESULTS.md). A few pairs
can take the pairs mode (no routing launch, GEMM 1 optionally split over K). Wired into
``ops.fused_moe_prepared`` as an opt-in: a tuned-table entry's ``"w4a16"`` config or
``MOE_TRITON_W4A16=1`` (``ops.w4a16_config``). Design notes: the plugin README, "Module notes".
"""
from __future__ import annotations

import contextlib
import os

import attrs
import torch
import triton
import triton.language as tl

from moe_runtime import formats as F
from moe_runtime.backend_api import ExpertWeights
from moe_runtime_triton import kernels as K
from moe_runtime_triton import ops

FUSED_MAX_PAIRS = 16  # (token, expert) pairs up to which the one-launch path runs by default
FUSED_MAX_TOKENS = 16  # rows of the fused path's float32 workspace
BLOCK_T = 16  # default tokens per expert block (the MMA's N); the smallest tl.dot size
_ACT = {F.SILU: K.ACT_SILU, F.GELU: K.ACT_GELU}
_FORMATS = (F.NVFP4_W4A16, F.NVFP4_W4A4)  # stored formats whose codes this path reads as W4A16


@attrs.frozen
class W4A16Layout:
    """Tile sizes fixed at load. ``gate_up_rows`` x ``gate_up_cols``: GEMM 1's tile (rows of the
    gate/up matrices x hidden columns); ``down_rows`` x ``down_cols``: GEMM 2's (hidden rows x
    intermediate columns). ``interleave``: a GEMM 1 tile holds gate and up rows alternately (one
    MMA per K step yields both, for ``gate_up_rows / 2`` intermediate columns: twice the programs
    of separate gate and up tiles at the same MMA size). The fused path needs ``down_cols`` equal
    to the intermediate columns of a GEMM 1 tile (:attr:`inter_cols`)."""

    gate_up_rows: int = 64
    gate_up_cols: int = 256
    down_rows: int = 128
    down_cols: int = 64
    interleave: bool = False

    @property
    def inter_cols(self) -> int:
        """Intermediate columns one GEMM 1 tile computes."""
        return self.gate_up_rows // 2 if self.interleave else self.gate_up_rows

    def check(self) -> None:
        for name in ("gate_up_rows", "gate_up_cols", "down_rows", "down_cols"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"W4A16Layout.{name} must be a power of two >= 16, got {v}")
        for name in ("gate_up_cols", "down_cols"):
            if getattr(self, name) < 32:
                raise ValueError(f"W4A16Layout.{name} must be >= 32 (one 16-byte row segment)")

    @property
    def fused(self) -> bool:
        return self.down_cols == self.inter_cols


def default_layout(H: int, I: int) -> W4A16Layout:
    """The layout for a shape: K tiles no deeper than the (padded) matrices, fused-compatible."""
    def p2_at_most(n, cap):
        return max(32, min(cap, 1 << max(0, int(n).bit_length() - 1)))
    rows = 64 if I >= 64 else 32
    return W4A16Layout(gate_up_rows=rows, gate_up_cols=p2_at_most(H, 256),
                       down_rows=p2_at_most(H, 128), down_cols=rows)


@attrs.frozen
class W4A16Weights:
    """One layer's local experts in the tile layout (built once at load by :func:`prepare_w4a16`).

    ``w13 [E, 2 * nI, nH1, CHUNK1]`` uint8: row tile ``j`` of the gate (``j < nI``) or up
    (``nI + j``) rows, K tile ``k``: the tile's codes then its block scales (interleaved layout:
    ``[E, nI, nH1, CHUNK1]``, tile rows ``2i`` / ``2i + 1`` = gate / up row ``i``); ``w2 [E, nH2, nI2,
    CHUNK2]`` likewise for the down matrices. ``acc``/``count``: the fused path's self-clearing
    workspace (one layer's calls must not run concurrently on two streams)."""

    layout: W4A16Layout
    activation: str
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale_2: torch.Tensor  # float32 [E]
    w2_scale_2: torch.Tensor
    acc: torch.Tensor  # float32 [FUSED_MAX_TOKENS, H padded to down_rows]
    count: torch.Tensor  # int32 [FUSED_MAX_TOKENS]
    # the split-K GEMM 1's self-clearing workspace: float32 [FUSED_MAX_PAIRS, 2, I padded],
    # int32 [FUSED_MAX_PAIRS * intermediate tiles]
    ws: torch.Tensor
    ws_count: torch.Tensor
    # the folded combine's arrivals: int32 [FUSED_MAX_TOKENS * hidden tiles] (it adds into acc)
    out_count: torch.Tensor
    num_experts: int
    hidden_size: int
    intermediate_size: int

    @property
    def padded(self) -> tuple[int, int, int]:
        """``(I padded, H padded for GEMM 1's K, H padded for GEMM 2's rows)``."""
        lo = self.layout
        ni = self.w13.shape[1] if lo.interleave else self.w13.shape[1] // 2
        return (ni * lo.inter_cols, self.w13.shape[2] * lo.gate_up_cols,
                self.w2.shape[1] * lo.down_rows)


def _cdiv(a, b):
    return -(-a // b)


def _tiles(packed: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``packed [R, C/2]`` (kernel bit layout), ``scales [R, C/16]`` uint8 with ``R``, ``C`` multiples
    of the tile -> ``[R/rows, C/cols, rows*cols/2 + rows*cols/16]``."""
    R = packed.shape[0]
    C = packed.shape[1] * 2
    nr, nc = R // rows, C // cols
    c = packed.reshape(nr, rows, nc, cols // 2).permute(0, 2, 1, 3).reshape(nr, nc, -1)
    s = scales.reshape(nr, rows, nc, cols // 16).permute(0, 2, 1, 3).reshape(nr, nc, -1)
    return torch.cat([c, s], dim=-1)


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r, c = t.shape
    if (r, c) == (rows, cols):
        return t
    out = torch.zeros((rows, cols), dtype=t.dtype, device=t.device)
    out[:r, :c] = t
    return out


def _interleave(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows ``a[0], b[0], a[1], b[1], ...``."""
    return torch.stack([a, b], dim=1).reshape(2 * a.shape[0], a.shape[1])


def prepare_w4a16(w: ExpertWeights, layout: W4A16Layout | None = None, *,
                  kernel_codes: bool = False) -> W4A16Weights:
    """Repack a layer's NVFP4 experts (checkpoint layout: codes ``[E, rows, K/2]`` uint8, even
    column in the low nibble; e4m3 block scales ``[E, rows, K/16]``; float32 global scales) into
    the tile layout. One expert at a time (temporaries of one expert's size).

    ``kernel_codes``: the codes are already in the kernels' bit layout
    (``ops.pack_nvfp4_for_kernels``, as ``ops.PreparedWeights`` holds them; :func:`from_prepared`).
    The rewrite works on 4-byte groups of a row and maps zero bytes to zero bytes, and the padding
    starts on a 4-byte boundary (``H``, ``I`` multiples of 16), so rewriting before or after the
    padding gives the same tiles."""
    pack = (lambda t: t) if kernel_codes else ops.pack_nvfp4_for_kernels
    if w.format not in _FORMATS:
        raise ValueError(f"the W4A16 path reads NVFP4 weights ({', '.join(_FORMATS)}), "
                         f"got {w.format!r}")
    if w.activation not in _ACT:
        raise ValueError(f"activation {w.activation!r} is not one of {sorted(_ACT)}")
    if w.w13.dtype != torch.uint8 or w.w2.dtype != torch.uint8:
        raise ValueError(f"NVFP4 codes must be packed uint8, got {w.w13.dtype} and {w.w2.dtype}")
    for name in ("w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2"):
        if getattr(w, name) is None:
            raise ValueError(f"{w.format} weights need {name}")
    E, H, I = w.num_experts, w.hidden_size, w.intermediate_size
    if H % 16 or I % 16:
        raise ValueError(f"NVFP4 needs hidden and intermediate sizes divisible by 16, got {H}, {I}")
    lo = layout or default_layout(H, I)
    lo.check()
    if not lo.fused:
        raise ValueError(f"W4A16Layout.down_cols ({lo.down_cols}) must equal the intermediate "
                         f"columns of a GEMM 1 tile ({lo.inter_cols}): GEMM 2's K tiles are GEMM "
                         "1's output tiles")
    Ip = _cdiv(I, lo.inter_cols) * lo.inter_cols
    Hp1 = _cdiv(H, lo.gate_up_cols) * lo.gate_up_cols
    Hp2 = _cdiv(H, lo.down_rows) * lo.down_rows
    dev = w.w13.device
    b13 = w.w13_scale.view(torch.uint8) if w.w13_scale.dtype != torch.uint8 else w.w13_scale
    b2 = w.w2_scale.view(torch.uint8) if w.w2_scale.dtype != torch.uint8 else w.w2_scale
    w13 = w2 = None
    for e in range(E):
        join = _interleave if lo.interleave else (lambda a, b: torch.cat([a, b]))
        codes = pack(join(_pad(w.w13[e, :I], Ip, Hp1 // 2), _pad(w.w13[e, I:], Ip, Hp1 // 2)))
        sc = join(_pad(b13[e, :I], Ip, Hp1 // 16), _pad(b13[e, I:], Ip, Hp1 // 16))
        t13 = _tiles(codes, sc, lo.gate_up_rows, lo.gate_up_cols)
        t2 = _tiles(pack(_pad(w.w2[e], Hp2, Ip // 2)),
                    _pad(b2[e], Hp2, Ip // 16), lo.down_rows, lo.down_cols)
        if w13 is None:
            w13 = torch.empty((E, *t13.shape), dtype=torch.uint8, device=dev)
            w2 = torch.empty((E, *t2.shape), dtype=torch.uint8, device=dev)
        w13[e] = t13
        w2[e] = t2

    def f32(t):
        return t.to(torch.float32).reshape(-1).expand(E).contiguous()
    return W4A16Weights(
        layout=lo, activation=w.activation, w13=w13, w2=w2,
        w13_scale_2=f32(w.w13_scale_2), w2_scale_2=f32(w.w2_scale_2),
        acc=torch.zeros((FUSED_MAX_TOKENS, Hp2), dtype=torch.float32, device=dev),
        count=torch.zeros(FUSED_MAX_TOKENS, dtype=torch.int32, device=dev),
        ws=torch.zeros((FUSED_MAX_PAIRS, 2, Ip), dtype=torch.float32, device=dev),
        ws_count=torch.zeros(FUSED_MAX_PAIRS * (Ip // lo.inter_cols), dtype=torch.int32,
                             device=dev),
        out_count=torch.zeros(FUSED_MAX_TOKENS * (Hp2 // lo.down_rows), dtype=torch.int32,
                              device=dev),
        num_experts=E, hidden_size=H, intermediate_size=I,
    )


def from_prepared(pw: "ops.PreparedWeights", layout: W4A16Layout | None = None) -> W4A16Weights:
    """:func:`prepare_w4a16` of the weights ``pw`` was prepared from (``ops.prepare_weights`` of
    NVFP4 weights), read from ``pw`` itself: the same tiles. A second copy of the layer's 4-bit
    codes and block scales (padded to the layout's tiles) beside ``pw``'s."""
    if pw.wfmt != K.WFMT_NVFP4:
        raise ValueError(f"the W4A16 path reads NVFP4 weights, these run as {pw.run_as!r}")
    w = ExpertWeights(pw.run_as, pw.activation, pw.w13, pw.w2, w13_scale=pw.w13_scale,
                      w2_scale=pw.w2_scale, w13_scale_2=pw.w13_scale_2, w2_scale_2=pw.w2_scale_2)
    return prepare_w4a16(w, layout, kernel_codes=True)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile(w_ptr, off, ROWS: tl.constexpr, COLS: tl.constexpr, USE_ASM: tl.constexpr,
          DT: tl.constexpr = tl.float16):
    """The tile at byte offset ``off`` as ``DT`` (float16 or bfloat16) ``[ROWS, COLS]``: ``e2m1 *
    block_scale * 2**-7`` (exact, ``kernels._scale_codes``). Unmasked: tiles are whole by
    construction."""
    r = tl.arange(0, ROWS)
    kb = tl.arange(0, COLS // 2)
    wb = tl.load(w_ptr + off + r[:, None] * (COLS // 2) + kb[None, :])
    if USE_ASM:
        lo, hi = K._e2m1_pairs_asm(wb, DT)
    else:
        lo, hi = K._e2m1_pairs(wb, ROWS, COLS // 2, DT)
    # per 8-code group: lo = columns (0, 1, 4, 5), hi = (2, 3, 6, 7)
    vals = tl.permute(tl.join(tl.reshape(lo, (ROWS, COLS // 4, 2)),
                              tl.reshape(hi, (ROWS, COLS // 4, 2))), (0, 1, 3, 2))
    vals = tl.reshape(vals, (ROWS, COLS // 16, 16))
    ks = tl.arange(0, COLS // 16)
    sb = tl.load(w_ptr + off + ROWS * COLS // 2 + r[:, None] * (COLS // 16) + ks[None, :])
    return tl.reshape(K._scale_codes(vals, sb, DT), (ROWS, COLS))


@triton.jit
def _act_mul(g, u, ACT: tl.constexpr):
    if ACT == 0:
        return g / (1.0 + tl.exp(-g)) * u
    else:
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476)) * u


@triton.jit
def w4a16_decode_kernel(w_ptr, out_ptr, NR: tl.constexpr, NK: tl.constexpr, ROWS: tl.constexpr,
                        COLS: tl.constexpr, USE_ASM: tl.constexpr):
    """Tests: every tile of one matrix set ``[E, NR, NK, chunk]`` decoded into ``[E, NR*ROWS,
    NK*COLS]`` of ``out``'s dtype (float16 or bfloat16)."""
    e = tl.program_id(0)
    rt = tl.program_id(1)
    kt = tl.program_id(2)
    CHUNK: tl.constexpr = ROWS * COLS // 2 + ROWS * COLS // 16
    off = ((e.to(tl.int64) * NR + rt) * NK + kt) * CHUNK
    v = _tile(w_ptr, off, ROWS, COLS, USE_ASM, out_ptr.dtype.element_ty)
    r = rt * ROWS + tl.arange(0, ROWS)
    c = kt * COLS + tl.arange(0, COLS)
    base = e.to(tl.int64) * (NR * ROWS) * (NK * COLS)
    tl.store(out_ptr + base + r[:, None] * (NK * COLS) + c[None, :], v)


@triton.jit
def _gate_up(w_ptr, xt_ptrs, offs_k, col_mask, e64, j, H, NI: tl.constexpr,
             NK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, BT: tl.constexpr,
             EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, IL: tl.constexpr, KB0, KB1,
             DT: tl.constexpr):
    """GEMM 1's K loop for output tile ``j`` of expert ``e64`` over K tiles ``[KB0, KB1)``:
    ``(gate, up)`` accumulators ``[IC, BT]`` (``IC = ROWS / 2`` interleaved, else ``ROWS``) of
    ``W @ X^T``, ``X^T`` read from ``xt_ptrs [COLS, BT]`` (at K tile ``KB0``) under ``col_mask
    [1, BT]``; the MMA's operands in ``DT``."""
    CHUNK: tl.constexpr = ROWS * COLS // 2 + ROWS * COLS // 16
    if IL:
        off = (e64 * NI + j) * (NK * CHUNK)
        acc = tl.zeros((ROWS, BT), dtype=tl.float32)
        for kb in range(KB0, KB1):
            if EVEN_K:
                xt = tl.load(xt_ptrs, mask=col_mask, other=0.0)
            else:
                xt = tl.load(xt_ptrs, mask=col_mask & (offs_k[:, None] < H - kb * COLS), other=0.0)
            acc = tl.dot(_tile(w_ptr, off + kb * CHUNK, ROWS, COLS, USE_ASM, DT), xt.to(DT), acc)
            xt_ptrs += COLS
        # rows 2i / 2i + 1 -> gate / up of column i
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (ROWS // 2, 2, BT)), (0, 2, 1)))
    else:
        off_g = (e64 * (2 * NI) + j) * (NK * CHUNK)
        off_u = off_g + NI * (NK * CHUNK)
        acc_g = tl.zeros((ROWS, BT), dtype=tl.float32)
        acc_u = tl.zeros((ROWS, BT), dtype=tl.float32)
        for kb in range(KB0, KB1):
            if EVEN_K:
                xt = tl.load(xt_ptrs, mask=col_mask, other=0.0)
            else:
                xt = tl.load(xt_ptrs, mask=col_mask & (offs_k[:, None] < H - kb * COLS), other=0.0)
            xt = xt.to(DT)
            wg = _tile(w_ptr, off_g + kb * CHUNK, ROWS, COLS, USE_ASM, DT)
            wu = _tile(w_ptr, off_u + kb * CHUNK, ROWS, COLS, USE_ASM, DT)
            acc_g = tl.dot(wg, xt, acc_g)
            acc_u = tl.dot(wu, xt, acc_u)
            xt_ptrs += COLS
    return acc_g, acc_u


@triton.jit
def _block_rows(sorted_ptr, bexp_ptr, pid_m, P, E, BT: tl.constexpr, PAIRS: tl.constexpr):
    """``(expert, rows, pairs)`` of row block ``pid_m``: from the routing (``sorted_ptr``,
    ``bexp_ptr``), or with ``PAIRS`` one block per (token, expert) pair, its pair on row 0 and
    ``bexp_ptr`` the router's ``topk_ids`` (no routing launch; expert -1 for ids outside
    ``[0, E)``)."""
    offs_t = pid_m * BT + tl.arange(0, BT)
    if PAIRS:
        e = tl.load(bexp_ptr + pid_m).to(tl.int32)
        e = tl.where((e >= 0) & (e < E), e, -1)
        pair = tl.where(tl.arange(0, BT) == 0, pid_m, P)
    else:
        e = tl.load(bexp_ptr + pid_m)
        pair = tl.load(sorted_ptr + offs_t)
    return e, offs_t, pair


@triton.jit(do_not_specialize=["P", "E", "num_m_blocks", "topk"])
def w4a16_gemm1_kernel(
    x_ptr, w_ptr, s2_ptr, inter_ptr, sorted_ptr, bexp_ptr,
    P, E, H, num_m_blocks, topk, stride_xm, stride_im,
    NI: tl.constexpr, NK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
    BT: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr,
    IL: tl.constexpr = False, MMA_SYNC: tl.constexpr = False, PAIRS: tl.constexpr = False,
):
    """``inter[row, n] = act(x[tok] . gate[e, n]) * (x[tok] . up[e, n])`` for the sorted rows of
    block ``pid % num_m_blocks`` and the ``ROWS`` columns of tile ``pid // num_m_blocks``, as
    ``W [ROWS, COLS] @ X^T [COLS, BT]`` (``IL``: one interleaved gate/up tile, ``ROWS / 2``
    columns; ``PAIRS``: :func:`_block_rows`)."""
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    pid_n = pid // num_m_blocks
    e, offs_t, pair = _block_rows(sorted_ptr, bexp_ptr, pid_m, P, E, BT, PAIRS)
    if e < 0:
        return
    valid = pair < P
    tok = tl.where(valid, pair // topk, 0).to(tl.int64)
    offs_k = tl.arange(0, COLS)
    xt_ptrs = x_ptr + tok[None, :] * stride_xm + offs_k[:, None]
    e64 = e.to(tl.int64)
    acc_g, acc_u = _gate_up(w_ptr, xt_ptrs, offs_k, valid[None, :], e64, pid_n, H,
                            NI, NK, ROWS, COLS, BT, EVEN_K, USE_ASM, IL, 0, NK,
                            inter_ptr.dtype.element_ty)
    s2 = tl.load(s2_ptr + e) * 128.0
    h = _act_mul(acc_g * s2, acc_u * s2, ACT)
    IC: tl.constexpr = ROWS // 2 if IL else ROWS
    offs_n = pid_n * IC + tl.arange(0, IC)
    # padding rows (pair == P) are written too (zeros): GEMM 2 reads whole blocks unmasked
    tl.store(inter_ptr + offs_t.to(tl.int64)[None, :] * stride_im + offs_n[:, None],
             h.to(inter_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["P", "E", "topk"])
def w4a16_splitk_gemm1_kernel(
    x_ptr, ids_ptr, w_ptr, s2_ptr, inter_ptr, ws_ptr, count_ptr,
    P, E, H, topk, stride_xm, stride_im,
    NI: tl.constexpr, NK: tl.constexpr, KS: tl.constexpr, SPLIT: tl.constexpr,
    ROWS: tl.constexpr, COLS: tl.constexpr, IP: tl.constexpr, ACT: tl.constexpr,
    EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, IL: tl.constexpr = False,
    MMA_SYNC: tl.constexpr = False,
):
    """GEMM 1 of the pairs mode split over K: program ``(pair, j, s)`` adds the gate and up sums
    of K tiles ``[s * KS, (s + 1) * KS)`` into ``ws [pair, 2, IP]`` (float32); the program that
    finishes a ``(pair, j)`` last (``count``) applies the activation, writes block ``pair`` of
    ``inter`` (the pairs mode's GEMM 2 operand: its row 0, zero padding rows) and clears both.
    More programs than K-whole tiles give (at 1 token 8 pairs x NI); the sums' order varies
    (float32 atomics)."""
    pair = tl.program_id(0)
    j = tl.program_id(1)
    sp = tl.program_id(2)
    IC: tl.constexpr = ROWS // 2 if IL else ROWS
    e = tl.load(ids_ptr + pair).to(tl.int32)
    ok = (e >= 0) & (e < E)
    r = tl.arange(0, IC)
    g_ptrs = ws_ptr + pair.to(tl.int64) * (2 * IP) + j * IC + r
    if ok:
        col = tl.arange(0, 16)
        offs_k = tl.arange(0, COLS)
        kb0 = sp * KS
        xt_ptrs = (x_ptr + (pair // topk).to(tl.int64) * stride_xm + kb0 * COLS + offs_k[:, None]
                   + col[None, :] * 0)
        acc_g, acc_u = _gate_up(w_ptr, xt_ptrs, offs_k, col[None, :] == 0, e.to(tl.int64), j, H,
                                NI, NK, ROWS, COLS, 16, EVEN_K, USE_ASM, IL, kb0,
                                tl.minimum(kb0 + KS, NK), inter_ptr.dtype.element_ty)
        g = tl.sum(tl.where(col[None, :] == 0, acc_g, 0.0), axis=1)
        u = tl.sum(tl.where(col[None, :] == 0, acc_u, 0.0), axis=1)
        tl.atomic_add(g_ptrs, g, sem="relaxed")
        tl.atomic_add(g_ptrs + IP, u, sem="relaxed")
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + pair * NI + j, 1, sem="acq_rel")
    if done == SPLIT - 1:
        g = tl.load(g_ptrs, cache_modifier=".cg")
        u = tl.load(g_ptrs + IP, cache_modifier=".cg")
        tl.store(g_ptrs, tl.zeros([IC], dtype=tl.float32))
        tl.store(g_ptrs + IP, tl.zeros([IC], dtype=tl.float32))
        tl.store(count_ptr + pair * NI + j, 0)
        if ok:
            s2 = tl.load(s2_ptr + e) * 128.0
            h = _act_mul(g * s2, u * s2, ACT)
            # the block's 15 padding rows as zeros (GEMM 2 reads whole blocks)
            t = tl.arange(0, 16)
            hb = tl.where(t[:, None] == 0, h[None, :], 0.0)
            tl.store(inter_ptr + (pair * 16 + t).to(tl.int64)[:, None] * stride_im + j * IC
                     + r[None, :], hb.to(inter_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["P", "E", "num_m_blocks"])
def w4a16_gemm2_kernel(
    inter_ptr, w_ptr, s2_ptr, topk_w_ptr, y_ptr, sorted_ptr, bexp_ptr,
    P, E, H, num_m_blocks, stride_im, stride_ym,
    NH: tl.constexpr, NK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
    BT: tl.constexpr, USE_ASM: tl.constexpr, KU: tl.constexpr = 1, MMA_SYNC: tl.constexpr = False,
    PAIRS: tl.constexpr = False,
):
    """``y[pair, n] = rw[pair] * (inter[row] . down[e, n])`` as ``W [ROWS, COLS] @ inter^T``;
    ``KU`` K tiles per loop iteration (``NK % KU == 0``: the loop's overhead over more weights);
    ``PAIRS``: :func:`_block_rows`."""
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    pid_n = pid // num_m_blocks
    e, offs_t, pair = _block_rows(sorted_ptr, bexp_ptr, pid_m, P, E, BT, PAIRS)
    if e < 0:
        return
    valid = pair < P
    offs_k = tl.arange(0, COLS)
    ht_ptrs = inter_ptr + offs_t.to(tl.int64)[None, :] * stride_im + offs_k[:, None]
    CHUNK: tl.constexpr = ROWS * COLS // 2 + ROWS * COLS // 16
    off = (e.to(tl.int64) * NH + pid_n) * (NK * CHUNK)
    acc = tl.zeros((ROWS, BT), dtype=tl.float32)
    for kb in range(0, NK // KU):
        for u in tl.static_range(KU):
            ht = tl.load(ht_ptrs + u * COLS)
            w = _tile(w_ptr, off + (kb * KU + u) * CHUNK, ROWS, COLS, USE_ASM,
                      inter_ptr.dtype.element_ty)
            acc = tl.dot(w, ht, acc)
        ht_ptrs += KU * COLS
    rw = tl.load(topk_w_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    acc = acc * (rw * (tl.load(s2_ptr + e) * 128.0))[None, :]
    offs_n = pid_n * ROWS + tl.arange(0, ROWS)
    y_ptrs = y_ptr + tl.where(valid, pair, 0).to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=valid[None, :] & (offs_n[:, None] < H))


@triton.jit(do_not_specialize=["P", "E"])
def w4a16_pairs_down_kernel(
    inter_ptr, ids_ptr, w_ptr, s2_ptr, topk_w_ptr, acc_ptr, count_ptr, out_ptr,
    P, E, H, stride_im, stride_om,
    TOPK: tl.constexpr, NH: tl.constexpr, NK: tl.constexpr, ROWS: tl.constexpr,
    COLS: tl.constexpr, HP: tl.constexpr, USE_ASM: tl.constexpr, KU: tl.constexpr = 1,
    MMA_SYNC: tl.constexpr = False,
):
    """GEMM 2 of the pairs mode with the combine folded in: program ``(pair, hb)`` adds
    ``rw * (down[e, hb rows] . h)`` (row 0 of the pair's block of ``inter``) into ``acc [t]``
    (float32); the last of the token's ``TOPK`` programs of tile ``hb`` (``count``) writes
    ``out[t]``'s rows and clears both (no finalize launch; the sum's order varies)."""
    pair = tl.program_id(0)
    hb = tl.program_id(1)
    t = pair // TOPK
    e = tl.load(ids_ptr + pair).to(tl.int32)
    ok = (e >= 0) & (e < E)
    offs_n = hb * ROWS + tl.arange(0, ROWS)
    a_ptrs = acc_ptr + t * HP + offs_n
    if ok:
        col = tl.arange(0, 16)
        offs_k = tl.arange(0, COLS)
        ht_ptrs = (inter_ptr + (pair * 16 + col).to(tl.int64)[None, :] * stride_im
                   + offs_k[:, None])
        CHUNK: tl.constexpr = ROWS * COLS // 2 + ROWS * COLS // 16
        off = (e.to(tl.int64) * NH + hb) * (NK * CHUNK)
        acc = tl.zeros((ROWS, 16), dtype=tl.float32)
        for kb in range(0, NK // KU):
            for u in tl.static_range(KU):
                ht = tl.load(ht_ptrs + u * COLS)
                w = _tile(w_ptr, off + (kb * KU + u) * CHUNK, ROWS, COLS, USE_ASM,
                          inter_ptr.dtype.element_ty)
                acc = tl.dot(w, ht, acc)
            ht_ptrs += KU * COLS
        coef = tl.load(topk_w_ptr + pair).to(tl.float32) * tl.load(s2_ptr + e) * 128.0
        part = tl.sum(tl.where(col[None, :] == 0, acc, 0.0), axis=1) * coef
        tl.atomic_add(a_ptrs, part, sem="relaxed")
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + t * NH + hb, 1, sem="acq_rel")
    if done == TOPK - 1:
        v = tl.load(a_ptrs, cache_modifier=".cg")
        tl.store(a_ptrs, tl.zeros([ROWS], dtype=tl.float32))
        tl.store(out_ptr + t.to(tl.int64) * stride_om + offs_n, v.to(out_ptr.dtype.element_ty),
                 mask=offs_n < H)
        tl.store(count_ptr + t * NH + hb, 0)


@triton.jit(do_not_specialize=["E"])
def w4a16_fused_kernel(
    x_ptr, ids_ptr, topk_w_ptr, w13_ptr, w2_ptr, s13_ptr, s2_ptr, acc_ptr, count_ptr, out_ptr,
    E, H, stride_xm, stride_om,
    TOPK: tl.constexpr, NI: tl.constexpr, NK1: tl.constexpr, NH: tl.constexpr, HP: tl.constexpr,
    ROWS1: tl.constexpr, COLS1: tl.constexpr, ROWS2: tl.constexpr,
    ACT: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, IL: tl.constexpr = False,
    MMA_SYNC: tl.constexpr = False, DT: tl.constexpr = tl.float16,
):
    """Program ``(pair, j)``: ``h = act(gate_j . x) * (up_j . x)`` (``ROWS1`` intermediate
    columns), then ``acc[tok] += rw * down[:, j] @ h``; the last program of a token writes
    ``out[tok]`` from ``acc[tok]`` and clears both. The token is column 0 of ``X^T [COLS1, 16]``."""
    pair = tl.program_id(0)
    j = tl.program_id(1)
    t = pair // TOPK
    e = tl.load(ids_ptr + pair).to(tl.int32)
    if (e >= 0) & (e < E):
        col = tl.arange(0, 16)
        offs_k = tl.arange(0, COLS1)
        xt_ptrs = x_ptr + t.to(tl.int64) * stride_xm + offs_k[:, None] + col[None, :] * 0
        IC: tl.constexpr = ROWS1 // 2 if IL else ROWS1
        CHUNK2: tl.constexpr = ROWS2 * IC // 2 + ROWS2 * IC // 16
        e64 = e.to(tl.int64)
        acc_g, acc_u = _gate_up(w13_ptr, xt_ptrs, offs_k, col[None, :] == 0, e64, j, H,
                                NI, NK1, ROWS1, COLS1, 16, EVEN_K, USE_ASM, IL, 0, NK1, DT)
        s13 = tl.load(s13_ptr + e) * 128.0
        # columns 1..15 are act(0) * 0 = 0: h is GEMM 2's B operand as it stands
        h = _act_mul(acc_g * s13, acc_u * s13, ACT).to(DT)
        coef = tl.load(topk_w_ptr + pair).to(tl.float32) * tl.load(s2_ptr + e) * 128.0
        r = tl.arange(0, ROWS2)
        for hb in range(0, NH):
            w = _tile(w2_ptr, ((e64 * NH + hb) * NI + j) * CHUNK2, ROWS2, IC, USE_ASM, DT)
            part = tl.sum(tl.dot(w, h), axis=1) * coef
            tl.atomic_add(acc_ptr + t * HP + hb * ROWS2 + r, part, sem="relaxed")
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
    if done == TOPK * NI - 1:
        ro = tl.arange(0, ROWS2)
        for hb in range(0, NH):
            offs = hb * ROWS2 + ro
            # the counter's acquire orders these after every program's additions (made at L2;
            # .cg skips L1)
            a_ptrs = acc_ptr + t * HP + offs
            v = tl.load(a_ptrs, cache_modifier=".cg")
            tl.store(a_ptrs, tl.zeros([ROWS2], dtype=tl.float32))
            tl.store(out_ptr + t.to(tl.int64) * stride_om + offs, v.to(out_ptr.dtype.element_ty),
                     mask=offs < H)
        tl.store(count_ptr + t, 0)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def default_config(ww: W4A16Weights, n_tokens: int, topk: int) -> dict:
    """``fused``: the one-launch path (a few pairs); else the grouped path with ``BLOCK_T`` tokens
    per expert block (the MMA's N: 16, 32 or 64 from the mean rows per touched expert);
    ``num_warps`` / ``num_stages`` of the GEMMs; ``mma_sync``: the GEMMs' dots as ``mma.sync``
    rather than Hopper's wgmma (:func:`_mma`); ``x_f16`` (not set here): the activations
    converted to float16 by one launch before the GEMMs (:func:`fused_moe_w4a16`); ``pairs``
    (not set here): the grouped path with one 16-row block per (token, expert) pair and no
    routing launch (GEMM 1, GEMM 2, finalize: for a few pairs); ``split_k`` (pairs only, not
    set here): GEMM 1 split over that many K ranges (:func:`w4a16_splitk_gemm1_kernel`); ``fold``
    (pairs only, not set here): GEMM 2 adds into the output itself, no finalize launch
    (:func:`w4a16_pairs_down_kernel`)."""
    pairs = max(1, n_tokens * topk)
    fused = pairs <= FUSED_MAX_PAIRS and n_tokens <= FUSED_MAX_TOKENS
    rows = pairs / min(ww.num_experts, pairs)
    bt = 16 if rows <= 16 else 32 if rows <= 48 else 64
    # mma.sync: the decoded tile stays in registers, 45-80 KB of shared memory (sm_90 compile of
    # the default layouts, 3 stages); 64-token blocks double the activations' tile
    stages = (3 if bt <= 32 else 2) if torch.cuda.is_available() else 1
    return {"fused": fused, "BLOCK_T": bt, "num_warps": 4, "num_stages": stages,
            "mma_sync": True}


@contextlib.contextmanager
def _mma(cfg: dict):
    """Launches (and so compilations) of the GEMM kernels under ``cfg["mma_sync"]``.

    On sm_90 Triton lowers a dot of 64 or more rows per warp group to wgmma, whose register
    operand it does not take in the decode's layout: each K step then writes the decoded tile
    (4x the weight bytes: float16 of 4-bit codes) to shared memory and reads it back, and the
    staging buffers (150 KB at 64 x 256) leave one CTA of 4 warps per SM (benchmarks/RESULTS.md,
    the profile of issue 20). ``mma.sync`` takes the operand from registers in the layout the
    decode produces, as the default path does. Triton has no per-kernel switch: its
    ``DISABLE_MMA_V3`` (read when a kernel compiles, part of its cache key) is set around the
    launch, and the kernels' ``MMA_SYNC`` constexpr keeps the two compilations apart in the JIT's
    in-memory cache (keyed by the specialisation only)."""
    if not cfg.get("mma_sync", False):
        yield False
        return
    old = os.environ.get("DISABLE_MMA_V3")
    os.environ["DISABLE_MMA_V3"] = "1"
    try:
        yield True
    finally:
        if old is None:
            del os.environ["DISABLE_MMA_V3"]
        else:
            os.environ["DISABLE_MMA_V3"] = old


def split_k(ww: W4A16Weights, pairs: int, want=0) -> int:
    """K ranges of the split-K GEMM 1 for ``pairs`` pairs: ``want``, or with 0 as many as give
    about 6 programs per SM (132 SMs without a GPU), at most one per K tile."""
    lo = ww.layout
    nk = ww.padded[1] // lo.gate_up_cols
    if want:
        return max(1, min(int(want), nk))
    sms = (torch.cuda.get_device_properties(ww.w13.device).multi_processor_count
           if ww.w13.is_cuda else 132)
    ni = ww.padded[0] // lo.inter_cols
    return max(1, min(nk, round(6 * sms / max(1, pairs * ni))))


def _use_asm(rows: int, cols: int, warps: int) -> bool:
    # four consecutive bytes of a row per thread (kernels._e2m1_pairs_asm): whole 16-byte row
    # segments and at least four bytes per thread of the tile (ops._asm_decode's rule)
    return ops.USE_ASM and cols % 32 == 0 and rows * cols // 2 >= 4 * 32 * warps


def down_unroll(nk: int, cols: int) -> int:
    """K tiles per GEMM 2 loop iteration: up to 256 columns, dividing the tile count."""
    ku = max(1, 256 // cols)
    while nk % ku:
        ku //= 2
    return ku


def _opts(cfg: dict) -> dict:
    o = {"num_warps": cfg["num_warps"]}
    if torch.cuda.is_available():
        o["num_stages"] = cfg["num_stages"]
    return o


def decode_w4a16(ww: W4A16Weights, dtype: torch.dtype = torch.float16
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' decoded operands (tests): ``(w13 [E, 2I, H], w2 [E, H, I])`` in ``dtype``
    (float16, or bfloat16 on a GPU), each ``e2m1 * block_scale * 2**-7`` (the global scale is
    applied to the accumulators)."""
    lo = ww.layout
    E, H, I = ww.num_experts, ww.hidden_size, ww.intermediate_size

    def run(t, rows, cols):
        _, nr, nk, _ = t.shape
        out = torch.empty((E, nr * rows, nk * cols), dtype=dtype, device=t.device)
        w4a16_decode_kernel[(E, nr, nk)](t, out, NR=nr, NK=nk, ROWS=rows, COLS=cols,
                                         USE_ASM=_use_asm(rows, cols, 4), num_warps=4)
        return out
    g = run(ww.w13, lo.gate_up_rows, lo.gate_up_cols)
    if lo.interleave:
        w13 = torch.cat([g[:, 0::2][:, :I, :H], g[:, 1::2][:, :I, :H]], dim=1)
    else:
        Ip = g.shape[1] // 2
        w13 = torch.cat([g[:, :I, :H], g[:, Ip:Ip + I, :H]], dim=1)
    w2 = run(ww.w2, lo.down_rows, lo.down_cols)[:, :H, :I]
    return w13, w2


def fused_moe_w4a16(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    ww: W4A16Weights,
    *,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
    _stages: list | None = None,
) -> torch.Tensor:
    """``[N, H]``: per token, the routing-weighted sum of its valid experts' gated MLP outputs
    (``ops.fused_moe_prepared``'s contract for token-major input; ids outside ``[0, E)`` are
    skipped). ``hidden`` is float16, bfloat16 or float32; the MMAs run in
    ``ops.nvfp4_compute_dtype(hidden.dtype)`` (bfloat16 for bfloat16 activations, keeping their
    range through the intermediate; else float16)."""

    def go(name, fn):
        ret = fn()
        if _stages is not None:
            _stages.append((name, fn, ret))
    N, H = hidden.shape
    E = ww.num_experts
    if H != ww.hidden_size:
        raise ValueError(f"hidden size {H} does not match the weights' {ww.hidden_size}")
    if hidden.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"W4A16 activations must be float16, bfloat16 or float32, got {hidden.dtype}")
    topk = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    if topk_ids.shape[0] != N or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [{N}, topk]")
    out = torch.empty((N, H), dtype=out_dtype or hidden.dtype, device=hidden.device)
    if N == 0:
        return out
    hidden = hidden.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    cfg = config or default_config(ww, N, topk)
    compute = ops.nvfp4_compute_dtype(hidden.dtype)
    if cfg.get("x_f16") and hidden.dtype != compute:
        # the kernels round the activations to the MMA's dtype as they load them; done once here
        # instead (round to nearest even both ways, so the same values): inside the loop every
        # warp converts the whole activation tile, which costs up to 1.5 SASS instructions per
        # weight where the tile has few weight rows (sass_inspect: r64k256i). bfloat16
        # activations into bfloat16 MMAs need none.
        x16 = torch.empty(hidden.shape, dtype=compute, device=hidden.device)
        go("x_f16", lambda: x16.copy_(hidden))
        hidden = x16
    lo = ww.layout
    Ip, Hp1, Hp2 = ww.padded
    NI, NK1 = Ip // lo.inter_cols, Hp1 // lo.gate_up_cols
    NH = Hp2 // lo.down_rows
    act = _ACT[ww.activation]
    warps = cfg["num_warps"]
    P = N * topk
    if cfg.get("fused"):
        if N > ww.acc.shape[0]:
            raise ValueError(f"the fused W4A16 path takes at most {ww.acc.shape[0]} tokens, got {N}")
        asm = _use_asm(lo.gate_up_rows, lo.gate_up_cols, warps) and \
            _use_asm(lo.down_rows, lo.down_cols, warps)
        with _mma(cfg) as sync:
            go("fused", lambda: w4a16_fused_kernel[(P, NI)](
                hidden, topk_ids, topk_weights, ww.w13, ww.w2, ww.w13_scale_2, ww.w2_scale_2,
                ww.acc, ww.count, out, E, H, hidden.stride(0), out.stride(0),
                TOPK=topk, NI=NI, NK1=NK1, NH=NH, HP=Hp2, ROWS1=lo.gate_up_rows,
                COLS1=lo.gate_up_cols, ROWS2=lo.down_rows, ACT=act, EVEN_K=H == Hp1, USE_ASM=asm,
                IL=lo.interleave, MMA_SYNC=sync, DT=ops._TL_DTYPE[compute],
                **_opts(cfg)))
        return out
    bt = cfg.get("BLOCK_T", BLOCK_T)
    if bt < 16 or bt & (bt - 1):
        raise ValueError(f"BLOCK_T must be a power of two >= 16 (the MMA's N), got {bt}")
    pairs = bool(cfg.get("pairs"))
    if pairs:
        # one block per pair, its expert read from topk_ids: no routing launch (a few pairs)
        bt = 16
        nmb, R = P, P * bt
        bexp = topk_ids.reshape(-1)
        if bexp.dtype != torch.int32:
            bexp = bexp.to(torch.int32)
        sorted_ids = bexp  # not read
    else:
        R = ops.max_sorted_rows(P, E, bt)
        sorted_ids = torch.empty(R, dtype=torch.int32, device=hidden.device)
        bexp = torch.empty(R // bt, dtype=torch.int32, device=hidden.device)
        go("route", lambda: ops.route_into(topk_ids, E, bt, sorted_ids, bexp))
        nmb = R // bt
    inter = torch.empty((R, Ip), dtype=compute, device=hidden.device)
    fold = pairs and bool(cfg.get("fold"))
    if fold and N > ww.acc.shape[0]:
        raise ValueError(f"the folded combine takes at most {ww.acc.shape[0]} tokens, got {N}")
    y = None if fold else torch.empty((P, H), dtype=out.dtype, device=hidden.device)
    split = split_k(ww, P, cfg.get("split_k", 1)) if pairs else 1
    if split > 1 and P > ww.ws.shape[0]:
        raise ValueError(f"the split-K GEMM 1 takes at most {ww.ws.shape[0]} pairs, got {P}")
    ks = _cdiv(NK1, split)
    with _mma(cfg) as sync:
        if split > 1:
            go("gemm1", lambda: w4a16_splitk_gemm1_kernel[(P, NI, _cdiv(NK1, ks))](
                hidden, bexp, ww.w13, ww.w13_scale_2, inter, ww.ws, ww.ws_count,
                P, E, H, topk, hidden.stride(0), inter.stride(0),
                NI=NI, NK=NK1, KS=ks, SPLIT=_cdiv(NK1, ks), ROWS=lo.gate_up_rows,
                COLS=lo.gate_up_cols, IP=Ip, ACT=act, EVEN_K=H == Hp1,
                USE_ASM=_use_asm(lo.gate_up_rows, lo.gate_up_cols, warps), IL=lo.interleave,
                MMA_SYNC=sync, **_opts(cfg)))
        else:
            go("gemm1", lambda: w4a16_gemm1_kernel[(nmb * NI,)](
                hidden, ww.w13, ww.w13_scale_2, inter, sorted_ids, bexp,
                P, E, H, nmb, topk, hidden.stride(0), inter.stride(0),
                NI=NI, NK=NK1, ROWS=lo.gate_up_rows, COLS=lo.gate_up_cols, BT=bt, ACT=act,
                EVEN_K=H == Hp1, USE_ASM=_use_asm(lo.gate_up_rows, lo.gate_up_cols, warps),
                IL=lo.interleave, MMA_SYNC=sync, PAIRS=pairs,
                **_opts(cfg)))
        if fold:
            go("gemm2", lambda: w4a16_pairs_down_kernel[(P, NH)](
                inter, bexp, ww.w2, ww.w2_scale_2, topk_weights, ww.acc, ww.out_count, out,
                P, E, H, inter.stride(0), out.stride(0),
                TOPK=topk, NH=NH, NK=Ip // lo.down_cols, ROWS=lo.down_rows, COLS=lo.down_cols,
                HP=Hp2, USE_ASM=_use_asm(lo.down_rows, lo.down_cols, warps),
                KU=down_unroll(Ip // lo.down_cols, lo.down_cols), MMA_SYNC=sync, **_opts(cfg)))
            return out
        go("gemm2", lambda: w4a16_gemm2_kernel[(nmb * NH,)](
            inter, ww.w2, ww.w2_scale_2, topk_weights, y, sorted_ids, bexp,
            P, E, H, nmb, inter.stride(0), y.stride(0),
            NH=NH, NK=Ip // lo.down_cols, ROWS=lo.down_rows, COLS=lo.down_cols, BT=bt,
            USE_ASM=_use_asm(lo.down_rows, lo.down_cols, warps),
            KU=down_unroll(Ip // lo.down_cols, lo.down_cols), MMA_SYNC=sync, PAIRS=pairs,
            **_opts(cfg)))
    bh = min(1024, max(16, triton.next_power_of_2(H)))
    go("finalize", lambda: K.moe_finalize_kernel[(N, triton.cdiv(H, bh))](
        y, topk_ids, out, H, E, y.stride(0), out.stride(0), TOPK=topk, BLOCK_H=bh, num_warps=4))
    return out
