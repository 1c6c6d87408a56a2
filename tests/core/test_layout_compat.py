"""The module moves keep old code working: the old import paths are the new objects, and a
third-party plugin written with them still loads through its entry point and passes conformance."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from moe_runtime.testing.dists import build_plugin_dist, pip_install_target, run_cli

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "moe-runtime-example-backend" / "moe_runtime_example"

#: old module -> the modules that now hold what it exports
MOVED = {
    "moe_runtime.hookspecs": ("moe_runtime.plugin.hookspecs",),
    "moe_runtime.manager": ("moe_runtime.plugin.manager", "moe_runtime.plugin.registry"),
    "moe_runtime.builtin": ("moe_runtime.plugin.builtin",),
    "moe_runtime.first_party": ("moe_runtime.plugin.first_party",),
    "moe_runtime.runtime": ("moe_runtime.backend_api",),
    "moe_runtime.layer": ("moe_runtime.executor",),
    "moe_runtime.model_plan": ("moe_runtime.checkpoint.problems",),
    "moe_runtime.tensors": ("moe_runtime.checkpoint.tensors",),
}
#: the shims of the plugin/ move, which say in their docstring that they are deprecated
PLUGIN_SHIMS = ("moe_runtime.hookspecs", "moe_runtime.manager", "moe_runtime.builtin",
                "moe_runtime.first_party")


def _exports(module) -> dict[str, object]:
    return {k: v for k, v in vars(module).items()
            if not k.startswith("__") and not isinstance(v, type(module))}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_name_of_an_old_module_is_the_object_of_its_new_module(old):
    shim = importlib.import_module(old)
    homes = [importlib.import_module(m) for m in MOVED[old]]
    exports = _exports(shim)
    assert exports, f"{old} re-exports nothing"
    for name, obj in exports.items():
        assert any(getattr(h, name, None) is obj for h in homes), (
            f"{old}.{name} is not the object of the same name in {', '.join(MOVED[old])}")


@pytest.mark.parametrize("old", PLUGIN_SHIMS)
def test_plugin_shims_say_they_are_deprecated_and_where_the_code_went(old):
    doc = importlib.import_module(old).__doc__ or ""
    assert doc.startswith("Deprecated"), f"{old}: the docstring does not start with 'Deprecated'"
    for new in MOVED[old]:
        assert new in doc, f"{old}: the docstring does not name {new}"


def test_the_names_todays_docs_use_are_the_new_objects():
    import moe_runtime
    import moe_runtime.hookspecs as old_specs
    import moe_runtime.manager as old_manager
    import moe_runtime.runtime as old_runtime
    from moe_runtime import backend_api
    from moe_runtime.plugin import hookspecs, manager, registry

    assert moe_runtime.hookimpl is old_specs.hookimpl is hookspecs.hookimpl
    assert moe_runtime.hookspec is old_specs.hookspec is hookspecs.hookspec
    assert moe_runtime.Registry is old_manager.Registry is registry.Registry
    assert moe_runtime.get_plugin_manager is old_manager.get_plugin_manager is manager.get_plugin_manager
    assert old_manager.PluginOptions is manager.PluginOptions
    assert old_manager.ENTRYPOINT_GROUP == manager.ENTRYPOINT_GROUP == "moe_runtime"
    assert old_runtime.ExpertsBackend is backend_api.ExpertsBackend


def test_the_manager_registers_the_builtin_plugin_from_its_new_module_and_the_shim_has_no_hooks():
    import moe_runtime.builtin as shim
    from moe_runtime.plugin import builtin
    from moe_runtime.plugin.manager import get_plugin_manager

    pm = get_plugin_manager(autoload=False, environ={})
    assert pm.get_plugin("builtin") is builtin
    info = next(i for i in pm.plugin_infos if i.name == "builtin")
    assert (info.module, info.status) == ("moe_runtime.plugin.builtin", "loaded")
    # the shim re-exports declarations only: registering it too would declare nothing twice
    assert not [k for k in vars(shim) if k.startswith("moe_runtime_")]


# ------------------------------------------------------ a plugin written against the old paths

_OLD_IMPORTS = {
    # docs/writing-a-backend.md's plugin module, with the hook marker from its old module
    "from moe_runtime import CapabilityRange, ExpertsBackendSpec, Hardware, Support, hookimpl":
        "from moe_runtime.declarations import CapabilityRange, ExpertsBackendSpec, Hardware, Support\n"
        "from moe_runtime.hookspecs import hookimpl",
    # and its backend, with the backend API from its old module
    "from moe_runtime.backend_api import Dispatched, ExpertsBackend, ExpertWeights":
        "from moe_runtime.runtime import Dispatched, ExpertsBackend, ExpertWeights",
}
_MODULE, _BACKEND, _PLUGIN, _DIST = "moe_runtime_oldpaths", "oldpaths_bmm", "oldpaths", \
    "moe-runtime-oldpaths"


def _with_old_imports(path: Path) -> str:
    text = path.read_text()
    for new, old in _OLD_IMPORTS.items():
        if new in text:
            text = text.replace(new, old)
    assert not re.search(r"moe_runtime\.(plugin|backend_api)\b", text), (
        f"{path} imports a new path this test does not turn into an old one")
    return text.replace("moe_runtime_example", _MODULE).replace('"example_bmm"', f'"{_BACKEND}"')


@pytest.fixture(scope="module")
def old_paths_site(tmp_path_factory):
    plugin = _with_old_imports(EXAMPLE / "plugin.py")
    experts = _with_old_imports(EXAMPLE / "experts.py")
    assert "from moe_runtime.hookspecs import hookimpl" in plugin
    assert "from moe_runtime.runtime import" in experts
    root = tmp_path_factory.mktemp("oldpaths")
    src = build_plugin_dist(root, _DIST, _MODULE, _PLUGIN, plugin, {"experts": experts})
    site = root / "site"
    pip_install_target([src], site)
    assert list(site.glob("moe_runtime_oldpaths-*.dist-info")), "pip installed no dist-info"
    return site


@pytest.mark.slow
def test_a_plugin_written_with_the_old_paths_loads_through_its_entry_point(old_paths_site):
    out = run_cli("--strict-plugins", "plugins", "--json", site=old_paths_site, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    plugin = next(p for p in data["plugins"] if p["name"] == _PLUGIN)
    assert (plugin["distribution"], plugin["module"], plugin["status"]) == (
        _DIST, _MODULE, "loaded")
    backend = next(b for b in data["experts_backends"] if b["name"] == _BACKEND)
    assert backend["plugin"] == _PLUGIN


@pytest.mark.slow
def test_a_plugin_written_with_the_old_paths_passes_conformance(old_paths_site):
    out = run_cli("--strict-plugins", "conformance", _BACKEND, site=old_paths_site)
    summary = (out.stdout.strip().splitlines() or [""])[-1]
    assert out.returncode == 0 and " passed" in summary, (out.stdout + out.stderr)[-3000:]
    assert not re.search(r"\d+ (failed|error)", summary), summary
