"""Fixtures that install real plugin distributions (pip, into a throwaway folder) for tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_runtime.testing.dists import build_plugin_dist, pip_install_target

GOOD_PLUGIN = '''
    from moe_runtime import hookimpl, ExpertsBackendSpec, Support, Hardware, CapabilityRange

    SPEC = ExpertsBackendSpec(
        name="sm100_nvfp4",
        factory="sm100_plugin.kernels:Experts",
        supports=[Support(formats=["nvfp4_w4a4"], layouts=["token_major"],
                          hardware=Hardware(devices=["cuda"],
                                            cuda_capabilities=[CapabilityRange.exactly("10.0")]))],
        priority=50,
        description="a third-party NVFP4 backend for tests",
    )

    @hookimpl
    def moe_runtime_register_backends(register):
        register(SPEC)
'''

BROKEN_PLUGIN = '''
    raise ImportError("this plugin is broken on purpose")
'''

TYPO_PLUGIN = '''
    from moe_runtime import hookimpl

    @hookimpl
    def moe_runtime_register_backend(register):  # misspelled: the hook ends in "backends"
        pass
'''

COLLIDING_PLUGIN = '''
    from moe_runtime import hookimpl, ExpertsBackendSpec, Support

    @hookimpl
    def moe_runtime_register_backends(register):
        register(ExpertsBackendSpec(name="reference", factory="x:Y",
                                    supports=[Support(formats=["bf16"])]))
'''


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> Path:
    """A folder holding installed distributions: a good plugin and a broken one."""
    root = tmp_path_factory.mktemp("plugins")
    target = root / "site"
    srcs = [
        build_plugin_dist(root, "moe-runtime-sm100-test", "sm100_plugin", "sm100_test",
                          GOOD_PLUGIN),
        build_plugin_dist(root, "moe-runtime-broken-test", "broken_plugin", "broken_test",
                          BROKEN_PLUGIN),
        build_plugin_dist(root, "moe-runtime-typo-test", "typo_plugin", "typo_test",
                          TYPO_PLUGIN),
    ]
    pip_install_target(srcs, target)
    return target


@pytest.fixture(scope="session")
def colliding_site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("colliding")
    target = root / "site"
    pip_install_target([build_plugin_dist(root, "moe-runtime-collide-test", "collide_plugin",
                                          "collide_test", COLLIDING_PLUGIN)], target)
    return target


@pytest.fixture
def with_site(monkeypatch):
    """Put an installed-distributions folder on sys.path (as a PYTHONPATH entry would)."""

    def add(site: Path):
        monkeypatch.syspath_prepend(str(site))
        import importlib

        importlib.invalidate_caches()

    return add
