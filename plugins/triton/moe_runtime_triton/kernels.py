"""Triton kernels of the fused MoE experts path: routing, GEMM 1 with the fused activation,
GEMM 2, finalize (and a two-kernel decode path for a few pairs).

Nothing depends on data sizes on the host, so the path is CUDA-graph capturable. The pipeline and
the weight encodings are described in README.md, "Module notes".
"""

from __future__ import annotations

import triton
import triton.language as tl

WFMT_16BIT = 0
WFMT_FP8 = 1
WFMT_NVFP4 = 2

ACT_SILU = 0
ACT_GELU = 1

FP8_MAX = 448.0


# ----------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------


@triton.jit
def _write_block_map(ends, padded, emask, bexp_ptr, num_blocks, BLOCK_M: tl.constexpr,
                     E_P2: tl.constexpr, FILL: tl.constexpr):
    """``bexp[b]`` = expert of row block ``b``, or -1 past the last used block. GEMM programs
    read one int instead of searching the offsets."""
    for c in range(0, num_blocks, FILL):
        b = c + tl.arange(0, FILL)
        tl.store(bexp_ptr + b, tl.zeros([FILL], dtype=tl.int32) - 1, mask=b < num_blocks)
    tl.debug_barrier()
    eo = tl.arange(0, E_P2)
    nb = padded // BLOCK_M
    first = (ends - padded) // BLOCK_M
    max_nb = tl.max(tl.where(emask, nb, 0), axis=0)
    for j in range(0, max_nb):
        tl.store(bexp_ptr + first + j, eo, mask=emask & (j < nb))


