"""The declaration as installed: entry point, import hygiene, what each mode says, the CLI."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys

from moe_runtime import formats as F
from moe_runtime.declarations import describe_comm_support

from moe_runtime_deepep import limits
from moe_runtime_deepep.plugin import DeepEPPlugin, build_spec, mode_for_layout
from moe_runtime_deepep.settings import DeepEPSettings


def test_distribution_declares_the_entry_point():
    eps = [ep for ep in md.entry_points(group="moe_runtime") if ep.name == "deepep"]
    assert len(eps) == 1
    assert eps[0].value == "moe_runtime_deepep.plugin"
    assert eps[0].dist.name == "moe-runtime-deepep"


def test_entry_point_module_imports_neither_torch_nor_deep_ep():
    code = (
        "import sys, json\n"
        "import importlib.metadata as md\n"
        "ep = [e for e in md.entry_points(group='moe_runtime') if e.name == 'deepep'][0]\n"
        "ep.load()\n"
        "from moe_runtime.plugin.registry import Registry\n"
        "Registry.load(environ={})\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'deep_ep', 'deep_ep_cpp'))))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_RUNTIME_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_modes_layouts_payloads_and_world_sizes():
    spec = build_spec(DeepEPSettings())
    ll = [m for m in spec.supports if m.mode == "low_latency"]
    normal = [m for m in spec.supports if m.mode == "normal"]
    assert spec.supports[0].mode == "low_latency"  # preferred where the batch fits its bound
    assert {m.layout for m in ll} == {F.MASKED} and {m.layout for m in normal} == {F.TOKEN_MAJOR}
    assert all(m.payloads == {F.UNQUANTIZED} for m in ll)
    assert all(m.payloads == {F.UNQUANTIZED, F.FP8} for m in normal)
    assert all(m.max_tokens_per_rank == 128 for m in ll)
    assert all(m.max_tokens_per_rank is None for m in normal)
    assert [m.world_sizes for m in normal] == [{2, 4, 8}]
    assert [m.world_sizes for m in ll] == [set(range(2, 8)) | set(range(8, 65, 8))]
    assert not any(m.allows_world_size(1) for m in spec.supports)
    for m in spec.supports:
        d = describe_comm_support(m)
        assert d["devices"] == ["cuda"] and d["cuda_capabilities"] == "9.0+"
        assert set(d["requires"]) == {"deep_ep", "torch"}
    assert spec.factory == "moe_runtime_deepep.backend:DeepEPComm"


def test_world_sizes_follow_deepeps_buffer_rule():
    declared = set()
    for lo, hi in limits.low_latency_world_sizes():
        declared.update(range(lo, hi + 1))
    for w in range(1, 70):
        ok = w >= 2 and (w < 8 or w % 8 == 0) and w <= 64
        assert (w in declared) == ok, w


def test_a_plugin_object_declares_explicit_settings():
    from moe_runtime.plugin.registry import Registry

    plugin = DeepEPPlugin(DeepEPSettings(ll_max_tokens_per_rank=64))
    reg = Registry.load(autoload=False, plugins=[plugin], environ={})
    assert {m.max_tokens_per_rank for m in reg.comm_spec("deepep").supports
            if m.mode == "low_latency"} == {64}


def test_split_declares_the_bound_of_its_rounds():
    split = DeepEPSettings(ll_max_tokens_per_rank=64, ll_oversize="split",
                           ll_split_max_tokens_per_rank=200)
    spec = build_spec(split)
    assert {m.mode: m.max_tokens_per_rank for m in spec.supports} == {
        "low_latency": 200, "normal": None}
    assert "every low-latency forward runs 4 rounds of at most 64 tokens per rank" in \
        spec.description
    assert "rounds" not in build_spec(DeepEPSettings()).description


def test_layout_to_mode():
    assert mode_for_layout(F.MASKED) == "low_latency"
    assert mode_for_layout(F.TOKEN_MAJOR) == "normal"


def test_cli_lists_the_modes():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_RUNTIME_")}
    out = subprocess.run([sys.executable, "-m", "moe_runtime.cli", "plugins"], capture_output=True,
                         text=True, check=True, env=env, timeout=120).stdout
    assert "deepep (moe-runtime-deepep 0.1.0): loaded" in out
    assert ("mode low_latency: layout masked; payloads unquantized; "
            "world size 2, 3, 4, 5, 6, 7, 8, 16") in out
    assert "mode normal: layout token_major; payloads fp8,unquantized; world size 2, 4, 8;" in out
