"""Where ``min_p`` sits among temperature, top-k and top-p: transformers' order (temperature, top-k,
top-p, min-p), not vLLM v1's (temperature, min-p, then top-k and top-p on what min-p left).

min-p compares each token with the likeliest one, a ratio that neither top-k nor top-p changes, and
both keep the likeliest token; so top-k and min-p commute, and the orders differ only where top-p
meets min-p: after min-p, vLLM's top-p sums a renormalized remainder and can stop earlier. The
docs (docs/serve.md, Request fields) say so; these tests hold the sampler to it.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from moe_runtime.serve.sampling import BatchSampler, SamplingParams

# probabilities where the order matters: min-p 0.2 drops the tail (0.05 each, under 0.2 * 0.3),
# and top-p 0.8 then stops at a different token depending on whether the tail was dropped
PROBS = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.07, 0.05, 0.05, 0.04, 0.04])


def _kept(params: SamplingParams, logits: torch.Tensor) -> set[int]:
    s = BatchSampler(logits.shape[-1], max_slots=1, max_batch=1)
    key = s.open(params)
    filtered = s.filtered_logits(logits[None], s.rows_for([key]))[0]
    return set(torch.nonzero(filtered > float("-inf"))[:, 0].tolist())


def _transformers(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> set[int]:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    warpers += [TopPLogitsWarper(top_p), MinPLogitsWarper(min_p)]
    out = warpers(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0]
    return set(torch.nonzero(out > float("-inf"))[:, 0].tolist())


def _vllm_v1(logits: torch.Tensor, temperature, top_p, min_p) -> set[int]:
    """vLLM v1's order, written out: min-p on the tempered probabilities, then top-p on the
    renormalized remainder."""
    probs = (logits / temperature).softmax(-1)
    x = (logits / temperature).masked_fill(probs < min_p * probs.max(), float("-inf"))
    p, order = x.softmax(-1).sort(descending=True)
    keep = ((p.cumsum(-1) - p) < top_p) & (p > 0)
    return set(order[keep].tolist())


def test_min_p_comes_after_top_p_as_in_transformers():
    logits = PROBS.log()
    ours = _kept(SamplingParams(temperature=1.0, top_p=0.8, min_p=0.2, seed=1), logits)
    assert ours == _transformers(logits, 1.0, 0, 0.8, 0.2) == {0, 1, 2, 3, 4}
    # vLLM v1 keeps fewer here: after min-p drops the tail, 0.8 of the rest is reached sooner
    assert _vllm_v1(logits, 1.0, 0.8, 0.2) == {0, 1, 2, 3}


def test_min_p_and_top_k_commute_and_match_transformers_with_temperature():
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = torch.randn(40, generator=gen) * 3
        for top_k in (0, 3, 12):
            params = SamplingParams(temperature=0.7, top_k=top_k, min_p=0.1, seed=1)
            ours = _kept(params, logits)
            assert ours == _transformers(logits, 0.7, top_k, 1.0, 0.1)
            # min-p first (vLLM v1's order) keeps the same tokens when top-p is off
            assert ours == _vllm_v1(logits, 0.7, 1.0, 0.1) & (
                set(logits.topk(top_k).indices.tolist()) if top_k else set(range(40)))
