"""The experts backend class (imported only when the planner selects ``humming``).

A forward is: routing (no host sync, so CUDA-graph capturable: the triton plugin's routing
kernels where it is installed, :func:`triton_router`, one or two launches; else torch ops, one
sort of the pairs by expert, :func:`sort_pairs`, padded per projection's block size,
:func:`place_pairs`, about ten launches), Humming's indexed GEMM over ``w13``, its gated activation
(``process_input``), the indexed GEMM over ``w2``, and the combine (a batched matmul with the
routing weights). Humming fixes a tile config per range of row counts before its kernels are
compiled; ``prepare`` plans and compiles them once for every power of two of (token, k) pairs, so
no forward compiles, and makes the index ranges the routing slices per forward.
"""

from __future__ import annotations

import json

import attrs
import torch

from moe_runtime import formats as F
from moe_runtime.backend_api import Dispatched, ExpertsBackend, ExpertWeights
from moe_runtime.dtypes import torch_dtype
from moe_runtime_humming.plugin import HUMMING_EXPERTS

COMPUTE = json.dumps({"gemm_type": "indexed"})
# Humming's process_input takes the gated activation as CUDA source over a (gate) and b (up)
ACTIVATIONS = {
    F.SILU: "a / (1.0f + __expf(-a)) * b",
    F.GELU: "0.5f * a * (1.0f + erff(a * 0.70710678118654752f)) * b",
}
PLANNED_PAIRS = tuple(1 << i for i in range(18))  # 1 .. 131072 (token, k) pairs per forward


