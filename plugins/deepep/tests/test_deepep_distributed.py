"""The backend and the layout conversions on 2 and 4 CPU processes (gloo), against the core's
reference all-to-all, with DeepEP replaced by a SIMULATION of its outputs (``deepep_sim``).

These tests check the plugin's conversion code, not DeepEP: nothing here runs DeepEP's kernels.
"""

from __future__ import annotations

import deepep_workers as W
import pytest

pytestmark = pytest.mark.slow

# no rank without tokens here: the core reference all-to-all cannot send an empty batch (see
# README.md, "Findings"); empty ranks are covered against the local masked reference.
TOKENS = {2: [5, 3], 4: [5, 1, 7, 2]}


@pytest.mark.parametrize("world", [2, 4])
def test_layout_conversions_against_reference_all_to_all(ranks, world):
    results = ranks(world).run(W.layout_against_reference, TOKENS[world])
    assert sum(r["recv"] for r in results) > 0


@pytest.mark.parametrize("world", [2, 4])
def test_normal_mode_equals_reference_all_to_all(ranks, world):
    calls = ranks(world).run(W.normal_mode_matches_reference, TOKENS[world])
    assert all(("dispatch", n) in c for c, n in zip(calls, TOKENS[world], strict=True))


def test_normal_mode_fp8_payload_with_the_layers_own_scale(ranks):
    assert ranks(2).run(W.normal_mode_fp8_matches_reference, TOKENS[2]) == [True, True]


@pytest.mark.parametrize("world", [2, 4])
def test_low_latency_mode_equals_masked_reference(ranks, world):
    calls = ranks(world).run(W.low_latency_matches_reference, TOKENS[world], 8)
    for c in calls:
        assert [k for k, _ in c] == ["low_latency_dispatch", "low_latency_combine"]


@pytest.mark.parametrize("world,n_tokens", [(2, [19, 2]), (4, [17, 0, 3, 9])])
def test_low_latency_oversized_batch_split_into_agreed_rounds(ranks, world, n_tokens):
    calls = ranks(world).run(W.low_latency_oversize, n_tokens, 8, "split")
    rounds = -(-max(n_tokens) // 8)
    for c in calls:
        dispatched = [n for k, n in c if k == "low_latency_dispatch"]
        # two forwards, the same number of rounds on every rank
        assert len(dispatched) == 2 * rounds
        assert max(dispatched) <= 8  # never above the bound handed to DeepEP
    assert [sum(n for k, n in c if k == "low_latency_dispatch") for c in calls] == \
        [2 * n for n in n_tokens]


def test_low_latency_oversized_batch_refused_on_every_rank_without_a_hang(ranks):
    messages = ranks(2).run(W.low_latency_oversize, [11, 2], 8, "refuse")
    for msg in messages:
        assert "11 tokens" in msg and "bound of 8 tokens" in msg
        assert "MOE_RUNTIME_DEEPEP_LL_MAX_TOKENS_PER_RANK" in msg
        assert "MOE_RUNTIME_DEEPEP_LL_OVERSIZE=split" in msg
        assert "--max-tokens-per-rank" in msg


def test_low_latency_refused_for_the_1_0_0_api_and_normal_mode_runs_on_it(ranks):
    messages = ranks(2).run(W.low_latency_refused_on_v100)
    assert all("use_fp8" in m and "1.0.0" in m for m in messages)
    assert ranks(2).run(W.normal_mode_on_v100, TOKENS[2]) == [True, True]
