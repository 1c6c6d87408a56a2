"""The TMA path wired into :func:`ops.fused_moe_prepared` (issue 14): chosen per call by the tuned
table's ``"tma"`` config or ``MOE_TRITON_TMA``, its weight views built once at prepare, and the
other paths kept where it cannot run. On CPU through Triton's interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from moe_runtime_triton import ops, tma
from test_kernels import TOL, make_weights, reference, rel_err
from test_tma import _act_dtype, _cfg

TMA_STAGES = ["route", "gather", "gemm1", "gemm2", "finalize"]
SORTED_STAGES = ["route", "gemm1", "gemm2", "finalize"]


def _inputs(fmt, E, H, I, N, K, device, seed=0):
    torch.manual_seed(seed)
    w = make_weights(fmt, E, H, I, device=device, seed=seed)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(N)]).to(device, torch.int32)
    x = torch.randn(N, H, device=device).to(_act_dtype(fmt, device))
    wts = torch.rand(N, K, device=device)
    return w, x, ids, wts


def _run(pw, x, ids, wts, cfg):
    stages = []
    out = ops.fused_moe_prepared(x, ids, wts, pw, config=cfg, _stages=stages)
    return out, [s[0] for s in stages]


@pytest.fixture
def table_mode(monkeypatch):
    monkeypatch.setattr(ops, "TMA_MODE", "")
    monkeypatch.setattr(ops, "GROUPED_MM_MODE", "")


@pytest.mark.parametrize("fmt", ["fp16", "fp8_w8a8"])
def test_an_entry_with_a_tma_config_runs_the_tma_path(fmt, device, table_mode):
    E, H, I, N, K = 8, 64, 32, 13, 3
    w, x, ids, wts = _inputs(fmt, E, H, I, N, K, device)
    pw = ops.prepare_weights(w)
    base = ops.heuristic_config(pw.wfmt, E, H, I, K, N, allow_decode=False)
    tcfg = _cfg(fused_gu=False, bn1=16)
    out, stages = _run(pw, x, ids, wts, {**base, "tma": tcfg})
    assert stages == TMA_STAGES
    assert rel_err(out, reference(x, ids, wts, w)) < TOL[fmt]
    # the same kernels as a direct call, on the views kept with the weights
    tw = pw.tma_views[False]
    assert torch.equal(out, tma.fused_moe_tma(x, ids, wts, tw, config=tcfg))
    _run(pw, x, ids, wts, {**base, "tma": tcfg})
    assert pw.tma_views[False] is tw  # built once
    assert True not in pw.tma_views  # no interleaved copy was asked for
    plain, plain_stages = _run(pw, x, ids, wts, base)
    assert plain_stages == SORTED_STAGES and rel_err(plain, out) < TOL[fmt]
    assert "tma[" in ops.describe_config({**base, "tma": tcfg})


def test_the_environment_forces_or_forbids_it(device, monkeypatch):
    E, H, I, N, K = 4, 64, 64, 9, 2
    w, x, ids, wts = _inputs("fp16", E, H, I, N, K, device, seed=1)
    pw = ops.prepare_weights(w)
    base = ops.heuristic_config(pw.wfmt, E, H, I, K, N, allow_decode=False)
    monkeypatch.setattr(ops, "GROUPED_MM_MODE", "")
    monkeypatch.setattr(ops, "TMA_MODE", ops.tma_mode("0"))
    _, stages = _run(pw, x, ids, wts, {**base, "tma": _cfg()})
    assert stages == SORTED_STAGES
    monkeypatch.setattr(ops, "TMA_MODE", ops.tma_mode("1"))
    out, stages = _run(pw, x, ids, wts, base)  # no "tma" in the entry: tma.default_config
    assert stages == TMA_STAGES and True in pw.tma_views
    assert rel_err(out, reference(x, ids, wts, w)) < TOL["fp16"]


def test_the_torch_grouped_flag_wins_over_tma(device, table_mode):
    E, H, I, N, K = 4, 64, 32, 5, 2
    w, x, ids, wts = _inputs("bf16", E, H, I, N, K, device, seed=2)
    pw = ops.prepare_weights(w)
    base = ops.heuristic_config(pw.wfmt, E, H, I, K, N, allow_decode=False)
    out, stages = _run(pw, x, ids, wts, {**base, "tma": _cfg(), "grouped_mm": True})
    assert "combine" in stages and "finalize" not in stages
    assert not pw.tma_views.get(True) and rel_err(out, reference(x, ids, wts, w)) < TOL["bf16"]


def test_weights_it_cannot_run_stay_on_the_sorted_path(device, table_mode):
    """NVFP4 is decoded in the main loop: an entry's ``"tma"`` is passed over, with the reason
    kept once per prepared weights."""
    E, H, I, N, K = 4, 64, 32, 6, 2
    w, x, ids, wts = _inputs("nvfp4_w4a16", E, H, I, N, K, device, seed=3)
    pw = ops.prepare_weights(w)
    base = ops.heuristic_config(pw.wfmt, E, H, I, K, N, allow_decode=False)
    out, stages = _run(pw, x, ids, wts, {**base, "tma": _cfg()})
    assert stages == SORTED_STAGES
    assert "decoded in the main loop" in pw.tma_views["why"]
    assert ops.prepare_tma_views(pw, K) == []
    assert rel_err(out, reference(x, ids, wts, w)) < TOL["nvfp4_w4a16"]


def test_prepare_builds_the_views_the_table_names(device, table_mode, tuned_table):
    E, H, I, N, K = 4, 64, 32, 24, 2
    w, x, ids, wts = _inputs("fp16", E, H, I, N, K, device, seed=4)
    pw = ops.prepare_weights(w)
    base = ops.heuristic_config(pw.wfmt, E, H, I, K, N, allow_decode=False)
    tcfg = _cfg(fused_gu=False, bn1=16)
    tuned_table.write_text(json.dumps({ops.table_key("fp16", E, H, I, K): {
        "1": base, str(N): {**base, "tma": tcfg}}}))
    assert ops.prepare_tma_views(pw, K) == [False]
    tw = pw.tma_views[False]
    # the table's choice by token count: N -> tma, 1 -> the sorted path
    out, stages = _run(pw, x, ids, wts, None)
    assert stages == TMA_STAGES and pw.tma_views[False] is tw
    assert rel_err(out, reference(x, ids, wts, w)) < TOL["fp16"]
    _, stages = _run(pw, x[:1], ids[:1], wts[:1], None)
    assert stages == SORTED_STAGES


def test_the_mode_is_read_from_the_environment_and_a_bad_one_is_named():
    code = "import moe_runtime_triton.ops as o; print(o.TMA_MODE)"
    env = {**os.environ, ops.TMA_ENV: "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert res.stdout.split() == ["1"]
    with pytest.raises(ValueError, match="MOE_TRITON_TMA='on'.*accepted"):
        ops.tma_mode("on")
