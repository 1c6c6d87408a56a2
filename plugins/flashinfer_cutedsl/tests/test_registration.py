"""The plugin as an installed distribution: its entry point, its registration, its imports."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys

from moe_runtime.plugin.registry import Registry
from moe_runtime_flashinfer_cutedsl import plugin

KERNEL_MODULES = ("flashinfer", "cutlass", "triton", "deep_gemm", "cuda.bindings", "tvm_ffi")


def _entry_point():
    eps = [ep for ep in md.entry_points(group="moe_runtime") if ep.name == "flashinfer_cutedsl"]
    assert len(eps) == 1, ("install the plugin first: pip install --no-deps --no-build-isolation "
                           "-e plugins/flashinfer_cutedsl")
    return eps[0]


def test_the_distribution_declares_its_entry_point_in_the_moe_runtime_group():
    ep = _entry_point()
    assert ep.value == "moe_runtime_flashinfer_cutedsl.plugin"
    assert ep.dist.name == "moe-runtime-flashinfer-cutedsl"


def test_the_registry_loads_the_backend_from_the_entry_point():
    reg = Registry.load(environ={})
    info = [i for i in reg.plugin_infos if i.name == "flashinfer_cutedsl"]
    assert [i.status for i in info] == ["loaded"], info
    assert info[0].distribution == "moe-runtime-flashinfer-cutedsl"
    registered = reg.experts["flashinfer_cutedsl"]
    assert registered.plugin == "flashinfer_cutedsl"
    assert registered.spec is plugin.SPEC
    assert registered.spec.factory == "moe_runtime_flashinfer_cutedsl.backend:CuteDslExperts"


def test_declared_capabilities_are_exactly_10_0_10_3_10_7():
    assert plugin.supported_capabilities() == ((10, 0), (10, 3), (10, 7))
    for s in plugin.SPEC.supports:
        assert s.hardware.devices == frozenset({"cuda"})
        assert [(r.min, r.max) for r in s.hardware.cuda_capabilities] == [
            ((10, 0), (10, 0)), ((10, 3), (10, 3)), ((10, 7), (10, 7))]
        assert s.hardware.requires == ("flashinfer", "cutlass")


def _fresh_python(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loading_every_plugin_imports_no_kernel_library_and_not_the_backend():
    bad = _fresh_python(
        "import sys, json; from moe_runtime.plugin.registry import Registry; "
        "r = Registry.load(environ={}); assert 'flashinfer_cutedsl' in r.experts; "
        f"names = {KERNEL_MODULES!r} + ('moe_runtime_flashinfer_cutedsl.backend', "
        "'moe_runtime_flashinfer_cutedsl.weights'); "
        "print(json.dumps([m for m in names if m in sys.modules]))"
    )
    assert bad == []


def test_the_entry_point_module_adds_nothing_but_itself_to_what_the_core_imports():
    added = _fresh_python(
        "import sys, json; import moe_runtime.plugin.registry, moe_runtime.declarations; "
        "before = set(sys.modules); import moe_runtime_flashinfer_cutedsl.plugin; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    assert added == ["moe_runtime_flashinfer_cutedsl", "moe_runtime_flashinfer_cutedsl.plugin"]
    assert "torch" not in added
