"""The three serve kernels' switches (grouped-query attention, one-kernel norms, one-kernel
rotary): unset, each is on for a model on a CUDA device and off elsewhere; the variable (``0``,
``1``) overrides that default, and the Engine's argument overrides both."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.serve import fused_norm, fused_rope, paged_attention

SWITCHES = {
    "gqa_attention": (paged_attention.choose_gqa_attention, paged_attention.GQA_ENV),
    "fused_norms": (fused_norm.choose_fused_norms, fused_norm.FUSED_NORMS_ENV),
    "fused_rope": (fused_rope.choose_fused_rope, fused_rope.FUSED_ROPE_ENV),
}


@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_unset_means_on_for_cuda_and_the_variable_and_argument_win(name, monkeypatch):
    choose, env = SWITCHES[name]
    monkeypatch.delenv(env, raising=False)
    assert choose(device="cuda:0") is True
    assert choose(device=torch.device("cuda", 1)) is True
    assert choose(device="cpu") is False
    assert choose(device=torch.device("cpu")) is False
    assert choose() is False  # no device known: off
    assert choose(False, device="cuda") is False
    monkeypatch.setenv(env, "0")
    assert choose(device="cuda") is False
    assert choose(True, device="cpu") is True
    monkeypatch.setenv(env, "1")
    assert choose(device="cpu") is True
    assert choose(False, device="cuda") is False
