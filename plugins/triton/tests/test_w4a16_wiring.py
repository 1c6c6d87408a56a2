"""The NVFP4 W4A16 tile-layout path wired into :func:`ops.fused_moe_prepared`: chosen per call by
the tuned table's ``"w4a16"`` config or ``MOE_TRITON_W4A16``, its repacked weights built once at
prepare (only on opt-in), the other paths kept where it cannot run or is not asked for. On CPU
through Triton's interpreter, float16 activations (the interpreter cannot compute bfloat16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch
from moe_runtime_triton import ops
from moe_runtime_triton import w4a16 as W
from moe_runtime_triton.backend import TritonExperts
from test_w4a16 import TOL, make_weights, random_code_weights, reference, rel_err

from moe_runtime.backend_api import Dispatched

SORTED_STAGES = ["route", "gemm1", "gemm2", "finalize"]
DECODE_STAGES = ["decode_gemm1", "decode_gemm2"]
# the bench's "r32k64" dry-run layout (benchmarks/bench_w4a16.py DRY_LAYOUTS), as a table writes it
LAYOUT = [32, 64, 64, 32]
LAYOUT_KEY = (32, 64, 64, 32, False)


def _inputs(E, H, I, N, K, device, seed=0):
    w = make_weights(E, H, I, seed=seed, device=device)
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(device,
                                                                                 torch.int32)
    x = torch.randn(N, H, generator=g).to(torch.float16).to(device)
    wts = torch.rand(N, K, generator=g).to(device)
    return w, x, ids, wts


@pytest.fixture
def calls(monkeypatch):
    """The configs ``w4a16.fused_moe_w4a16`` ran with (what ``ops`` called), in order."""
    seen = []
    real = W.fused_moe_w4a16

    def spy(*a, config=None, **kw):
        seen.append(dict(config))
        return real(*a, config=config, **kw)
    monkeypatch.setattr(W, "fused_moe_w4a16", spy)
    return seen


@pytest.fixture
def table_mode(monkeypatch):
    monkeypatch.setattr(ops, "W4A16_MODE", "")
    monkeypatch.setattr(ops, "TMA_MODE", "")
    monkeypatch.setattr(ops, "GROUPED_MM_MODE", "")


def _run(pw, x, ids, wts, cfg):
    stages = []
    out = ops.fused_moe_prepared(x, ids, wts, pw, config=cfg, _stages=stages)
    return out, [s[0] for s in stages]


@pytest.mark.parametrize("over,layout,stages", [
    ({"mma_sync": True, "num_stages": 3}, LAYOUT, ["fused"]),  # default_config: 6 pairs, fused
    ({"fused": False, "mma_sync": True}, LAYOUT, SORTED_STAGES),  # the grouped W4A16 path
    # a block per pair, GEMM 1 split over H's two K tiles, the combine folded into GEMM 2
    ({"fused": False, "pairs": True, "split_k": 2, "fold": True}, {
        "gate_up_rows": 32, "gate_up_cols": 32, "down_rows": 32, "down_cols": 32},
     ["gemm1", "gemm2"]),
])
def test_an_entry_with_a_w4a16_config_runs_the_w4a16_path(over, layout, stages, device,
                                                          table_mode, calls):
    E, H, I, N, K = 4, 64, 32, 3, 2
    w, x, ids, wts = _inputs(E, H, I, N, K, device)
    pw = ops.prepare_weights(w)
    base = ops.heuristic_config(pw.wfmt, E, H, I, K, N, allow_decode=False)
    entry = {**base, "w4a16": {"layout": layout, **over}}
    out, got = _run(pw, x, ids, wts, entry)
    assert got == stages and len(calls) == 1
    # the bench's config: default_config for this call with the entry's keys over it
    lo = ops.w4a16_layout(pw, entry["w4a16"])
    (key,) = [k for k in pw.w4a16_views if k != "why"]
    ww = pw.w4a16_views[key]
    assert ww.layout == lo and calls[0] == {**W.default_config(ww, N, K), **over}
    assert rel_err(out, reference(x, ids, wts, w)) < TOL
    _run(pw, x, ids, wts, entry)
    assert pw.w4a16_views[key] is ww and len(calls) == 2  # built once
    plain, plain_stages = _run(pw, x, ids, wts, base)
    assert plain_stages == SORTED_STAGES and len(calls) == 2
    assert rel_err(plain, out) < 2 * TOL
    assert "w4a16[" in ops.describe_config(entry)


def test_repacking_the_prepared_weights_gives_the_checkpoints_tiles(device):
    """The backend repacks from ``PreparedWeights`` (codes already in the kernels' bit layout):
    byte for byte what ``prepare_w4a16`` makes from the checkpoint, padded layouts included."""
    for H, I, lo in [(64, 32, None), (96, 48, W.W4A16Layout(32, 64, 64, 32)),
                     (96, 48, W.W4A16Layout(64, 64, 64, 32, interleave=True))]:
        w = random_code_weights(2, H, I, seed=H + I, device=device)
        a, b = W.prepare_w4a16(w, lo), W.from_prepared(ops.prepare_weights(w), lo)
        assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
        assert torch.equal(a.w13_scale_2, b.w13_scale_2) and a.layout == b.layout


def test_the_environment_forces_or_forbids_it(device, monkeypatch, calls):
    E, H, I, N, K = 4, 64, 32, 2, 2
    w, x, ids, wts = _inputs(E, H, I, N, K, device, seed=1)
    pw = ops.prepare_weights(w)
    base = ops.heuristic_config(pw.wfmt, E, H, I, K, N, allow_decode=False)
    monkeypatch.setattr(ops, "GROUPED_MM_MODE", "")
    monkeypatch.setattr(ops, "W4A16_MODE", ops.w4a16_mode("0"))
    _, stages = _run(pw, x, ids, wts, {**base, "w4a16": {"layout": LAYOUT}})
    assert stages == SORTED_STAGES and not calls and not pw.w4a16_views
    assert ops.prepare_w4a16_views(pw, K) == [] and not pw.w4a16_views
    monkeypatch.setattr(ops, "W4A16_MODE", ops.w4a16_mode("1"))
    # no "w4a16" in the config, a decode one at that: default_config on the default layout
    dec = ops.heuristic_config(pw.wfmt, E, H, I, K, N)
    assert dec.get("decode")
    out, stages = _run(pw, x, ids, wts, dec)
    assert stages == ["fused"] and len(calls) == 1
    default_key = ops.w4a16_layout_key(W.default_layout(H, I))
    ww = pw.w4a16_views[default_key]
    assert calls[0] == W.default_config(ww, N, K)
    assert rel_err(out, reference(x, ids, wts, w)) < TOL
    assert ops.prepare_w4a16_views(pw, K) == [default_key] and pw.w4a16_views[default_key] is ww


def test_weights_it_cannot_run_stay_on_their_path(device, monkeypatch, calls):
    """Not NVFP4: an entry's ``"w4a16"`` (and ``=1``) is passed over, the reason kept once."""
    from test_kernels import TOL as KTOL
    from test_kernels import make_weights as make_any
    from test_kernels import reference as ref_any

    E, H, I, N, K = 4, 64, 32, 5, 2
    w = make_any("fp16", E, H, I, device=device, seed=2)
    _, x, ids, wts = _inputs(E, H, I, N, K, device, seed=2)
    pw = ops.prepare_weights(w)
    base = ops.heuristic_config(pw.wfmt, E, H, I, K, N, allow_decode=False)
    monkeypatch.setattr(ops, "GROUPED_MM_MODE", "")
    monkeypatch.setattr(ops, "TMA_MODE", "0")
    monkeypatch.setattr(ops, "W4A16_MODE", "1")
    out, stages = _run(pw, x, ids, wts, {**base, "w4a16": {"layout": LAYOUT}})
    assert stages == SORTED_STAGES and not calls
    assert "reads NVFP4 weights" in pw.w4a16_views["why"]
    assert ops.prepare_w4a16_views(pw, K) == []
    assert rel_err(out, ref_any(x, ids, wts, w)) < KTOL["fp16"]


def test_a_config_it_cannot_take_at_this_token_count_runs_grouped(device, table_mode, calls):
    """An entry serves the token counts nearest to its own: a one-launch config asked for more
    tokens than its workspace holds runs the grouped W4A16 path."""
    E, H, I, N, K = 4, 64, 32, W.FUSED_MAX_TOKENS + 1, 1
    w, x, ids, wts = _inputs(E, H, I, N, K, device, seed=5)
    pw = ops.prepare_weights(w)
    base = ops.heuristic_config(pw.wfmt, E, H, I, K, N, allow_decode=False)
    out, stages = _run(pw, x, ids, wts, {**base, "w4a16": {"layout": LAYOUT, "fused": True}})
    assert stages == SORTED_STAGES and calls[0]["fused"] is False
    assert rel_err(out, reference(x, ids, wts, w)) < TOL


def test_bad_configs_are_named(device):
    w = make_weights(2, 64, 32, device=device)
    pw = ops.prepare_weights(w)
    with pytest.raises(ValueError, match="unknown key.*'BLOCK_M'"):
        ops.w4a16_layout(pw, {"BLOCK_M": 16})
    with pytest.raises(ValueError, match="down_cols"):
        ops.w4a16_layout(pw, {"layout": [64, 256, 128, 32]})
    with pytest.raises(ValueError, match="layout"):
        ops.w4a16_layout(pw, {"layout": "r128k128"})


def _backend(E, K):
    be = TritonExperts.__new__(TritonExperts)  # the setup's checks are the planner's business
    be.setup = types.SimpleNamespace(num_local_experts=E, runs_as="nvfp4_w4a16",
                                     problem=types.SimpleNamespace(name="l", top_k=K))
    return be


def _forward(be, x, ids, wts):
    return be.forward(Dispatched(layout="token_major", hidden=x, topk_ids=ids, topk_weights=wts))


def test_prepare_builds_what_the_table_names_and_the_table_picks_by_tokens(
        device, table_mode, tuned_table, calls):
    """"w4a16 at 16 tokens, the old decode path at 1": the backend's prepare repacks once, for
    the entry's layout; a 16-token call runs the W4A16 path on it, a 1-token call the decode."""
    E, H, I, N, K = 4, 64, 32, 16, 2
    w, x, ids, wts = _inputs(E, H, I, N, K, device, seed=4)
    dec = ops.heuristic_config(ops.K.WFMT_NVFP4, E, H, I, K, 1)
    base = ops.heuristic_config(ops.K.WFMT_NVFP4, E, H, I, K, N, allow_decode=False)
    w4 = {"layout": LAYOUT, "mma_sync": True, "num_stages": 3}
    tuned_table.write_text(json.dumps({ops.table_key("nvfp4_w4a16", E, H, I, K): {
        "1": dec, str(N): {**base, "w4a16": w4}}}))
    be = _backend(E, K)
    be.prepare(w)
    assert set(be.weights.w4a16_views) - {"why"} == {LAYOUT_KEY}
    ww = be.weights.w4a16_views[LAYOUT_KEY]
    out = _forward(be, x, ids, wts)
    assert len(calls) == 1 and calls[0] == {**W.default_config(ww, N, K), "mma_sync": True,
                                            "num_stages": 3}
    assert be.weights.w4a16_views[LAYOUT_KEY] is ww
    assert rel_err(out, reference(x, ids, wts, w)) < TOL
    one = _forward(be, x[:1], ids[:1], wts[:1])
    assert len(calls) == 1  # the decode path
    assert rel_err(one, reference(x[:1], ids[:1], wts[:1], w)) < TOL
    stages = []
    ops.fused_moe_prepared(x[:1], ids[:1], wts[:1], be.weights, _stages=stages)
    assert [s[0] for s in stages] == DECODE_STAGES


def test_prepare_builds_nothing_without_an_opt_in(device, table_mode, tuned_table, calls):
    E, H, I, N, K = 4, 64, 32, 16, 2
    w, x, ids, wts = _inputs(E, H, I, N, K, device, seed=6)
    base = ops.heuristic_config(ops.K.WFMT_NVFP4, E, H, I, K, N, allow_decode=False)
    tuned_table.write_text(json.dumps({
        ops.table_key("nvfp4_w4a16", E, H, I, K): {str(N): base},
        # another shape's "w4a16" is not this layer's
        ops.table_key("nvfp4_w4a16", E, 128, I, K): {str(N): {**base, "w4a16": {}}}}))
    be = _backend(E, K)
    be.prepare(w)
    assert set(be.weights.w4a16_views) <= {"why"}
    out = _forward(be, x, ids, wts)
    assert not calls and set(be.weights.w4a16_views) <= {"why"}
    assert rel_err(out, reference(x, ids, wts, w)) < TOL


def test_the_mode_is_read_from_the_environment_and_a_bad_one_is_named():
    code = "import moe_runtime_triton.ops as o; print(repr(o.W4A16_MODE))"
    for value, want in (("1", "'1'"),):
        env = {**os.environ, ops.W4A16_ENV: value}
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True)
        assert res.stdout.split() == [want]
    env = {**os.environ, ops.W4A16_ENV: "yes"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode != 0 and "MOE_TRITON_W4A16='yes'" in res.stderr
    with pytest.raises(ValueError, match="MOE_TRITON_W4A16='on'.*accepted values are '0'"):
        ops.w4a16_mode("on")
