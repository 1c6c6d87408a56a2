"""The batching path is chosen from config.json's fields alone, on every transformers in range."""

from __future__ import annotations

from transformers import DeepseekV3Config, Qwen3MoeConfig

from moe_runtime.serve.batching import CONTINUOUS, DYNAMIC, _paged_page, choose_batching


def _qwen3(**fields):
    return Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], hidden_size=64,
                          num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          **fields)


def test_grouped_query_attention_fits_the_paged_cache():
    choice = choose_batching(_qwen3(head_dim=16))
    assert choice.path == CONTINUOUS
    assert "pages of 2 heads x 16" in choice.reason


def test_a_head_dim_other_than_hidden_over_heads_is_the_page_size():
    assert _paged_page(_qwen3(head_dim=32).to_dict()) == (2, 32)


def test_without_head_dim_or_kv_heads_the_page_is_hidden_over_heads_by_all_heads():
    assert _paged_page({"hidden_size": 64, "num_attention_heads": 4}) == (4, 16)


def test_multi_head_latent_attention_takes_the_dynamic_cache():
    config = DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"], hidden_size=64,
                              num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                              qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                              n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              first_k_dense_replace=1, n_group=2, topk_group=1)
    choice = choose_batching(config)
    assert choice.path == DYNAMIC
    assert "keys of 4 heads x 32 and values of 4 heads x 16" in choice.reason


def test_the_rule_matches_transformers_own_where_it_still_has_it():
    import pytest

    cache = pytest.importorskip("transformers.generation.continuous_batching.cache")
    if not hasattr(cache, "find_head_dim") or not hasattr(cache, "find_num_kv_heads"):
        pytest.skip("this transformers no longer has find_head_dim / find_num_kv_heads")
    for config in (_qwen3(head_dim=32), _qwen3()):
        assert _paged_page(config.to_dict()) == (cache.find_num_kv_heads(config),
                                                 cache.find_head_dim(config))
