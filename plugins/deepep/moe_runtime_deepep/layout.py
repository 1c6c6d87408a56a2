"""Layout and handle conversions around DeepEP, in plain torch (CPU and CUDA alike); nothing here
calls DeepEP.

What the backend runs: low-latency batches split into bounded rounds and merged back
(:func:`chunk_spans`, :func:`merge_masked_chunks`, :func:`split_masked_chunks`), FP8 scale blocks
(:func:`fp8_scale_blocks`). What DeepEP's kernels do, written out for CPU checks against the
reference all-to-all: :func:`tokens_to_masked`, :func:`masked_to_tokens`. No function syncs with
the host unless it says so, and none writes out of bounds.
"""

from __future__ import annotations

import attrs
import torch

from moe_runtime_deepep.limits import FP8_SCALE_BLOCK  # noqa: F401  (one definition)


def expert_owner(num_experts: int, world: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's expert placement: ``(owner [E], local_id [E])`` of moe-runtime's placement rule
    (:func:`moe_runtime.placement.owner_table`), which DeepEP runs when
    ``num_experts % world == 0`` (it requires that)."""
    from moe_runtime.placement import owner_table

    if world < 1 or num_experts % world:
        raise ValueError(f"DeepEP needs num_experts % ranks == 0; got {num_experts} experts over "
                         f"{world} ranks")
    return owner_table(num_experts, world, device)


def chunk_spans(num_tokens: int, bound: int, rounds: int) -> list[tuple[int, int]]:
    """``rounds`` half-open token ranges of at most ``bound`` tokens covering ``num_tokens``.

    Trailing ranges may be empty: every rank of a group runs the same number of low-latency rounds,
    and a rank with fewer tokens sends empty ones.
    """
    if bound < 1 or rounds < 1:
        raise ValueError(f"bound and rounds must be positive, got {bound} and {rounds}")
    if num_tokens > bound * rounds:
        raise ValueError(
            f"{num_tokens} tokens do not fit in {rounds} rounds of at most {bound} tokens"
        )
    return [(min(i * bound, num_tokens), min((i + 1) * bound, num_tokens)) for i in range(rounds)]


def fp8_scale_blocks(num_tokens: int, hidden: int, scale: torch.Tensor,
                     device=None) -> torch.Tensor:
    """``[num_tokens, hidden // 128]`` float32 filled with the per-tensor ``scale``: the scales half
    of DeepEP's FP8 normal-dispatch input when the values were quantized with one per-tensor scale.
    """
    if hidden % FP8_SCALE_BLOCK:
        raise ValueError(f"hidden {hidden} is not a multiple of {FP8_SCALE_BLOCK}")
    s = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(())
    return s.expand(num_tokens, hidden // FP8_SCALE_BLOCK).contiguous()


@attrs.frozen
class MaskedTokens:
    """Token-major rows placed into the masked layout.

    :param hidden: ``[E_local, max_rows, H]``; rows past ``masked_m[e]`` are zero.
    :param masked_m: ``[E_local]`` int32 rows per local expert.
    :param slot: ``[N, K]`` int64, the row of ``(token, k)`` in its expert's block, ``-1`` where the
        expert is not local (or, with ``check=False``, where it did not fit).
    """

    hidden: torch.Tensor
    masked_m: torch.Tensor
    slot: torch.Tensor


def _positions(keys: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each entry of ``keys`` (values in ``[0, num_keys]``, ``num_keys`` meaning none), its rank
    among the entries with the same key in order of appearance; and the count of each key."""
    length = keys.numel()
    counts = torch.zeros(num_keys + 1, dtype=torch.int64, device=keys.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    order = torch.sort(keys, stable=True).indices
    starts = torch.cumsum(counts, 0) - counts
    pos_sorted = torch.arange(length, device=keys.device) - starts[keys[order]]
    pos = torch.empty_like(keys)
    pos[order] = pos_sorted
    return pos, counts[:num_keys]


def tokens_to_masked(
    hidden: torch.Tensor,
    local_ids: torch.Tensor,
    num_local_experts: int,
    max_rows: int,
    *,
    check: bool = True,
) -> MaskedTokens:
    """Place token-major rows into ``[num_local_experts, max_rows, H]`` by their local expert ids.

    Each ``(token, k)`` with ``local_ids[token, k] >= 0`` becomes one row of that expert's block, in
    token order (DeepEP's low-latency dispatch produces the same rows, in an arrival order).

    :param check: raise ``ValueError`` when an expert would receive more than ``max_rows`` rows (a
        host synchronisation). With ``check=False`` the rows that do not fit are dropped (their
        ``slot`` is ``-1``) and ``masked_m`` is clamped: never an out-of-bounds write.
    """
    n, k = local_ids.shape
    e = num_local_experts
    flat = local_ids.reshape(-1).long()
    valid = flat >= 0
    keys = torch.where(valid, flat, torch.full_like(flat, e))
    pos, counts = _positions(keys, e)
    if check and n * k:
        worst = int(counts.max()) if e else 0
        if worst > max_rows:
            raise ValueError(
                f"an expert receives {worst} rows, more than the masked layout's {max_rows}"
            )
    fits = valid & (pos < max_rows)
    # Rows that do not belong (or do not fit) go to a spare row max_rows of a spare expert e.
    dest_e = torch.where(fits, keys, torch.full_like(keys, e))
    dest_r = torch.where(fits, pos, torch.full_like(pos, max_rows))
    out = hidden.new_zeros((e + 1, max_rows + 1, hidden.shape[-1]))
    rows = hidden.repeat_interleave(k, dim=0) if k else hidden[:0]
    out[dest_e, dest_r] = rows
    slot = torch.where(fits, pos, torch.full_like(pos, -1)).view(n, k)
    return MaskedTokens(out[:e, :max_rows], counts.clamp(max=max_rows).to(torch.int32), slot)


def masked_to_tokens(
    expert_out: torch.Tensor,
    local_ids: torch.Tensor,
    slot: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """The low-latency combine's reduction: ``out[n] = sum_k w[n, k] * expert_out[id, slot]`` over
    the ``k`` with a row (``slot >= 0``), in float32, ``k`` in order. Returns ``[N, H]`` float32."""
    n, k = local_ids.shape
    h = expert_out.shape[-1]
    present = slot >= 0
    e_idx = torch.where(present, local_ids.long(), torch.zeros_like(slot))
    r_idx = torch.where(present, slot, torch.zeros_like(slot))
    rows = expert_out[e_idx.reshape(-1), r_idx.reshape(-1)].float().view(n, k, h)
    w = topk_weights.float()
    w = torch.where(present, w, torch.zeros_like(w))
    out = torch.zeros((n, h), dtype=torch.float32, device=expert_out.device)
    for j in range(k):  # a fixed small loop over top-k, not over tokens
        out += rows[:, j] * w[:, j, None]
    return out


@attrs.frozen
class MergeInfo:
    """Where each round's rows sit in the merged masked layout (what the split needs)."""

    offsets: torch.Tensor  # [rounds, E_local] int64: first merged row of round c, expert e
    counts: torch.Tensor  # [rounds, E_local] int64
    rows_per_round: int


def merge_masked_chunks(
    chunks: list[torch.Tensor], counts: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, MergeInfo]:
    """Concatenate the valid rows of several masked outputs expert by expert.

    :param chunks: per round ``[E_local, R, H]`` (rows past ``counts[c][e]`` are ignored).
    :param counts: per round ``[E_local]`` valid rows.
    :returns: ``(merged [E_local, rounds * R, H], masked_m [E_local] int32, info)``; in ``merged``
        expert ``e`` holds round 0's rows, then round 1's, ...; rows past ``masked_m`` are zero.
    """
    if not chunks or len(chunks) != len(counts):
        raise ValueError("merge_masked_chunks needs one count vector per chunk, and a chunk")
    e, r, h = chunks[0].shape
    c = len(chunks)
    cnt = torch.stack([x.reshape(-1).long().clamp(0, r) for x in counts])  # [C, E]
    offsets = torch.cumsum(cnt, 0) - cnt
    total = c * r
    merged = chunks[0].new_zeros((e, total + 1, h))
    rows = torch.arange(r, device=chunks[0].device)
    expert = torch.arange(e, device=chunks[0].device)[:, None].expand(e, r)
    for i, x in enumerate(chunks):  # a loop over rounds, not tokens
        ok = rows[None, :] < cnt[i][:, None]  # [E, R]
        dest = torch.where(ok, offsets[i][:, None] + rows[None, :], torch.full_like(expert, total))
        merged[expert, dest] = x
    masked_m = cnt.sum(0).to(torch.int32)
    return merged[:, :total], masked_m, MergeInfo(offsets, cnt, r)


def split_masked_chunks(merged: torch.Tensor, info: MergeInfo) -> list[torch.Tensor]:
    """The inverse of :func:`merge_masked_chunks` for the experts' output: one ``[E_local, R, H]``
    per round, rows past that round's count set to zero."""
    e, total, h = merged.shape
    r = info.rows_per_round
    rows = torch.arange(r, device=merged.device)
    out = []
    for i in range(info.counts.shape[0]):
        ok = rows[None, :] < info.counts[i][:, None]  # [E, R]
        src = torch.where(ok, info.offsets[i][:, None] + rows[None, :], torch.zeros_like(ok,
                                                                                        dtype=torch.long))
        src = src.clamp(max=max(total - 1, 0))
        part = torch.gather(merged, 1, src[..., None].expand(e, r, h))
        out.append(torch.where(ok[..., None], part, torch.zeros_like(part)))
    return out
