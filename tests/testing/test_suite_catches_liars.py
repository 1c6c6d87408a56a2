"""The suite, not the plugin author, decides what "supports X" means: a backend whose declaration
lies fails it."""

from __future__ import annotations

import os
import re

import pytest

from moe_runtime.testing.dists import build_plugin_dist, pip_install_target

LIAR = '''
    from moe_runtime import ExpertsBackendSpec, Hardware, Support, hookimpl

    @hookimpl
    def moe_runtime_register_backends(register):
        register(ExpertsBackendSpec(
            name="liar", factory="liar_plugin.experts:LiarExperts", priority=-1,
            supports=[Support(formats=["bf16", "nvfp4_w4a16"], activations=["silu"],
                              hardware=Hardware(devices=["cpu"]))],
        ))
'''

# Runs bf16 right, but "forgets" NVFP4's block scales: declares NVFP4, computes something else.
LIAR_EXPERTS = '''
    import attrs
    import torch
    from moe_runtime.backends.reference import ReferenceExperts

    class LiarExperts(ReferenceExperts):
        def prepare(self, weights):
            if weights.format.startswith("nvfp4"):
                ones = torch.full(weights.w13_scale.shape, 1.0).to(weights.w13_scale.dtype)
                ones2 = torch.full(weights.w2_scale.shape, 1.0).to(weights.w2_scale.dtype)
                weights = attrs.evolve(weights, w13_scale=ones, w2_scale=ones2)
            super().prepare(weights)
'''


@pytest.fixture(scope="module")
def liar_site(tmp_path_factory):
    root = tmp_path_factory.mktemp("liar")
    src = build_plugin_dist(root, "moe-runtime-liar", "liar_plugin", "liar", LIAR,
                            {"experts": LIAR_EXPERTS})
    pip_install_target([src], root / "site")
    return root / "site"


def test_lying_declaration_fails_the_suite(pytester, liar_site, monkeypatch):
    pytester.makeconftest('pytest_plugins = ["moe_runtime.testing.plugin"]\n')
    pytester.makepyfile(test_conf="from moe_runtime.testing.suite import *  # noqa\n")
    env_path = str(liar_site) + os.pathsep + os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", env_path)
    result = pytester.runpytest_subprocess("--moe-conformance", "liar", "-q", "-p", "no:cacheprovider")
    out = result.stdout.str()
    failed = set(re.findall(r"FAILED \S+\[(liar-[^\]]+)\]", out))
    assert failed, out[-3000:]
    assert all("nvfp4_w4a16" in f for f in failed), failed
    # the honest part of the declaration passes
    assert result.parseoutcomes()["passed"] >= 6
    assert "bf16" not in " ".join(failed)


def test_suite_refuses_to_run_without_a_backend(pytester):
    pytester.makeconftest('pytest_plugins = ["moe_runtime.testing.plugin"]\n')
    pytester.makepyfile(test_conf="from moe_runtime.testing.suite import *  # noqa\n")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    assert result.ret != 0
    assert "needs backends to check" in result.stderr.str() + result.stdout.str()


def test_refusals_are_generated_for_undeclared_formats(liar_site, monkeypatch):
    monkeypatch.syspath_prepend(str(liar_site))
    from moe_runtime.plugin.registry import Registry
    from moe_runtime.testing import refusal_cases

    reg = Registry.load(environ={})
    cases = refusal_cases(reg, reg.experts_spec("liar"))
    reasons = {(c.format, c.activation, c.expected, c.environment) for c in cases}
    assert ("fp8_w8a8", "silu", "unsupported_format", "cpu") in reasons
    assert ("nvfp4_w4a4", "silu", "unsupported_format", "cpu") in reasons
    assert ("bf16", "gelu", "unsupported_activation", "cpu") in reasons
    assert not any(c.format == "bf16" and c.expected == "unsupported_format" for c in cases)