def max_sorted_rows(pairs: int, experts: int, block_m: int) -> int:
    """Rows of the padded sorted order: every pair, plus up to ``block_m - 1`` padding rows for each
    expert that can be non-empty (at most ``min(pairs, experts)``), in whole blocks."""
    rows = pairs + min(pairs, experts) * (block_m - 1)
    return max(block_m, -(-rows // block_m) * block_m)


@attrs.frozen
class SortedPairs:
    """The half of routing that does not depend on the block size: (token, k) pairs sorted by
    expert. ``bucket [P]`` int64 is each pair's expert, ``experts`` for ids outside
    ``[0, experts)``; ``sorted_bucket``/``order`` the stable sort of it (``order`` int32);
    ``counts [E + 1]`` the pairs per bucket; ``rank [P]`` each sorted pair's place in its
    bucket."""

    pairs: int
    experts: int
    bucket: torch.Tensor
    sorted_bucket: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor
    rank: torch.Tensor


def _prefix(cached: torch.Tensor | None, n: int, device) -> torch.Tensor:
    """``arange(n)``: a view of ``cached`` where it is long enough (no launch), else a new one."""
    if cached is not None and cached.numel() >= n:
        return cached[:n]
    return torch.arange(n, device=device)


def sort_pairs(topk_ids: torch.Tensor, experts: int, arange: torch.Tensor | None = None
               ) -> SortedPairs:
    """Sort the pairs of ``topk_ids [N, K]`` by expert (torch ops sized from shapes, no host
    sync). ``arange``: a cached int64 ``arange`` on the device, sliced instead of made."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    # ids below 0 clamp to -1 and above to `experts`; the remainder maps -1 to `experts` too
    bucket = flat.to(torch.int64).clamp(-1, experts).remainder_(experts + 1)
    sorted_bucket, order = torch.sort(bucket, stable=True)
    index = _prefix(arange, max(pairs, experts + 2), flat.device)
    first = torch.searchsorted(sorted_bucket, index[:experts + 2])  # first sorted row per bucket
    rank = index[:pairs] - first[sorted_bucket]
    return SortedPairs(pairs, experts, bucket, sorted_bucket, order.to(torch.int32), first.diff(),
                       rank)


def place_pairs(sp: SortedPairs, block_m: int, block_starts: torch.Tensor | None = None):
    """The indexed-GEMM order of sorted pairs for ``block_m``-row blocks: ``(sorted_ids,
    block_experts, padded_rows)`` as :func:`route` returns them. ``block_starts``: a cached
    ``arange * block_m`` on the device, sliced instead of made."""
    experts, pairs = sp.experts, sp.pairs
    dev = sp.bucket.device
    rows = max_sorted_rows(pairs, experts, block_m)
    padded = (sp.counts + (block_m - 1)).div_(block_m, rounding_mode="floor").mul_(block_m)
    ends = padded.cumsum(0)  # [E + 1]; the last (pairs not computed here) is not used
    starts = ends - padded
    # pairs not computed here go to a spare region after the rows; fill_, not `starts[e] = rows`:
    # on CUDA that assignment copies a pageable host scalar, which a CUDA-graph capture refuses
    starts[experts:].fill_(rows)
    dest = starts[sp.sorted_bucket].add_(sp.rank)
    sorted_ids = torch.full((rows + pairs,), pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, sp.order)
    blocks = rows // block_m
    if block_starts is not None and block_starts.numel() >= blocks:
        first_rows = block_starts[:blocks]
    else:
        first_rows = torch.arange(blocks, device=dev) * block_m
    block_experts = torch.searchsorted(ends[:experts], first_rows, right=True, out_int32=True)
    block_experts = torch.where(block_experts < experts, block_experts, -1)
    padded_rows = (ends[experts - 1].to(torch.int32) if experts
                   else torch.zeros((), dtype=torch.int32, device=dev))
    return sorted_ids[:rows], block_experts, padded_rows


def route(topk_ids: torch.Tensor, experts: int, block_m: int):
    """The indexed-GEMM order of ``topk_ids [N, K]`` (``-1`` or ids outside ``[0, experts)``: not
    computed here).

    Returns ``(sorted_ids, block_experts, padded_rows)``: ``sorted_ids [R]`` int32 holds the flat
    pair index (``n * K + k``) of each row, rows grouped by expert in expert order, each expert's
    group padded to a multiple of ``block_m`` with ``N * K``; ``block_experts [R / block_m]``
    int32 the expert of each block (``-1`` past the used blocks); ``padded_rows`` a 0-dim int32
    tensor, the rows in use. Only torch ops sized from shapes (:func:`sort_pairs`, then
    :func:`place_pairs`)."""
    return place_pairs(sort_pairs(topk_ids, experts), block_m)


def triton_router():
    """The triton plugin's routing ops (``moe_runtime_triton.ops``) when it is installed, else
    ``None``. Same order as :func:`route` up to the order of pairs within an expert's rows (its
    kernels count with atomics); ``benchmarks/humming_peer.py`` fed Humming from them on the H200,
    twice as fast at one token as the torch ops here (40.8 against 85.3 us)."""
    try:
        from moe_runtime_triton import ops
    except Exception:  # not installed, or its kernels cannot load here: the torch routing
        return None
    return ops


def route_with(ops, topk_ids: torch.Tensor, experts: int, block_m: int):
    """:func:`route`'s ``(sorted_ids, block_experts, padded_rows)`` from the triton plugin's
    routing kernels (``ops`` as :func:`triton_router` returns it); ids of ``-1`` are not
    computed here."""
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    rows = ops.max_sorted_rows(ids.numel(), experts, block_m)
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(rows // block_m, dtype=torch.int32, device=ids.device)
    ops.route_into(ids, experts, block_m, sorted_ids, block_experts)
    padded_rows = (block_experts >= 0).sum(dtype=torch.int32) * block_m
    return sorted_ids, block_experts, padded_rows


_INDEX_CACHE: dict[tuple, torch.Tensor] = {}


def cached_index(n: int, device, step: int = 1) -> torch.Tensor:
    """``arange(n) * step`` on ``device``, made once per process (at ``prepare``, never inside a
    CUDA-graph capture) and shared by every layer: read only."""
    key = (n, str(device), step)
    if key not in _INDEX_CACHE:
        _INDEX_CACHE[key] = torch.arange(n, device=device) * step
    return _INDEX_CACHE[key]


class _Projection:
    """One projection of all local experts as a Humming indexed-GEMM layer, a tile config per
    range of row counts."""

    def __init__(self, weight, scale, scale_2, dtype):
        from humming.layer import HummingLayer

        experts, n, k_half = weight.shape
        with torch.device(weight.device):
            layer = HummingLayer(shape_n=n, shape_k=k_half * 2,
                                 weight_config={"quant_method": "modelopt", "quant_algo": "NVFP4"},
                                 num_experts=experts, torch_dtype=dtype)
        layer.load_from_tensors({"weight": weight.contiguous(),
                                 "weight_scale": scale.contiguous(),
                                 "weight_scale_2": scale_2.float().reshape(experts).contiguous()})
        layer.transform()
        self.layer = layer
        self.intervals: list[list] = []
        self.tuning = ""

    def plan_and_compile(self, row_counts) -> None:
        from humming.kernel.humming import HummingKernel
        from humming.tune import get_heuristics_config

        dev = self.layer.locks.device
        lo = 0
        ms = sorted(set(int(m) for m in row_counts))
        for i, m in enumerate(ms):
            cfg = dict(get_heuristics_config(self.layer.humming_config, shape_m=m,
                                             gemm_type="indexed", device=dev))
            hi = (1 << 40) if i == len(ms) - 1 else m
            if self.intervals and self.intervals[-1][2] == cfg:
                self.intervals[-1][1] = hi
            else:
                self.intervals.append([lo, hi, cfg])
            lo = hi
        self.tuning = json.dumps(self.intervals)
        HummingKernel.prepare_kernels(self.layer.humming_config.to_str(), COMPUTE, self.tuning,
                                      device=dev)

    def block_m(self, rows: int) -> int:
        for lo, hi, cfg in self.intervals:
            if lo < rows <= hi:
                return int(cfg["block_shape"][0])
        return int(self.intervals[0][2]["block_shape"][0])  # rows == 0

    def __call__(self, inputs, routed, top_k, outputs=None):
        sorted_ids, block_experts, padded_rows = routed
        return self.layer(inputs, outputs=outputs, sorted_ids=sorted_ids, expert_ids=block_experts,
                          num_tokens_padded=padded_rows, top_k=top_k, compute_config=COMPUTE,
                          tuning_config=self.tuning)


class HummingExperts(ExpertsBackend):
    """NVFP4 experts through Humming, token-major layout (see the module docstring)."""

    def __init__(self, *, setup) -> None:
        super().__init__(setup=setup)
        # pinning and hand-built setups bypass the planner: the same matching rule, again
        HUMMING_EXPERTS.require_setup(setup)

    def prepare(self, weights: ExpertWeights) -> None:
        expected = self.setup.num_local_experts
        if weights.num_experts != expected:
            raise ValueError(
                f"layer {self.setup.problem.name}: the humming backend got weights of "
                f"{weights.num_experts} experts, expected the {expected} local experts")
        missing = [n for n in ("w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2")
                   if getattr(weights, n) is None]
        if missing:
            raise ValueError(f"layer {self.setup.problem.name}: NVFP4 weights without "
                             f"{', '.join(missing)}")
        self.dtype = torch_dtype(self.setup.problem.dtype)
        if self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"layer {self.setup.problem.name}: the humming backend computes in "
                             f"bfloat16 or float16, not {self.setup.problem.dtype}")
        self.experts = weights.num_experts
        self.hidden = weights.hidden_size
        self.w13 = _Projection(weights.w13, weights.w13_scale, weights.w13_scale_2, self.dtype)
        self.w2 = _Projection(weights.w2, weights.w2_scale, weights.w2_scale_2, self.dtype)
        for proj in (self.w13, self.w2):
            proj.plan_and_compile(PLANNED_PAIRS)
        self.act = ACTIVATIONS[self.setup.problem.activation]
        # the triton plugin's routing kernels on a CUDA device where installed (compiled by the
        # first eager call, as Humming's own kernels are compiled here)
        self.router = triton_router() if weights.w13.is_cuda else None
        # index ranges the routing slices per forward instead of making them (sized for the
        # planned pair counts; larger batches make their own)
        device = weights.w13.device
        most = max(PLANNED_PAIRS)
        self.index = cached_index(max(most, self.experts + 2), device)
        self.block_starts = {
            bm: cached_index(max_sorted_rows(most, self.experts, bm) // bm, device, step=bm)
            for bm in {int(cfg["block_shape"][0]) for proj in (self.w13, self.w2)
                       for _, _, cfg in proj.intervals}}

    def forward(self, d: Dispatched) -> torch.Tensor:
        if d.layout != F.TOKEN_MAJOR:
            raise ValueError(f"the humming backend consumes token_major, got {d.layout!r}")
        if d.payload != F.UNQUANTIZED:
            raise ValueError(f"the humming backend does not accept payload {d.payload!r}")
        from humming import ops as hops

        hidden = d.hidden.to(self.dtype).contiguous()
        ids = d.topk_ids if d.topk_ids.dim() == 2 else d.topk_ids.reshape(-1, 1)
        n, k = ids.shape
        pairs = n * k
        out_dtype = d.out_dtype or d.hidden.dtype
        if pairs == 0:
            return torch.zeros(n, self.hidden, dtype=out_dtype, device=hidden.device)
        bm1, bm2 = self.w13.block_m(pairs), self.w2.block_m(pairs)
        if self.router is not None:
            r1 = route_with(self.router, ids, self.experts, bm1)
            r2 = r1 if bm2 == bm1 else route_with(self.router, ids, self.experts, bm2)
            valid = ((ids >= 0) & (ids < self.experts)).view(n, 1, k)
        else:
            # the sort by expert is shared by both projections; only the block padding differs
            sp = sort_pairs(ids, self.experts, self.index)
            r1 = place_pairs(sp, bm1, self.block_starts.get(bm1))
            r2 = r1 if bm2 == bm1 else place_pairs(sp, bm2, self.block_starts.get(bm2))
            valid = (sp.bucket < self.experts).view(n, 1, k)
        gate_up = self.w13(hidden, r1, top_k=k)
        inter, _, _ = hops.process_input(gate_up, activation_type="binary_split",
                                         activation_impl=self.act)
        # rows of pairs routed elsewhere (-1) are never written by the GEMM: start from zeros
        down = torch.zeros(pairs, self.hidden, dtype=self.dtype, device=hidden.device)
        down = self.w2(inter, r2, top_k=1, outputs=down)
        weights = torch.where(valid, d.topk_weights.reshape(n, 1, k).to(self.dtype), 0)
        out = torch.bmm(weights, down.view(n, k, self.hidden)).view(n, self.hidden)
        return out.to(out_dtype)
