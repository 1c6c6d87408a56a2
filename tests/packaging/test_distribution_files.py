"""The core's wheel carries LICENSE and py.typed, and its requirements leave modelopt optional."""

from __future__ import annotations

import email
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    from importlib import metadata, util

    from packaging.version import Version

    if Version(metadata.version("setuptools")) < Version("70.1") and not util.find_spec("wheel"):
        pytest.skip("building a wheel without an index needs setuptools>=70.1 or wheel here")
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    # --no-build-isolation: the tests' environment already has setuptools; no index is needed
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(out), str(ROOT)],
                   check=True, timeout=300, cwd=build)
    (path,) = out.glob("moe_runtime-*.whl")
    return zipfile.ZipFile(path)


def _metadata(wheel: zipfile.ZipFile):
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(wheel.read(name))


def test_license_file_is_the_apache_2_license_and_ships_in_the_wheel(wheel):
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert "Version 2.0, January 2004" in (ROOT / "LICENSE").read_text()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel.namelist())


def test_py_typed_ships_in_the_wheel(wheel):
    assert "moe_runtime/py.typed" in wheel.namelist()


def test_main_module_ships_in_the_wheel(wheel):
    assert "moe_runtime/__main__.py" in wheel.namelist()


def test_modelopt_is_required_only_by_the_default_model_extra(wheel):
    for line in _metadata(wheel).get_all("Requires-Dist"):
        req = Requirement(line)
        if req.name == "nvidia-modelopt":
            assert req.marker is not None and "default-model" in str(req.marker), line


def test_transformers_requirement_is_bounded_below_the_next_major(wheel):
    (req,) = [Requirement(line) for line in _metadata(wheel).get_all("Requires-Dist")
              if Requirement(line).name == "transformers" and Requirement(line).marker is None]
    assert not req.specifier.contains("4.57.0")  # older than what the code imports
    assert req.specifier.contains("5.24.0")  # newer than nvidia-modelopt's own range
    assert not req.specifier.contains("6.0.0")


@pytest.mark.parametrize("plugin", sorted(p.name for p in (ROOT / "plugins").iterdir()
                                           if (p / "setup.cfg").exists()))
def test_each_plugin_folder_has_the_license(plugin):
    assert (ROOT / "plugins" / plugin / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