@triton.jit
def route_small_kernel(
    ids_ptr, sorted_ptr, bexp_ptr, scratch_ptr,
    P, E, max_rows,
    BLOCK_M: tl.constexpr, P_P2: tl.constexpr, E_P2: tl.constexpr, FILL: tl.constexpr,
):
    """All of the routing in one program (``P <= P_P2``)."""
    eo = tl.arange(0, E_P2)
    emask = eo < E
    tl.store(scratch_ptr + eo, tl.zeros([E_P2], dtype=tl.int32), mask=emask)
    sentinel = tl.zeros([FILL], dtype=tl.int32) + P
    for start in range(0, max_rows, FILL):
        fo = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + fo, sentinel, mask=fo < max_rows)
    tl.debug_barrier()

    po = tl.arange(0, P_P2)
    pmask = po < P
    e = tl.load(ids_ptr + po, mask=pmask, other=-1).to(tl.int32)
    valid = pmask & (e >= 0) & (e < E)
    e = tl.where(valid, e, 0)
    # relaxed: only atomicity is needed (the barrier below orders the phases); the default
    # acq_rel puts a GPU-wide memory barrier before every atomic
    rank = tl.atomic_add(scratch_ptr + e, tl.full([P_P2], 1, tl.int32), mask=valid, sem="relaxed")
    tl.debug_barrier()

    counts = tl.load(scratch_ptr + eo, mask=emask, other=0, cache_modifier=".cg")
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    _write_block_map(ends, padded, emask, bexp_ptr, max_rows // BLOCK_M, BLOCK_M, E_P2, FILL)
    tl.debug_barrier()
    tl.store(scratch_ptr + eo, ends - padded, mask=emask)
    tl.debug_barrier()
    start_row = tl.load(scratch_ptr + e, mask=valid, other=0, cache_modifier=".cg")
    tl.store(sorted_ptr + start_row + rank, po, mask=valid)


@triton.jit
def route_tiny_kernel(
    ids_ptr, sorted_ptr, bexp_ptr,
    P, E, max_rows,
    BLOCK_M: tl.constexpr, P_P2: tl.constexpr, E_P2: tl.constexpr, FILL: tl.constexpr,
):
    """Decode sizes (``P <= P_P2 <= 64``): ranks, counts and offsets in registers (pairwise
    comparisons), no atomics and no global round trips between the phases."""
    po = tl.arange(0, P_P2)
    pmask = po < P
    e = tl.load(ids_ptr + po, mask=pmask, other=-1).to(tl.int32)
    valid = pmask & (e >= 0) & (e < E)
    e = tl.where(valid, e, -1)
    pj = tl.arange(0, P_P2)
    ej = tl.load(ids_ptr + pj, mask=pj < P, other=-1).to(tl.int32)
    ej = tl.where((pj < P) & (ej >= 0) & (ej < E), ej, -2)
    rank = tl.sum(((e[:, None] == ej[None, :]) & (pj[None, :] < po[:, None])).to(tl.int32), axis=1)
    eo = tl.arange(0, E_P2)
    onehot = e[:, None] == eo[None, :]
    counts = tl.sum(onehot.to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    start_row = tl.sum(tl.where(onehot, starts[None, :], 0), axis=1)
    for c in range(0, max_rows, FILL):
        fo = c + tl.arange(0, FILL)
        tl.store(sorted_ptr + fo, tl.zeros([FILL], dtype=tl.int32) + P, mask=fo < max_rows)
    _write_block_map(ends, padded, eo < E, bexp_ptr, max_rows // BLOCK_M, BLOCK_M, E_P2, FILL)
    tl.store(sorted_ptr + start_row + rank, po, mask=valid)


@triton.jit
def route_count_kernel(
    ids_ptr, counts_ptr, rank_ptr, sorted_ptr,
    P, E, max_rows, fill_per_program,
    BLOCK: tl.constexpr,
):
    """Large ``P``: ranks within each expert by atomics (``counts`` zeroed before) and the
    sentinel fill of ``sorted_ids`` (each program a slice)."""
    pid = tl.program_id(0)
    po = pid * BLOCK + tl.arange(0, BLOCK)
    pmask = po < P
    e = tl.load(ids_ptr + po, mask=pmask, other=-1).to(tl.int32)
    valid = pmask & (e >= 0) & (e < E)
    e = tl.where(valid, e, 0)
    rank = tl.atomic_add(counts_ptr + e, tl.full([BLOCK], 1, tl.int32), mask=valid, sem="relaxed")
    tl.store(rank_ptr + po, rank, mask=pmask)
    base = pid * fill_per_program
    for start in range(0, fill_per_program, BLOCK):
        fo = base + start + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + fo, tl.zeros([BLOCK], dtype=tl.int32) + P,
                 mask=(fo < max_rows) & (fo < base + fill_per_program))


@triton.jit
def route_count_sorted_kernel(
    ids_ptr, counts_ptr, rank_ptr, sorted_ptr,
    P, E, max_rows, fill_per_program,
    BLOCK: tl.constexpr, E_P2: tl.constexpr,
):
    """``route_count_kernel`` with one atomic per (program, expert) instead of one per pair: the
    program sorts its pairs by expert (key ``expert * BLOCK + slot``), takes each expert's base
    row with one vector atomic of its histogram, and ranks a pair by its position in the sorted
    block. (Atomics on a few hundred counters from every pair serialise at the L2.)"""
    pid = tl.program_id(0)
    slot = tl.arange(0, BLOCK)
    po = pid * BLOCK + slot
    pmask = po < P
    e = tl.load(ids_ptr + po, mask=pmask, other=-1).to(tl.int32)
    valid = pmask & (e >= 0) & (e < E)
    key = tl.where(valid, e, E_P2) * BLOCK + slot  # invalid pairs sort last
    skey = tl.sort(key)
    se = skey // BLOCK
    sslot = skey % BLOCK
    svalid = se < E_P2
    se_c = tl.where(svalid, se, 0)
    eo = tl.arange(0, E_P2)
    hist = tl.histogram(tl.where(valid, e, 0), E_P2)
    hist = hist - tl.where(eo == 0, tl.sum((~valid).to(tl.int32), axis=0), 0)
    first = tl.cumsum(hist, axis=0) - hist  # first sorted position of each expert
    base = tl.atomic_add(counts_ptr + eo, hist, mask=(eo < E) & (hist > 0), sem="relaxed")
    rank = tl.gather(base, se_c, 0) + slot - tl.gather(first, se_c, 0)
    tl.store(rank_ptr + pid * BLOCK + sslot, rank, mask=svalid & (pid * BLOCK + sslot < P))
    fbase = pid * fill_per_program
    for start in range(0, fill_per_program, BLOCK):
        fo = fbase + start + slot
        tl.store(sorted_ptr + fo, tl.zeros([BLOCK], dtype=tl.int32) + P,
                 mask=(fo < max_rows) & (fo < fbase + fill_per_program))


@triton.jit
def route_offsets_kernel(counts_ptr, bexp_ptr, starts_ptr, E, num_blocks, BLOCK_M: tl.constexpr,
                         E_P2: tl.constexpr):
    eo = tl.arange(0, E_P2)
    emask = eo < E
    counts = tl.load(counts_ptr + eo, mask=emask, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(starts_ptr + eo, ends - padded, mask=emask)
    _write_block_map(ends, padded, emask, bexp_ptr, num_blocks, BLOCK_M, E_P2, 1024)


@triton.jit
def route_scatter_kernel(ids_ptr, rank_ptr, starts_ptr, sorted_ptr, P, E, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    po = pid * BLOCK + tl.arange(0, BLOCK)
    pmask = po < P
    e = tl.load(ids_ptr + po, mask=pmask, other=-1).to(tl.int32)
    valid = pmask & (e >= 0) & (e < E)
    e = tl.where(valid, e, 0)
    rank = tl.load(rank_ptr + po, mask=valid, other=0)
    start = tl.load(starts_ptr + e, mask=valid, other=0)
    tl.store(sorted_ptr + start + rank, po, mask=valid)


# ----------------------------------------------------------------------------------------------
# Shared pieces of the GEMMs
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile_coords(pid, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row blocks share the sweep over the N blocks (L2 reuse)."""
    group_size = GROUP_M * num_n_blocks
    group = pid // group_size
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % size_m
    pid_n = (pid % group_size) // size_m
    return pid_m, pid_n


# Bit layout of each 32-bit group of 8 codes (columns c0..c7, a code = sign s and magnitude eem),
# written once by ``ops.pack_nvfp4_for_kernels`` so that the decode below needs 11 integer
# operations per 8 codes: for each float16 pair, eem must land on bits 11..9 and s on bit 15 of
# its half (a float16 with those bits is the E2M1 value times 2**-14, exact; eem = 0xx lands on
# subnormals). Per half-word (the high half holds the odd column of each pair, bits + 16):
#   pair (c0, c1): eem at 9..11,  s at 15  -> w & 0x8E008E00
#   pair (c4, c5): eem at 6..8,   s at 12  -> (w << 3) & 0x8E008E00
#   pair (c2, c3): eem at 0..2,   s at 13  -> ((w << 9) & 0x0E000E00) | ((w << 2) & 0x80008000)
#   pair (c6, c7): eem at 3..5,   s at 14  -> ((w << 6) & 0x0E000E00) | ((w << 1) & 0x80008000)
NVFP4_GROUP_FIELDS = (  # column within the group -> (eem low bit, sign bit) in the 32-bit word
    (9, 15), (25, 31), (0, 13), (16, 29), (6, 12), (22, 28), (3, 14), (19, 30),
)


@triton.jit
def _e2m1_pairs_asm(packed, DT: tl.constexpr = tl.float16):
    """Packed groups (bytes, four per instance = one 32-bit group of 8 codes) -> two float16
    tensors of the packed tensor's shape: element ``i`` of ``lo`` / ``hi`` is column ``c(i)`` of
    the group with ``lo = (c0, c1, c4, c5)`` and ``hi = (c2, c3, c6, c7)``, times ``2**-14``.

    Unlike a true elementwise op, each output reads all four bytes of its instance: this relies on
    Triton packing four consecutive, 4-aligned bytes of a row per instance, which the row tiles'
    vectorised loads (16 or more bytes per thread along K) give only under the conditions of
    ``ops._asm_decode`` (elsewhere :func:`_e2m1_pairs` runs). Checked on the H200 for every
    config the tuned table holds (conformance suite, tests, the benchmark's reference check).

    ``DT = tl.bfloat16``: bfloat16 pairs instead, each the E2M1 value times ``2**-126`` (eem on
    bits 8..6, bfloat16's two lowest exponent bits and top mantissa bit, and s on bit 15 of each
    half), 13 operations per 8 codes from the same packed layout."""
    if DT == tl.bfloat16:
        asm: tl.constexpr = """
        {
        .reg .b32 t<4>;
        shr.b32 t0, $4, 3;
        and.b32 t1, $4, 0x80008000;
        lop3.b32 $0, t0, 0x01C001C0, t1, 0xEA;
        shl.b32 t2, $4, 3;
        and.b32 t1, t2, 0x80008000;
        lop3.b32 $1, $4, 0x01C001C0, t1, 0xEA;
        shl.b32 t0, $4, 6;
        shl.b32 t1, $4, 2;
        and.b32 t1, t1, 0x80008000;
        lop3.b32 $2, t0, 0x01C001C0, t1, 0xEA;
        shl.b32 t3, $4, 1;
        and.b32 t3, t3, 0x80008000;
        lop3.b32 $3, t2, 0x01C001C0, t3, 0xEA;
        }
        """
    else:
        asm: tl.constexpr = """
        {
        .reg .b32 t<4>;
        and.b32 $0, $4, 0x8E008E00;
        shl.b32 t0, $4, 3;
        and.b32 $1, t0, 0x8E008E00;
        shl.b32 t0, $4, 9;
        shl.b32 t1, $4, 2;
        and.b32 t1, t1, 0x80008000;
        lop3.b32 $2, t0, 0x0E000E00, t1, 0xEA;
        shl.b32 t2, $4, 6;
        shl.b32 t3, $4, 1;
        and.b32 t3, t3, 0x80008000;
        lop3.b32 $3, t2, 0x0E000E00, t3, 0xEA;
        }
        """
    lo, hi = tl.inline_asm_elementwise(asm=asm, constraints="=r,=r,=r,=r,r", args=[packed],
                                       dtype=(DT.value, DT.value), is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _int16_halves(r):
    return r.to(tl.int16), (r >> 16).to(tl.int16)


@triton.jit
def _e2m1_pairs(packed, BLOCK_N: tl.constexpr, BYTES: tl.constexpr,
                DT: tl.constexpr = tl.float16):
    """Portable form of :func:`_e2m1_pairs_asm` (the interpreter runs no inline assembly):
    ``packed [BLOCK_N, BYTES]`` bytes, regrouped into 32-bit words explicitly."""
    b = tl.reshape(packed.to(tl.int32) & 0xFF, (BLOCK_N, BYTES // 4, 4))
    sh = tl.arange(0, 4) * 8
    w = tl.sum(b << sh[None, None, :], axis=2)  # the group's 32-bit word (bytes little-endian)
    if DT == tl.bfloat16:
        # eem on bits 8..6, s on bit 15 of each half (``>>`` is arithmetic: masked after)
        r0 = ((w >> 3) & 0x01C001C0) | (w & -2147450880)  # 0x80008000
        r1 = (w & 0x01C001C0) | ((w << 3) & -2147450880)
        r2 = ((w << 6) & 0x01C001C0) | ((w << 2) & -2147450880)
        r3 = ((w << 3) & 0x01C001C0) | ((w << 1) & -2147450880)
    else:
        r0 = w & -1912566272  # 0x8E008E00
        r1 = (w << 3) & -1912566272
        r2 = ((w << 9) & 0x0E000E00) | ((w << 2) & -2147450880)  # 0x80008000
        r3 = ((w << 6) & 0x0E000E00) | ((w << 1) & -2147450880)
    r0l, r0h = _int16_halves(r0)
    r1l, r1h = _int16_halves(r1)
    r2l, r2h = _int16_halves(r2)
    r3l, r3h = _int16_halves(r3)
    # join appends the new axis last: [.., half, register] -> register-major order
    lo = tl.permute(tl.join(tl.join(r0l, r0h), tl.join(r1l, r1h)), (0, 1, 3, 2))
    hi = tl.permute(tl.join(tl.join(r2l, r2h), tl.join(r3l, r3h)), (0, 1, 3, 2))
    lo = tl.reshape(lo, (BLOCK_N, BYTES))
    hi = tl.reshape(hi, (BLOCK_N, BYTES))
    return lo.to(DT, bitcast=True), hi.to(DT, bitcast=True)


@triton.jit
def _scale_codes(vals, sbytes, DT: tl.constexpr):
    """Decoded codes ``vals [R, G, 16]`` (:func:`_e2m1_pairs` of ``DT``) times their e4m3 block
    scales ``sbytes [R, G]`` (bytes), as ``DT``: ``E2M1 * block_scale * 2**-7`` either way, exact.

    float16: codes are ``E2M1 * 2**-14`` and the scale ``block_scale * 2**7`` (<= 57344 fits).
    bfloat16: codes are ``E2M1 * 2**-126`` (0.5 a subnormal) and the scale ``block_scale *
    2**119`` (<= 448 * 2**119, below bfloat16's largest 2**128); the product (at most 6
    significant bits, at least 2**-18) is exact. It runs as ``fma.rn.bf16x2`` with -0.0 (sm_80+,
    subnormal operands kept) rather than through whatever Triton makes of a bfloat16 multiply;
    the interpreter runs no assembly, so callers take float16 there."""
    if DT == tl.bfloat16:
        s = sbytes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 6.646139978924579e+35
        s = tl.broadcast_to(s.to(tl.bfloat16)[:, :, None], vals.shape)
        w = tl.inline_asm_elementwise(
            asm="{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $1, $2, z; }",
            constraints="=r,r,r", args=[vals, s], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        scale = sbytes.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 128.0
        w = vals * scale[:, :, None]
    return w


@triton.jit
def _dequant_nvfp4_tile(w_ptr, ws_ptr, row_off, srow_off, k0, K, n_mask, EVEN_K: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr,
                        DT: tl.constexpr = tl.float16):
    """``BLOCK_N`` rows (starting at element offsets ``row_off`` of the packed bytes and
    ``srow_off`` of the scales), columns ``[k0, k0 + BLOCK_K)`` of NVFP4 matrices as ``DT``
    (float16 or bfloat16) ``[BLOCK_N, BLOCK_K]``: ``E2M1 * block_scale * 2**-7`` (exact in both,
    :func:`_scale_codes`); callers multiply their accumulator by ``2**7 * scale_2``. ``w_ptr`` points at the
    packed bytes (``[rows, K / 2]``, laid out by :func:`ops.pack_nvfp4_for_kernels`), ``ws_ptr`` at
    the e4m3 block scales (``[rows, K / 16]``)."""
    offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    ptrs = w_ptr + row_off[:, None] + offs_kb[None, :]
    if EVEN_K:
        wb = tl.load(ptrs, mask=n_mask[:, None], other=0)
    else:
        wb = tl.load(ptrs, mask=n_mask[:, None] & (offs_kb[None, :] < K // 2), other=0)
    if USE_ASM:  # only where the layout holds four bytes of a row per thread: ops._asm_decode
        lo, hi = _e2m1_pairs_asm(wb, DT)
    else:
        lo, hi = _e2m1_pairs(wb, BLOCK_N, BLOCK_K // 2, DT)
    # per 4-byte group: lo = columns (0, 1, 4, 5), hi = (2, 3, 6, 7); interleaving pairs of each
    # puts the columns in order, with adjacent columns in one register as the MMA operand wants
    lo2 = tl.reshape(lo, (BLOCK_N, BLOCK_K // 4, 2))
    hi2 = tl.reshape(hi, (BLOCK_N, BLOCK_K // 4, 2))
    vals = tl.permute(tl.join(lo2, hi2), (0, 1, 3, 2))
    vals = tl.reshape(vals, (BLOCK_N, BLOCK_K // 16, 16))
    offs_ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    sptrs = ws_ptr + srow_off[:, None] + offs_ks[None, :]
    if EVEN_K:
        sbytes = tl.load(sptrs, mask=n_mask[:, None], other=0)
    else:
        sbytes = tl.load(sptrs, mask=n_mask[:, None] & (offs_ks[None, :] < K // 16), other=0)
    return tl.reshape(_scale_codes(vals, sbytes, DT), (BLOCK_N, BLOCK_K))


@triton.jit
def _load_b_tile(
    w_ptr, ws_ptr, w_base, ws_base, offs_n, k0, K,
    stride_wn, stride_wsn,
    n_mask, WFMT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, compute_dtype: tl.constexpr, USE_ASM: tl.constexpr,
):
    """Tile ``[BLOCK_K, BLOCK_N]`` of ``W^T`` rows ``offs_n`` (``W [rows, K]``, K contiguous)."""
    if WFMT == 2:
        w = _dequant_nvfp4_tile(w_ptr, ws_ptr, w_base + offs_n * stride_wn,
                                ws_base + offs_n * stride_wsn, k0, K, n_mask, EVEN_K, BLOCK_N,
                                BLOCK_K, USE_ASM, compute_dtype)
        return tl.trans(w)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ptrs = w_ptr + w_base + offs_k[:, None] + offs_n[None, :] * stride_wn
        if EVEN_K:
            return tl.load(ptrs, mask=n_mask[None, :], other=0.0)
        else:
            return tl.load(ptrs, mask=n_mask[None, :] & (offs_k[:, None] < K), other=0.0)


@triton.jit
def _quant_fp8(x, scale, inv_scale, EXACT: tl.constexpr):
    """float8 e4m3 of ``x / scale``, saturated to +-448.

    ``EXACT`` (the interpreter, whose float8 conversion mis-rounds some values): an exact division
    and a rounding to the e4m3 grid in float32 first, so the conversion itself is exact. On GPUs
    the hardware conversion rounds to nearest even and the reciprocal is used.
    """
    if EXACT:
        q = tl.math.div_rn(x.to(tl.float32), tl.zeros_like(x.to(tl.float32)) + scale)
        q = tl.clamp(q, -448.0, 448.0)
        exp = (q.to(tl.int32, bitcast=True) >> 23) & 255
        step_exp = tl.maximum(exp, 121) - 3
        step = (step_exp << 23).to(tl.float32, bitcast=True)
        inv_step = ((254 - step_exp) << 23).to(tl.float32, bitcast=True)
        r = (q * inv_step + 12582912.0) - 12582912.0
        return (r * step).to(tl.float8e4nv)
    else:
        return tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0).to(tl.float8e4nv)


# ----------------------------------------------------------------------------------------------
# GEMM 1: gather + (gate, up) + act-and-mul
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["P", "E", "num_m_blocks", "topk"])
def moe_gemm1_kernel(
    x_ptr, w_ptr, ws_ptr, ws2_ptr, a_scale_ptr, a2_scale_ptr, inter_ptr,
    sorted_ptr, bexp_ptr,
    P, E, H, I, num_m_blocks, topk,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_im,
    WFMT: tl.constexpr, A_QUANT: tl.constexpr, OUT_FP8: tl.constexpr, ACT: tl.constexpr,
    EVEN_K: tl.constexpr, EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    compute_dtype: tl.constexpr, USE_ASM: tl.constexpr = False,
):
    """``inter[row, n] = act(x[tok] @ w13[e, n]) * (x[tok] @ w13[e, I + n])`` for sorted rows.

    ``A_QUANT``: 0 = ``x`` is in the compute dtype; 1 = ``x`` is fp8 already (scale
    ``a_scale``); 2 = ``x`` is 16-bit and is quantized to fp8 here with ``a_scale``.
    """
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(I, BLOCK_N)
    pid_m, pid_n = _tile_coords(pid, num_m_blocks, num_n_blocks, GROUP_M)
    row0 = pid_m * BLOCK_M
    e = tl.load(bexp_ptr + pid_m)
    if e < 0:
        return

    offs_m = row0 + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    row_valid = pair < P
    tok = tl.where(row_valid, pair // topk, 0).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]

    e64 = e.to(tl.int64)
    w_base_g = e64 * stride_we
    w_base_u = w_base_g + I * stride_wn
    ws_base_g = e64 * stride_wse
    ws_base_u = ws_base_g + I * stride_wsn

    if WFMT == 1:
        a_scale = tl.load(a_scale_ptr)
        inv_a = 1.0 / a_scale

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(H, BLOCK_K)):
        k0 = kb * BLOCK_K
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_valid[:, None], other=0.0)
        else:
            a = tl.load(x_ptrs, mask=row_valid[:, None] & (offs_k[None, :] < H - k0), other=0.0)
        if A_QUANT == 2:
            a = _quant_fp8(a, a_scale, inv_a, EXACT)
        if A_QUANT == 0:
            a = a.to(compute_dtype)
        b_g = _load_b_tile(w_ptr, ws_ptr, w_base_g, ws_base_g, offs_n, k0, H, stride_wn,
                           stride_wsn, n_mask, WFMT, EVEN_K, BLOCK_N, BLOCK_K, compute_dtype, USE_ASM)
        b_u = _load_b_tile(w_ptr, ws_ptr, w_base_u, ws_base_u, offs_n, k0, H, stride_wn,
                           stride_wsn, n_mask, WFMT, EVEN_K, BLOCK_N, BLOCK_K, compute_dtype, USE_ASM)
        acc_g = tl.dot(a, b_g, acc_g)
        acc_u = tl.dot(a, b_u, acc_u)
        x_ptrs += BLOCK_K

    if WFMT == 1:
        sg = tl.load(ws_ptr + ws_base_g + offs_n * stride_wsn, mask=n_mask, other=0.0)
        su = tl.load(ws_ptr + ws_base_u + offs_n * stride_wsn, mask=n_mask, other=0.0)
        acc_g = acc_g * (sg * a_scale)[None, :]
        acc_u = acc_u * (su * a_scale)[None, :]
    if WFMT == 2:
        s2 = tl.load(ws2_ptr + e) * 128.0
        acc_g = acc_g * s2
        acc_u = acc_u * s2
    if ACT == 0:
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    else:
        h = 0.5 * acc_g * (1.0 + tl.erf(acc_g * 0.7071067811865476)) * acc_u

    i_ptrs = inter_ptr + offs_m.to(tl.int64)[:, None] * stride_im + offs_n[None, :]
    i_mask = n_mask[None, :]
    if OUT_FP8:
        a2 = tl.load(a2_scale_ptr)
        tl.store(i_ptrs, _quant_fp8(h, a2, 1.0 / a2, EXACT), mask=i_mask)
    else:
        tl.store(i_ptrs, h.to(inter_ptr.dtype.element_ty), mask=i_mask)


# ----------------------------------------------------------------------------------------------
# GEMM 2: (sorted rows) x w2 * routing weight -> per-pair rows
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["P", "E", "num_m_blocks"])
def moe_gemm2_kernel(
    inter_ptr, w_ptr, ws_ptr, ws2_ptr, a2_scale_ptr, topk_w_ptr, y_ptr,
    sorted_ptr, bexp_ptr,
    P, E, H, I, num_m_blocks,
    stride_im, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
    WFMT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    compute_dtype: tl.constexpr, USE_ASM: tl.constexpr = False,
):
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(H, BLOCK_N)
    pid_m, pid_n = _tile_coords(pid, num_m_blocks, num_n_blocks, GROUP_M)
    row0 = pid_m * BLOCK_M
    e = tl.load(bexp_ptr + pid_m)
    if e < 0:
        return

    offs_m = row0 + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    row_valid = pair < P

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + offs_m.to(tl.int64)[:, None] * stride_im + offs_k[None, :]
    e64 = e.to(tl.int64)
    w_base = e64 * stride_we
    ws_base = e64 * stride_wse

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(I, BLOCK_K)):
        k0 = kb * BLOCK_K
        # Padding rows of the intermediate were written too (finite), no row mask needed.
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < I - k0, other=0.0)
        b = _load_b_tile(w_ptr, ws_ptr, w_base, ws_base, offs_n, k0, I, stride_wn, stride_wsn,
                         n_mask, WFMT, EVEN_K, BLOCK_N, BLOCK_K, compute_dtype, USE_ASM)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K

    if WFMT == 1:
        s = tl.load(ws_ptr + ws_base + offs_n * stride_wsn, mask=n_mask, other=0.0)
        acc = acc * (s * tl.load(a2_scale_ptr))[None, :]
    if WFMT == 2:
        acc = acc * (tl.load(ws2_ptr + e) * 128.0)
    rw = tl.load(topk_w_ptr + pair, mask=row_valid, other=0.0).to(tl.float32)
    acc = acc * rw[:, None]
    y_ptrs = y_ptr + tl.where(row_valid, pair, 0).to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_valid[:, None] & n_mask[None, :])


# ----------------------------------------------------------------------------------------------
# Finalize and activation quantization
# ----------------------------------------------------------------------------------------------


@triton.jit
def moe_finalize_kernel(y_ptr, ids_ptr, out_ptr, H, E, stride_ym, stride_om,
                        TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        p = t * TOPK + k
        e = tl.load(ids_ptr + p + tl.zeros([BLOCK_H], dtype=tl.int32))
        ok = hmask & (e >= 0) & (e < E)
        v = tl.load(y_ptr + p.to(tl.int64) * stride_ym + offs, mask=ok, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs, acc.to(out_ptr.dtype.element_ty),
             mask=hmask)


@triton.jit
def quant_fp8_kernel(x_ptr, q_ptr, scale_ptr, numel, BLOCK: tl.constexpr, EXACT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    sc = tl.load(scale_ptr)
    tl.store(q_ptr + offs, _quant_fp8(x, sc, 1.0 / sc, EXACT), mask=m)


# ----------------------------------------------------------------------------------------------
# Decode path: a handful of tokens, no routing kernels and no finalize
# ----------------------------------------------------------------------------------------------
#
# With a few (token, expert) pairs the MMA tiles are mostly padding and the four launches of the
# sorted path (route, GEMM 1, GEMM 2, finalize) cost more than the weights take to read. Two
# kernels instead: GEMM 1 per pair (its expert read from ``topk_ids`` directly), and GEMM 2 per
# token that walks the token's experts in order and sums their routing-weighted outputs in
# registers (deterministic; no atomics). Both reduce on the CUDA cores, in float32.


@triton.jit
def _decode_w_tile(w_ptr, ws_ptr, row_base, ws_base, offs_n, k0, K, stride_wn, stride_wsn, n_mask,
                   WFMT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr):
    """Rows ``offs_n`` x columns ``[k0, k0 + BLOCK_K)`` of one expert's matrix in float32, up to
    the per-row (fp8) or per-matrix (nvfp4) scale applied by the caller."""
    if WFMT == 2:
        w = _dequant_nvfp4_tile(w_ptr, ws_ptr, row_base + offs_n * stride_wn,
                                ws_base + offs_n * stride_wsn, k0, K, n_mask, EVEN_K, BLOCK_N,
                                BLOCK_K, USE_ASM)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ptrs = w_ptr + row_base + offs_n[:, None] * stride_wn + offs_k[None, :]
        if EVEN_K:
            w = tl.load(ptrs, mask=n_mask[:, None], other=0.0)
        else:
            w = tl.load(ptrs, mask=n_mask[:, None] & (offs_k[None, :] < K), other=0.0)
    return w.to(tl.float32)


@triton.jit(do_not_specialize=["P", "E", "topk"])
def moe_decode_gemm1_kernel(
    x_ptr, ids_ptr, w_ptr, ws_ptr, ws2_ptr, a_scale_ptr, a2_scale_ptr, inter_ptr,
    P, E, H, I, topk,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_im,
    WFMT: tl.constexpr, A_QUANT: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr,
    EXACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr,
):
    """``inter[pair, n] = act(x[tok] . w13[e, n]) * (x[tok] . w13[e, I + n])`` in float32 (fp8:
    the activation quantization of W8A8 applied to ``x`` and, with ``a2_scale``, to the result).
    ``A_QUANT`` as in :func:`moe_gemm1_kernel` (1: ``x`` holds fp8 codes of scale ``a_scale``)."""
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int32)
    if (e < 0) | (e >= E):
        return
    tok = (pair // topk).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    e64 = e.to(tl.int64)
    base_g = e64 * stride_we
    base_u = base_g + I * stride_wn
    sbase_g = e64 * stride_wse
    sbase_u = sbase_g + I * stride_wsn
    if WFMT == 1:
        a_scale = tl.load(a_scale_ptr)
        inv_a = 1.0 / a_scale
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + tok * stride_xm + offs_k)
        else:
            x = tl.load(x_ptr + tok * stride_xm + offs_k, mask=offs_k < H, other=0.0)
        if A_QUANT == 2:
            x = _quant_fp8(x, a_scale, inv_a, EXACT)
        x = x.to(tl.float32)
        wg = _decode_w_tile(w_ptr, ws_ptr, base_g, sbase_g, offs_n, k0, H, stride_wn, stride_wsn,
                            n_mask, WFMT, EVEN_K, BLOCK_N, BLOCK_K, USE_ASM)
        wu = _decode_w_tile(w_ptr, ws_ptr, base_u, sbase_u, offs_n, k0, H, stride_wn, stride_wsn,
                            n_mask, WFMT, EVEN_K, BLOCK_N, BLOCK_K, USE_ASM)
        acc_g += tl.sum(wg * x[None, :], axis=1)
        acc_u += tl.sum(wu * x[None, :], axis=1)
    if WFMT == 1:
        acc_g = acc_g * tl.load(ws_ptr + sbase_g + offs_n * stride_wsn, mask=n_mask, other=0.0) * a_scale
        acc_u = acc_u * tl.load(ws_ptr + sbase_u + offs_n * stride_wsn, mask=n_mask, other=0.0) * a_scale
    if WFMT == 2:
        s2 = tl.load(ws2_ptr + e) * 128.0
        acc_g = acc_g * s2
        acc_u = acc_u * s2
    if ACT == 0:
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    else:
        h = 0.5 * acc_g * (1.0 + tl.erf(acc_g * 0.7071067811865476)) * acc_u
    if WFMT == 1:
        a2 = tl.load(a2_scale_ptr)
        h = _quant_fp8(h, a2, 1.0 / a2, EXACT).to(tl.float32)
    tl.store(inter_ptr + pair.to(tl.int64) * stride_im + offs_n, h, mask=n_mask)


@triton.jit(do_not_specialize=["E"])
def moe_decode_gemm2_kernel(
    inter_ptr, ids_ptr, topk_w_ptr, w_ptr, ws_ptr, ws2_ptr, a2_scale_ptr, out_ptr,
    E, H, I,
    stride_im, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    TOPK: tl.constexpr, WFMT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr,
):
    """``out[t, n] = sum_k rw[t, k] * (inter[t * TOPK + k] . w2[e_k, n])`` over the token's valid
    experts. All of a token's experts are read in the same iteration (rows ``slot * BLOCK_N + j``
    of one tile): with one token the grid is only ``H / BLOCK_N`` programs, and walking the experts
    one after another would leave too few bytes in flight per SM."""
    SLOTS: tl.constexpr = triton.next_power_of_2(TOPK)
    R: tl.constexpr = SLOTS * BLOCK_N
    t = tl.program_id(0)
    slot = tl.arange(0, SLOTS)
    p = t * TOPK + slot
    e = tl.load(ids_ptr + p, mask=slot < TOPK, other=-1).to(tl.int32)
    ok = (slot < TOPK) & (e >= 0) & (e < E)
    e64 = tl.where(ok, e, 0).to(tl.int64)
    coef = tl.where(ok, tl.load(topk_w_ptr + p, mask=ok, other=0.0).to(tl.float32), 0.0)
    if WFMT == 1:
        coef = coef * tl.load(a2_scale_ptr)
    if WFMT == 2:
        coef = coef * tl.load(ws2_ptr + e64, mask=ok, other=0.0) * 128.0

    r = tl.arange(0, R)
    r_slot = r // BLOCK_N
    offs_n = tl.program_id(1) * BLOCK_N + r % BLOCK_N
    r_p = t * TOPK + r_slot
    r_e = tl.load(ids_ptr + r_p, mask=r_slot < TOPK, other=-1).to(tl.int32)
    r_ok = (r_slot < TOPK) & (r_e >= 0) & (r_e < E) & (offs_n < H)
    r_e64 = tl.where(r_ok, r_e, 0).to(tl.int64)
    row_off = r_e64 * stride_we + offs_n * stride_wn
    srow_off = r_e64 * stride_wse + offs_n * stride_wsn
    h_off = r_p.to(tl.int64) * stride_im

    part = tl.zeros((R,), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            h = tl.load(inter_ptr + h_off[:, None] + offs_k[None, :], mask=r_ok[:, None], other=0.0)
        else:
            h = tl.load(inter_ptr + h_off[:, None] + offs_k[None, :],
                        mask=r_ok[:, None] & (offs_k[None, :] < I), other=0.0)
        if WFMT == 2:
            w = _dequant_nvfp4_tile(w_ptr, ws_ptr, row_off, srow_off, k0, I, r_ok, EVEN_K, R,
                                    BLOCK_K, USE_ASM)
        else:
            wp = w_ptr + row_off[:, None] + offs_k[None, :]
            if EVEN_K:
                w = tl.load(wp, mask=r_ok[:, None], other=0.0)
            else:
                w = tl.load(wp, mask=r_ok[:, None] & (offs_k[None, :] < I), other=0.0)
        part += tl.sum(w.to(tl.float32) * h.to(tl.float32), axis=1)
    if WFMT == 1:
        part = part * tl.load(ws_ptr + srow_off, mask=r_ok, other=0.0)
    contrib = tl.reshape(part, (SLOTS, BLOCK_N)) * coef[:, None]
    acc = tl.sum(contrib, axis=0)
    offs_o = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs_o, acc.to(out_ptr.dtype.element_ty),
             mask=offs_o < H)


# ----------------------------------------------------------------------------------------------
# Masked layout: rows already grouped by expert
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M", "Mp", "E"])
def route_masked_kernel(masked_m_ptr, sorted_ptr, bexp_ptr, M, Mp, E,
                        BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """Sorted order of a masked batch ``hidden [E, M, H]``: expert ``e`` owns rows
    ``[e * Mp, (e + 1) * Mp)`` (``Mp`` = ``M`` rounded up to ``BLOCK_M``); row ``e * Mp + j`` is
    pair ``e * M + j`` if ``j < masked_m[e]``, else padding (``E * M``). Row blocks past an
    expert's count get -1 in ``bexp`` so that the GEMMs skip them."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rmask = offs < E * Mp
    e = offs // Mp
    j = offs % Mp
    cnt = tl.load(masked_m_ptr + e, mask=rmask, other=0).to(tl.int32)
    cnt = tl.minimum(tl.maximum(cnt, 0), M)
    valid = j < cnt
    tl.store(sorted_ptr + offs, tl.where(valid, e * M + j, E * M), mask=rmask)
    start = rmask & (offs % BLOCK_M == 0)
    tl.store(bexp_ptr + offs // BLOCK_M, tl.where(valid, e, -1), mask=start)


# ----------------------------------------------------------------------------------------------
# Torch grouped GEMM path: the kernels around torch's grouped GEMMs (ops._torch_grouped_path)
# ----------------------------------------------------------------------------------------------
#
# Rows are (token, expert) pairs sorted by expert, unpadded; ``n_ptr`` holds the number of valid
# rows (the last of the offsets the grouped GEMMs take), rows past it are never written or read.


@triton.jit(do_not_specialize=["P"])
def gather_rows_kernel(x_ptr, order_ptr, n_ptr, out_ptr, scale_ptr, P, H, stride_xm, stride_om,
                       TOPK: tl.constexpr, QUANT: tl.constexpr, EXACT: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[r] = x[order[r] // TOPK]`` for the valid rows, quantized to fp8 with ``scale`` when
    ``QUANT``."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    n = tl.load(n_ptr)
    rmask = (rows < P) & (rows < n)
    pair = tl.load(order_ptr + rows, mask=rmask, other=0)
    tok = (pair // TOPK).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = rmask[:, None] & (offs < H)[None, :]
    v = tl.load(x_ptr + tok[:, None] * stride_xm + offs[None, :], mask=m, other=0.0)
    if QUANT:
        sc = tl.load(scale_ptr)
        v = _quant_fp8(v, sc, 1.0 / sc, EXACT)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs[None, :],
             v.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["P"])
def act_mul_kernel(gu_ptr, h_ptr, n_ptr, scale_ptr, P, I, stride_gm, stride_hm,
                   ACT: tl.constexpr, OUT_FP8: tl.constexpr, EXACT: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK_I: tl.constexpr):
    """``h[r, i] = act(gu[r, i]) * gu[r, I + i]`` in float32 for the valid rows (quantized to fp8
    with ``scale`` when ``OUT_FP8``)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    n = tl.load(n_ptr)
    rmask = (rows < P) & (rows < n)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    m = rmask[:, None] & (offs < I)[None, :]
    g_ptrs = gu_ptr + rows.to(tl.int64)[:, None] * stride_gm + offs[None, :]
    g = tl.load(g_ptrs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + I, mask=m, other=0.0).to(tl.float32)
    if ACT == 0:
        h = g / (1.0 + tl.exp(-g)) * u
    else:
        h = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476)) * u
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + offs[None, :]
    if OUT_FP8:
        sc = tl.load(scale_ptr)
        tl.store(h_ptrs, _quant_fp8(h, sc, 1.0 / sc, EXACT), mask=m)
    else:
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def combine_sorted_kernel(y_ptr, pos_ptr, ids_ptr, w_ptr, out_ptr, H, E, stride_ym, stride_om,
                          TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[t] = sum_k w[t, k] * y[pos[t * TOPK + k]]`` over the valid ``k``, in that order, in
    float32 (deterministic); ``pos`` is the sorted row of each pair."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    zero = tl.zeros([BLOCK_H], dtype=tl.int32)
    for k in tl.static_range(TOPK):
        p = t * TOPK + k
        e = tl.load(ids_ptr + p + zero)
        ok = hmask & (e >= 0) & (e < E)
        row = tl.load(pos_ptr + p + zero, mask=ok, other=0).to(tl.int64)
        wt = tl.load(w_ptr + p + zero, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(y_ptr + row * stride_ym + offs, mask=ok, other=0.0)
        acc += tl.where(ok, v.to(tl.float32) * wt, 0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs, acc.to(out_ptr.dtype.element_ty),
             mask=hmask)
