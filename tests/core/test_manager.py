"""Plugin discovery: real installed distributions, loaded one by one."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pluggy
import pytest

from moe_runtime import hookimpl
from moe_runtime.plugin.manager import PluginError, get_plugin_manager
from moe_runtime.plugin.registry import Registry, RegistryError
from moe_runtime.testing.dists import run_cli


def _infos(pm):
    return {i.name: i for i in pm.plugin_infos}


def test_entry_point_plugin_is_loaded_with_its_distribution(plugin_site, with_site):
    with_site(plugin_site)
    pm = get_plugin_manager(environ={})
    info = _infos(pm)["sm100_test"]
    assert info.status == "loaded"
    assert info.distribution == "moe-runtime-sm100-test"
    assert info.version == "1.2.3"
    reg = Registry.from_plugin_manager(pm)
    assert reg.experts["sm100_nvfp4"].plugin == "sm100_test"


def test_broken_plugin_is_reported_and_skipped(plugin_site, with_site):
    with_site(plugin_site)
    pm = get_plugin_manager(environ={})
    info = _infos(pm)["broken_test"]
    assert info.status == "failed"
    assert "broken on purpose" in info.error
    assert info.distribution == "moe-runtime-broken-test"
    # the others still load
    assert "reference" in Registry.from_plugin_manager(pm).experts


def test_broken_plugin_is_fatal_in_strict_mode(plugin_site, with_site):
    with_site(plugin_site)
    with pytest.raises(PluginError, match="broken_test.*moe-runtime-broken-test"):
        get_plugin_manager(strict=True, environ={})


def test_misspelled_hook_in_an_installed_plugin_is_reported_not_fatal(plugin_site, with_site):
    with_site(plugin_site)
    pm = get_plugin_manager(environ={})
    info = _infos(pm)["typo_test"]
    assert info.status == "failed" and "moe_runtime_register_backend" in info.error
    assert not pm.has_plugin("typo_test")
    with pytest.raises(PluginError, match="typo_test"):
        get_plugin_manager(strict=True, blocked=["broken_test"], environ={})


def test_strict_mode_from_environment(plugin_site, with_site):
    with_site(plugin_site)
    with pytest.raises(PluginError):
        get_plugin_manager(environ={"MOE_RUNTIME_STRICT_PLUGINS": "1"})


def test_blocked_plugin_is_not_imported(plugin_site, with_site):
    with_site(plugin_site)
    sys.modules.pop("broken_plugin", None)
    pm = get_plugin_manager(blocked=["broken_test", "typo_test"], strict=True, environ={})
    assert _infos(pm)["broken_test"].status == "blocked"
    assert "broken_plugin" not in sys.modules


def test_block_list_from_environment(plugin_site, with_site):
    with_site(plugin_site)
    pm = get_plugin_manager(environ={"MOE_RUNTIME_BLOCK_PLUGINS": "sm100_test, broken_test"})
    assert _infos(pm)["sm100_test"].status == "blocked"
    assert "sm100_nvfp4" not in Registry.from_plugin_manager(pm).experts


def test_autoload_can_be_switched_off(plugin_site, with_site):
    with_site(plugin_site)
    pm = get_plugin_manager(environ={"MOE_RUNTIME_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert set(_infos(pm)) == {"builtin"}


def test_same_backend_name_from_two_plugins_names_both(colliding_site, with_site):
    with_site(colliding_site)
    pm = get_plugin_manager(environ={})
    with pytest.raises(RegistryError, match="'reference'.*'builtin'.*'collide_test'") as err:
        Registry.from_plugin_manager(pm)
    # the advice names the option that works: the built-ins are blocked only as a whole
    assert "block one with -p no:collide_test (MOE_RUNTIME_BLOCK_PLUGINS=collide_test" in str(
        err.value)
    assert "no:builtin" not in str(err.value) and "no:NAME" not in str(err.value)
    # and following it loads the registry, the built-in 'reference' kept
    reg = Registry.from_plugin_manager(get_plugin_manager(blocked=["collide_test"], environ={}))
    assert reg.experts["reference"].plugin == "builtin"


def test_misspelled_hook_implementation_fails():
    plugin = types.ModuleType("typo_plugin")

    @hookimpl
    def moe_runtime_register_backend(register):  # missing "s"
        pass

    plugin.moe_runtime_register_backend = moe_runtime_register_backend
    with pytest.raises(pluggy.PluginValidationError, match="moe_runtime_register_backend"):
        get_plugin_manager(autoload=False, plugins=[plugin], environ={})


def test_each_manager_is_fresh():
    a = get_plugin_manager(autoload=False, environ={})
    b = get_plugin_manager(autoload=False, environ={})
    assert a is not b
    assert a.get_plugins() != set() and a.hook is not b.hook


def test_declaring_an_unregistered_format_is_an_error():
    from moe_runtime import ExpertsBackendSpec, Support

    plugin = types.ModuleType("bad_format_plugin")

    @hookimpl
    def moe_runtime_register_backends(register):
        register(ExpertsBackendSpec(name="x", factory="m:C",
                                    supports=[Support(formats=["int3_magic"])]))

    plugin.moe_runtime_register_backends = moe_runtime_register_backends
    pm = get_plugin_manager(autoload=False, plugins=[plugin], environ={})
    with pytest.raises(RegistryError, match="int3_magic.*registered formats"):
        Registry.from_plugin_manager(pm)


def _format_plugin(fmt):
    from moe_runtime import ExpertsBackendSpec, Support

    plugin = types.ModuleType("fmt_plugin")

    @hookimpl
    def moe_runtime_register_formats(register):
        register(fmt)

    @hookimpl
    def moe_runtime_register_backends(register):
        register(ExpertsBackendSpec(name="mx", factory="m:C",
                                    supports=[Support(formats=[fmt.name])]))

    plugin.moe_runtime_register_formats = moe_runtime_register_formats
    plugin.moe_runtime_register_backends = moe_runtime_register_backends
    return plugin


def test_a_plugin_format_of_an_unknown_storage_is_refused_at_registration():
    from moe_runtime.formats import WeightFormat

    plugin = _format_plugin(WeightFormat("mxfp4_w4a16", 4, 0.53, description="MXFP4 weights"))
    with pytest.raises(RegistryError, match=r"'mxfp4_w4a16' .*encoding None.*nvfp4.*no hook"):
        Registry.from_plugin_manager(get_plugin_manager(autoload=False, plugins=[plugin],
                                                        environ={}))


def test_a_plugin_format_the_reference_cannot_emulate_is_refused():
    from moe_runtime.formats import WeightFormat

    # bf16 storage with fp8-quantized activations: no built-in format computes that
    plugin = _format_plugin(WeightFormat("bf16_a8", 16, 2.0, "fp8", encoding="bf16"))
    with pytest.raises(RegistryError, match="no built-in format stores 'bf16' weights"):
        Registry.from_plugin_manager(get_plugin_manager(autoload=False, plugins=[plugin],
                                                        environ={}))


def test_plugin_can_add_a_format():
    from moe_runtime import ExpertsBackendSpec, Support
    from moe_runtime.formats import WeightFormat

    plugin = types.ModuleType("mxfp4_plugin")

    @hookimpl
    def moe_runtime_register_formats(register):
        register(WeightFormat("nvfp4_w4a16_v2", 4, 0.5625, description="NVFP4, another name",
                              encoding="nvfp4"))

    @hookimpl
    def moe_runtime_register_backends(register):
        register(ExpertsBackendSpec(name="mx", factory="m:C",
                                    supports=[Support(formats=["nvfp4_w4a16_v2"])]))

    plugin.moe_runtime_register_formats = moe_runtime_register_formats
    plugin.moe_runtime_register_backends = moe_runtime_register_backends
    reg = Registry.from_plugin_manager(
        get_plugin_manager(autoload=False, plugins=[plugin], environ={}))
    assert reg.formats["nvfp4_w4a16_v2"].plugin == "mxfp4_plugin"
    assert "mx" in reg.experts


def test_cli_plugins_lists_installed_and_broken(plugin_site):
    r = run_cli("plugins", "--json", site=plugin_site)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    by_name = {p["name"]: p for p in data["plugins"]}
    assert by_name["sm100_test"]["status"] == "loaded"
    assert by_name["broken_test"]["status"] == "failed"
    assert "broken on purpose" in by_name["broken_test"]["error"]
    backends = {b["name"]: b for b in data["experts_backends"]}
    assert backends["sm100_nvfp4"]["plugin"] == "sm100_test"
    assert backends["sm100_nvfp4"]["supports"][0]["cuda_capabilities"] == "10.0"
    # what each promises about CUDA graphs (the test plugin does not; triton does)
    assert backends["sm100_nvfp4"]["cuda_graphs"] is False
    assert backends["triton"]["cuda_graphs"] is True and backends["reference"]["cuda_graphs"] is False
    text = run_cli("plugins", site=plugin_site).stdout
    assert "triton [plugin triton, priority 30, CUDA graphs]" in text
    assert "reference [plugin builtin, priority 0] " in text
    # a compute capability only for blocks that run on CUDA (cpu_dequantized's are CPU-only)
    lines = text.splitlines()
    cpu_only = lines[lines.index(next(x for x in lines if x.startswith("  cpu_dequantized "))) + 1]
    assert cpu_only.endswith("payloads unquantized; cpu"), cpu_only
    assert "CUDA cc" not in "".join(x for x in lines if x.endswith("; cpu"))
    assert "; cpu,cuda (CUDA cc any)" in text and "; cuda (CUDA cc 8.0+); requires triton" in text
    assert "; cuda (CUDA cc 10.0)" in text  # sm100_nvfp4


def test_cli_plugins_blocks_with_dash_p(plugin_site):
    r = run_cli("-p", "no:sm100_test", "plugins", "--json", site=plugin_site)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert "sm100_nvfp4" not in {b["name"] for b in data["experts_backends"]}


def test_planning_with_the_builtin_plugin_blocked_says_that_is_why_no_format_is_known(tmp_path):
    # it ended in "registered formats: " and an empty list
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "m", arch="qwen3_moe", quant="bf16", num_layers=1)
    r = run_cli("-p", "no:builtin", "plan", str(ckpt))
    assert r.returncode != 0
    assert "format 'bf16' is not registered by any plugin; registered formats: none; the " \
           "built-in plugin, which registers every built-in format, is blocked" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_conformance_command_passes_arguments_after_dashes_to_pytest():
    r = run_cli("conformance", "local", "--", "-k", "ws1 and unquantized")
    assert r.returncode == 0, r.stdout + r.stderr
    # -k reached pytest: the two local modes' round trips ran, the other tests were deselected
    assert "2 passed, 5 deselected" in r.stdout


def test_unknown_pinned_backend_is_reported_once(tmp_path):
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "m", arch="qwen3_moe", quant="bf16", num_layers=3)
    r = run_cli("plan", str(ckpt), "--moe-runner-backend", "nope")
    assert r.returncode == 1
    assert r.stderr.count("'nope' is not a registered experts backend") == 1


def test_cli_strict_plugins_fails_on_broken(plugin_site):
    r = run_cli("--strict-plugins", "plugins", site=plugin_site)
    assert r.returncode == 3
    assert "broken_test" in r.stderr


def test_discovery_imports_no_kernel_libraries():
    code = (
        "import sys; from moe_runtime.plugin.registry import Registry; Registry.load(); "
        "bad = [m for m in ('triton', 'flashinfer', 'deep_ep', 'moe_runtime.backends.reference',"
        " 'moe_runtime_triton.kernels', 'cutlass') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_plugin_options_are_a_record_read_from_the_environment_and_the_command_line():
    from moe_runtime.plugin.manager import PluginOptions

    env = {"MOE_RUNTIME_BLOCK_PLUGINS": "a, b", "MOE_RUNTIME_STRICT_PLUGINS": "1"}
    options = PluginOptions.from_environ(env)
    assert options == PluginOptions(blocked={"a", "b"}, autoload=True, strict=True)
    both = options.with_command_line(blocked=["c"], disable_autoload=True)
    assert both == PluginOptions(blocked={"a", "b", "c"}, autoload=False, strict=True)
    assert PluginOptions.from_environ(both.to_environ()) == both  # what a child process gets


def test_the_command_line_passes_plugin_options_down_without_writing_the_environment(
        monkeypatch, capsys):
    import os

    from moe_runtime.cli import main

    for name in ("MOE_RUNTIME_BLOCK_PLUGINS", "MOE_RUNTIME_DISABLE_PLUGIN_AUTOLOAD",
                 "MOE_RUNTIME_STRICT_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    assert main(["-p", "no:builtin", "--disable-plugin-autoload", "plugins", "--json"]) == 0
    assert dict(os.environ) == before
    data = json.loads(capsys.readouterr().out)
    assert [(p["name"], p["status"]) for p in data["plugins"]] == [("builtin", "blocked")]


def test_a_registry_remembers_how_its_plugins_were_loaded():
    from moe_runtime.plugin.manager import PluginOptions

    reg = Registry.load(autoload=False, environ={"MOE_RUNTIME_BLOCK_PLUGINS": "x"})
    assert reg.options == PluginOptions(blocked={"x"}, autoload=False, strict=False)


def test_the_command_line_never_writes_plugin_options_into_the_environment():
    """Every command (serve and conformance included) takes args.plugin_options."""
    import pathlib
    import re

    import moe_runtime.cli

    source = pathlib.Path(moe_runtime.cli.__file__).read_text()
    assert not re.search(r"os\.environ\s*\[[^]]*\]\s*=|environ\.(update|setdefault)|putenv", source)
