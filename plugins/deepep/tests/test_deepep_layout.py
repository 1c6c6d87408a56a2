"""The pure-torch conversions of ``moe_runtime_deepep.layout`` against plain Python loops."""

from __future__ import annotations

import pytest
import torch

from moe_runtime_deepep import layout as L


def _routing(n, k, experts, seed=0, drop=0.3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)]) if n else \
        torch.zeros((0, k), dtype=torch.int64)
    ids = torch.where(torch.rand(n, k, generator=g) < drop, torch.full_like(ids, -1), ids)
    return ids.to(torch.int32), torch.rand(n, k, generator=g)


@pytest.mark.parametrize("n,k,e", [(0, 2, 4), (1, 1, 1), (7, 3, 4), (33, 4, 6)])
def test_tokens_to_masked_places_every_row_in_token_order(n, k, e):
    x = torch.randn(n, 16).bfloat16()
    ids, _ = _routing(n, k, e, seed=n)
    m = L.tokens_to_masked(x, ids, e, max_rows=max(1, n))
    seen = [0] * e
    for t in range(n):
        for j in range(k):
            i = int(ids[t, j])
            if i < 0:
                assert int(m.slot[t, j]) == -1
                continue
            assert int(m.slot[t, j]) == seen[i]  # rows in token order
            assert torch.equal(m.hidden[i, seen[i]], x[t])
            seen[i] += 1
    assert m.masked_m.tolist() == seen and m.masked_m.dtype == torch.int32
    for i in range(e):  # rows past masked_m are zero
        assert not m.hidden[i, seen[i]:].any()


def test_tokens_to_masked_refuses_or_drops_rows_that_do_not_fit_never_writing_out_of_bounds():
    x = torch.arange(6, dtype=torch.float32)[:, None].expand(6, 4).contiguous()
    ids = torch.zeros((6, 1), dtype=torch.int32)  # six rows for expert 0
    with pytest.raises(ValueError, match="6 rows, more than the masked layout's 4"):
        L.tokens_to_masked(x, ids, 2, max_rows=4)
    m = L.tokens_to_masked(x, ids, 2, max_rows=4, check=False)
    assert m.hidden.shape == (2, 4, 4)
    assert m.masked_m.tolist() == [4, 0]
    assert m.slot.flatten().tolist() == [0, 1, 2, 3, -1, -1]
    assert m.hidden[0, :, 0].tolist() == [0, 1, 2, 3]


def test_masked_to_tokens_is_the_weighted_sum_over_present_experts():
    n, k, e, h = 9, 3, 5, 8
    ids, w = _routing(n, k, e, seed=3)
    x = torch.randn(n, h)
    m = L.tokens_to_masked(x, ids, e, max_rows=n)
    out = torch.randn(e, n, h)  # any expert output
    got = L.masked_to_tokens(out, ids, m.slot, w)
    want = torch.zeros(n, h)
    for t in range(n):
        for j in range(k):
            if int(ids[t, j]) >= 0:
                want[t] += out[int(ids[t, j]), int(m.slot[t, j])] * w[t, j]
    assert torch.equal(got, want)


@pytest.mark.parametrize("counts", [
    [[3, 0, 2], [1, 4, 0], [0, 0, 4]], [[0, 0], [0, 0]], [[4], [4]],
])
def test_merge_then_split_of_masked_rounds_is_lossless(counts):
    rounds, e, r, h = len(counts), len(counts[0]), 4, 3
    chunks = [torch.full((e, r, h), float("nan")) for _ in range(rounds)]  # garbage past counts
    for c in range(rounds):
        for i in range(e):
            for j in range(counts[c][i]):
                chunks[c][i, j] = 100 * c + 10 * i + j
    cnt = [torch.tensor(row, dtype=torch.int32) for row in counts]
    merged, masked_m, info = L.merge_masked_chunks(chunks, cnt)
    assert merged.shape == (e, rounds * r, h)
    assert masked_m.tolist() == [sum(col) for col in zip(*counts, strict=True)]
    for i in range(e):  # expert i: round 0's rows, then round 1's...
        want = [100 * c + 10 * i + j for c in range(rounds) for j in range(counts[c][i])]
        assert merged[i, : len(want), 0].tolist() == want
        assert not merged[i, len(want):].any()  # nothing left of the NaN garbage
    back = L.split_masked_chunks(merged * 2, info)
    for c in range(rounds):
        for i in range(e):
            k = counts[c][i]
            assert torch.equal(back[c][i, :k], chunks[c][i, :k] * 2)
            assert not back[c][i, k:].any()


def test_chunk_spans_give_every_rank_the_same_number_of_bounded_rounds():
    assert L.chunk_spans(19, 8, 3) == [(0, 8), (8, 16), (16, 19)]
    assert L.chunk_spans(2, 8, 3) == [(0, 2), (2, 2), (2, 2)]
    assert L.chunk_spans(0, 8, 1) == [(0, 0)]
    with pytest.raises(ValueError, match="do not fit"):
        L.chunk_spans(25, 8, 3)


def test_fp8_scale_blocks_are_the_per_tensor_scale_in_deepeps_shape():
    s = L.fp8_scale_blocks(3, 256, torch.tensor(0.125))
    assert s.shape == (3, 2) and s.dtype == torch.float32 and (s == 0.125).all()
    with pytest.raises(ValueError):
        L.fp8_scale_blocks(3, 200, torch.tensor(1.0))


def test_expert_owner_is_the_core_placement_when_experts_divide():
    from moe_runtime.backends.all_to_all import expert_owner_table

    for e, w in [(8, 2), (16, 4), (256, 8)]:
        owner, local = L.expert_owner(e, w)
        ref_owner, ref_local = expert_owner_table(e, w, "cpu")
        assert torch.equal(owner, ref_owner) and torch.equal(local, ref_local)
    with pytest.raises(ValueError, match="num_experts % ranks"):
        L.expert_owner(10, 4)
