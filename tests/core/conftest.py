"""Fixtures that install real plugin distributions (pip, into a throwaway folder) for tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def build_plugin_dist(root: Path, dist: str, module: str, ep_name: str, code: str) -> Path:
    """Write a one-module distribution with an entry point in the ``moe_runtime`` group."""
    src = root / f"src-{dist}"
    (src / module).mkdir(parents=True)
    (src / module / "__init__.py").write_text(textwrap.dedent(code))
    (src / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "1.2.3"

        [project.entry-points.moe_runtime]
        {ep_name} = "{module}"

        [tool.setuptools]
        packages = ["{module}"]
    """))
    return src


def pip_install_target(srcs: list[Path], target: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), *map(str, srcs)],
        check=True, capture_output=True,
    )


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


def run_cli(*args: str, site: Path | None = None, env: dict | None = None):
    environ = dict(os.environ)
    environ.pop("MOE_RUNTIME_BLOCK_PLUGINS", None)
    if site is not None:
        environ["PYTHONPATH"] = str(site) + os.pathsep + environ.get("PYTHONPATH", "")
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "moe_runtime.cli", *args], env=environ,
                          capture_output=True, text=True, timeout=120)
