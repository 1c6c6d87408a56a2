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


SPLIT = {"ll_max_tokens_per_rank": 8, "ll_oversize": "split", "ll_split_max_tokens_per_rank": 24}


@pytest.mark.parametrize("settings,max_tokens,rounds", [({}, 8, 1), (SPLIT, 24, 3)])
def test_low_latency_forward_makes_no_host_sync_of_its_own(ranks, settings, max_tokens, rounds):
    sent = ranks(2).run(W.low_latency_forward_without_host_sync, [7, 5], settings, max_tokens)
    assert [len(s) for s in sent] == [rounds, rounds]


@pytest.mark.parametrize("world,n_tokens", [(2, [19, 2]), (4, [17, 0, 3, 9])])
def test_low_latency_split_into_rounds_equals_one_round(ranks, world, n_tokens):
    calls = ranks(world).run(W.low_latency_split_equals_one_round, n_tokens, 8, 20)
    for c, n in zip(calls, n_tokens, strict=True):
        # three rounds on every rank whatever its batch (ceil(20 / 8)), two forwards
        assert len(c) == 2 * 3 and max(c) <= 8 and sum(c) == 2 * n


@pytest.mark.parametrize("world,n_tokens,settings,needles", [
    (2, [11, 2], {}, ["bound of 8 tokens", "MOE_RUNTIME_DEEPEP_LL_MAX_TOKENS_PER_RANK=128",
                      "MOE_RUNTIME_DEEPEP_LL_OVERSIZE=split", "--max-tokens-per-rank"]),
    (4, [3, 0, 30, 5], SPLIT, ["bound of 24 tokens", "3 rounds of at most 8",
                               "MOE_RUNTIME_DEEPEP_LL_SPLIT_MAX_TOKENS_PER_RANK=24"]),
])
def test_low_latency_batch_above_the_bound_fails_on_its_rank_and_the_others_finish(
        ranks, world, n_tokens, settings, needles):
    max_tokens = 24 if settings else 8
    got = ranks(world).run(W.low_latency_refused_on_its_rank, n_tokens, max_tokens, settings)
    big = max(range(world), key=lambda r: n_tokens[r])
    rounds = 3 if settings else 1
    for r, res in enumerate(got):
        if r != big:
            assert res == {"refused": None, "sent": _spans(n_tokens[r], 8, rounds)}
            continue
        assert res["sent"] == [0] * rounds  # it took its part in DeepEP's calls, with no tokens
        msg = res["refused"]
        assert msg.startswith("layer model.layers.0.mlp.experts: this rank's low-latency batch "
                              f"of {n_tokens[r]} tokens")
        assert all(n in msg for n in needles), msg


def _spans(n, bound, rounds):
    return [max(0, min(bound, n - i * bound)) for i in range(rounds)]


def test_low_latency_refused_for_the_1_0_0_api_and_normal_mode_runs_on_it(ranks):
    messages = ranks(2).run(W.low_latency_refused_on_v100)
    assert all("use_fp8" in m and "1.0.0" in m for m in messages)
    assert ranks(2).run(W.normal_mode_on_v100, TOKENS[2]) == [True, True]
