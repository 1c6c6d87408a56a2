"""Our own test beside the suite: rank 1 of 2, whose slots of the other rank's experts are -1."""

import torch

from moe_runtime.reference_math import reference_fused_experts
from moe_runtime.backend_api import Dispatched, ExpertsSetup, ExpertWeights, LayerProblem
from moe_runtime_example.experts import BmmExperts


def test_slots_of_experts_on_other_ranks_are_skipped():
    gen = torch.Generator().manual_seed(0)
    problem = LayerProblem("model.layers.0.mlp.experts", "bf16", "silu", num_experts=8, top_k=2,
                           hidden_size=64, intermediate_size=32)
    # Rank 1 of 2 holds 4 of the 8 experts; dispatch marks slots of the other 4 with -1.
    setup = ExpertsSetup(problem=problem, runs_as="bf16", payload="unquantized",
                         layout="token_major", ep_rank=1, ep_size=2)
    weights = ExpertWeights("bf16", "silu",
                            w13=(torch.randn(4, 64, 64, generator=gen) / 8).bfloat16(),
                            w2=(torch.randn(4, 64, 32, generator=gen) / 6).bfloat16())
    hidden = torch.randn(5, 64, generator=gen).bfloat16()
    topk_ids = torch.tensor([[0, -1], [-1, -1], [3, 1], [-1, 2], [1, 0]], dtype=torch.int32)
    topk_weights = torch.rand(5, 2, generator=gen)

    backend = BmmExperts(setup=setup)
    backend.prepare(weights)
    got = backend.forward(Dispatched("token_major", hidden, topk_ids=topk_ids,
                                     topk_weights=topk_weights))

    assert got.shape == hidden.shape and got.dtype == hidden.dtype
    assert got[1].abs().max() == 0  # both experts of token 1 are elsewhere
    want = reference_fused_experts(hidden, topk_ids, topk_weights, weights)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
