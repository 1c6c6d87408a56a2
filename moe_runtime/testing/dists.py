"""Build and install throwaway plugin distributions, for tests of plugin discovery.

They are real distributions (metadata, entry point in the ``moe_runtime`` group) installed by pip
into a folder that a test puts on ``sys.path`` or ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def build_plugin_dist(root: Path, dist: str, module: str, ep_name: str, code: str,
                      extra_modules: dict[str, str] | None = None) -> Path:
    """Write a one-package distribution whose entry point ``ep_name`` is the package itself."""
    src = Path(root) / f"src-{dist}"
    (src / module).mkdir(parents=True)
    (src / module / "__init__.py").write_text(textwrap.dedent(code))
    for name, body in (extra_modules or {}).items():
        (src / module / f"{name}.py").write_text(textwrap.dedent(body))
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
    """``pip install --target`` without dependencies or network."""
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), *map(str, srcs)],
        capture_output=True, text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"pip install --target failed:\n{r.stdout}\n{r.stderr}")


def run_cli(*args: str, site: Path | None = None, env: dict | None = None, timeout: float = 900):
    """Run ``python -m moe_runtime.cli ARGS`` with ``site`` on PYTHONPATH (a whole conformance run of
    several backends takes about a minute on two idle cores; the bound is for a hung run)."""
    environ = dict(os.environ)
    environ.pop("MOE_RUNTIME_BLOCK_PLUGINS", None)
    if site is not None:
        environ["PYTHONPATH"] = str(site) + os.pathsep + environ.get("PYTHONPATH", "")
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "moe_runtime.cli", *args], env=environ,
                          capture_output=True, text=True, timeout=timeout)
