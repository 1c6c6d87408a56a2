"""`moe-runtime --version`, `python -m moe_runtime`, and one version source per distribution."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import moe_runtime
from moe_runtime.cli import main, version_text

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = {
    "plugins/triton": "moe_runtime_triton",
    "plugins/flashinfer_cutedsl": "moe_runtime_flashinfer_cutedsl",
    "plugins/deepep": "moe_runtime_deepep",
    "plugins/humming": "moe_runtime_humming",
}


def test_every_plugin_folder_is_listed_here():
    folders = {f"plugins/{p.name}" for p in (ROOT / "plugins").iterdir() if (p / "setup.cfg").exists()}
    assert folders == set(PLUGINS)


def _setup_cfg(folder: Path) -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(folder / "setup.cfg")
    return cfg


def test_version_prints_the_core_version_first(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"moe-runtime {moe_runtime.__version__}"


def test_version_lists_every_entry_point_plugin_with_its_distribution_version():
    text = version_text()
    for ep in metadata.entry_points(group="moe_runtime"):
        assert f"plugin {ep.name}: {ep.dist.name} {ep.dist.version}" in text


def test_installed_core_version_is_the_package_version():
    assert metadata.version("moe-runtime") == moe_runtime.__version__


def test_python_dash_m_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "moe_runtime", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: moe-runtime")
    assert "--version" in out.stdout


@pytest.mark.parametrize("folder", ["."] + sorted(PLUGINS))
def test_each_distribution_reads_its_version_from_its_package(folder):
    package = PLUGINS.get(folder, "moe_runtime")
    version = _setup_cfg(ROOT / folder)["metadata"]["version"].strip()
    assert version == f"attr: {package}.__version__"
    init = (ROOT / folder / package.replace(".", "/") / "__init__.py").read_text()
    assert len(re.findall(r"^__version__ = \"[^\"]+\"$", init, re.M)) == 1


@pytest.mark.parametrize("folder", sorted(PLUGINS))
def test_plugins_pin_a_core_range_that_holds_this_core_and_caps_its_minor(folder):
    reqs = [Requirement(line.split("#")[0].strip())
            for line in _setup_cfg(ROOT / folder)["options"]["install_requires"].splitlines()
            if line.split("#")[0].strip()]
    (core,) = [r for r in reqs if r.name == "moe-runtime"]
    assert core.specifier.contains(moe_runtime.__version__)
    major, minor = (int(x) for x in moe_runtime.__version__.split(".")[:2])
    assert not core.specifier.contains(f"{major}.{minor + 1}.0")
