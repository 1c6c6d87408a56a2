"""The inputs the conformance suite writes into a captured forward's tensors before its second
CUDA-graph replay (``harness._other_inputs``) are other valid inputs, and the rows it compares
(``harness._valid_rows``) are the ones a layout defines. The capture itself needs a CUDA device;
what it is fed is checked here, on the CPU, with the reference backend."""

from __future__ import annotations

import torch

from moe_runtime import formats as F
from moe_runtime.backend_api import ExpertsSetup, LayerProblem
from moe_runtime.backends.reference import ReferenceExperts
from moe_runtime.reference_math import reference_fused_experts
from moe_runtime.testing.harness import _dispatch_locally, _other_inputs, _valid_rows


def _layer(gen, e=6, h=16, i=8):
    from moe_runtime.backend_api import ExpertWeights

    return ExpertWeights(F.BF16, F.SILU, torch.randn(e, 2 * i, h, generator=gen) / 4,
                         torch.randn(e, h, i, generator=gen) / 4)


def _inputs(gen, n=5, k=2, e=6, h=16):
    x = torch.randn(n, h, generator=gen)
    ids = torch.rand(n, e, generator=gen).topk(k, dim=-1).indices.to(torch.int32)
    w = torch.rand(n, k, generator=gen)
    return x, ids, w


def test_token_major_inputs_are_rolled_rows_and_rolled_slot_weights():
    gen = torch.Generator().manual_seed(1)
    weights, (x, ids, w) = _layer(gen), _inputs(gen)
    problem = LayerProblem("t", F.BF16, F.SILU, 6, 2, 16, 8, dtype="float32")
    d, _, _ = _dispatch_locally(problem, F.TOKEN_MAJOR, x.clone(), ids.clone(), w.clone())
    _other_inputs(d)
    assert torch.equal(d.hidden, x.roll(1, 0))
    assert torch.equal(d.topk_ids, ids.roll(1, 0))
    assert torch.equal(d.topk_weights, w.roll(1, 0).roll(1, 1))
    # other inputs indeed: the layer's answer changes, and the backend computes it on them
    backend = ReferenceExperts(setup=ExpertsSetup(problem=problem, runs_as=F.BF16,
                                                  payload=F.UNQUANTIZED, layout=F.TOKEN_MAJOR))
    backend.prepare(weights)
    got = _valid_rows(d, backend.forward(d))
    want = reference_fused_experts(d.hidden, d.topk_ids, d.topk_weights, weights).float()
    before = reference_fused_experts(x, ids, w, weights).float()
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(got, before, atol=1e-2)


def test_masked_inputs_roll_rows_within_each_expert_and_only_valid_rows_count():
    gen = torch.Generator().manual_seed(2)
    x, ids, w = _inputs(gen, n=7)
    problem = LayerProblem("t", F.BF16, F.SILU, 6, 2, 16, 8, dtype="float32")
    d, _, _ = _dispatch_locally(problem, F.MASKED, x, ids, w)
    before = d.hidden.clone()
    m = d.masked_m.clone()
    _other_inputs(d)
    assert torch.equal(d.hidden, before.roll(1, 1)) and torch.equal(d.masked_m, m)
    rows = _valid_rows(d, d.hidden)
    assert rows.shape == (int(m.sum()), 16)
    assert torch.equal(rows[:int(m[0])], d.hidden[0, :int(m[0])].float())
