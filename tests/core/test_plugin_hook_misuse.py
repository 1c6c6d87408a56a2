"""A plugin that misuses a hook is reported naming the plugin, the hook and what it accepts: a hook
that returns its records instead of calling ``register``, a parameter that is not the hook's, a
hook function not marked ``@hookimpl``, a hook wrapper, a hook that raises. Real distributions,
installed into a throwaway folder and loaded through the real manager and command line."""

from __future__ import annotations

import inspect
import types

import pluggy
import pytest

from moe_runtime import hookimpl
from moe_runtime.plugin import hookspecs
from moe_runtime.plugin.manager import PluginError, get_plugin_manager
from moe_runtime.plugin.registry import Registry, RegistryError
from moe_runtime.testing.dists import build_plugin_dist, pip_install_target, run_cli

HOOKS = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
         if name.startswith("moe_runtime_")]

# what each hook's records look like, for a plugin that returns one instead of registering it
RECORD = {
    "moe_runtime_register_backends":
        'ExpertsBackendSpec(name="returned_spec", factory="m:C", supports=[Support(formats=["bf16"])])',
    "moe_runtime_register_formats":
        'Payload("returned_payload", 1.0)',
}

RETURNS = '''
    from moe_runtime import ExpertsBackendSpec, Support, hookimpl
    from moe_runtime.formats import Payload

    @hookimpl
    def {hook}(register):
        return [{record}]   # wrong: returns the record instead of calling register
'''

PLUGINS = {
    "wrong_param": '''
        from moe_runtime import hookimpl

        @hookimpl
        def moe_runtime_register_backends(reg):   # wrong: the hook passes `register`
            pass
    ''',
    "raises_key": '''
        from moe_runtime import hookimpl

        @hookimpl
        def moe_runtime_register_backends(register):
            raise KeyError("broken hook on purpose")
    ''',
    "unmarked": '''
        from moe_runtime import ExpertsBackendSpec, Support

        def moe_runtime_register_backends(register):   # wrong: no @hookimpl
            register(ExpertsBackendSpec(name="unmarked_b", factory="m:C",
                                        supports=[Support(formats=["bf16"])]))
    ''',
    "wrapper": '''
        from moe_runtime import ExpertsBackendSpec, Support, hookimpl

        @hookimpl(wrapper=True)
        def moe_runtime_register_backends(register):
            register(ExpertsBackendSpec(name="wrapper_b", factory="m:C",
                                        supports=[Support(formats=["bf16"])]))
            return (yield)
    ''',
    "fine_one": '''
        from moe_runtime import ExpertsBackendSpec, Support, hookimpl

        @hookimpl
        def moe_runtime_register_backends(register):
            register(ExpertsBackendSpec(name="fine_b", factory="m:C",
                                        supports=[Support(formats=["bf16"])]))
    ''',
}
for _hook in HOOKS:
    PLUGINS[f"returns_{_hook}"] = RETURNS.format(hook=_hook, record=RECORD[_hook])


def _mod(name: str) -> str:
    return f"misuse_{name}_mod"


@pytest.fixture(scope="module")
def misuse_site(tmp_path_factory):
    root = tmp_path_factory.mktemp("hook_misuse")
    srcs = [build_plugin_dist(root, f"moe-runtime-misuse-{name.replace('_', '-')}", _mod(name),
                              name, code) for name, code in PLUGINS.items()]
    pip_install_target(srcs, root / "site")
    return root / "site"


@pytest.fixture
def on_path(misuse_site, monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(misuse_site))
    importlib.invalidate_caches()


def _only(name: str) -> list[str]:
    """``-p no:`` arguments blocking every plugin of the site but ``name``."""
    return [a for other in PLUGINS if other != name for a in ("-p", f"no:{other}")]


def _infos(reg):
    return {i.name: i for i in reg.plugin_infos}


def test_the_spec_has_a_record_for_every_hook():
    assert set(RECORD) == set(HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_a_hook_that_returns_a_value_fails_its_plugin(on_path, hook):
    reg = Registry.load(environ={})
    info = _infos(reg)[f"returns_{hook}"]
    assert info.status == "failed", info
    assert f"plugin 'returns_{hook}' from distribution" in info.error
    assert f"its hook {hook} returned [" in info.error
    assert "(list); the return value" in info.error
    assert "by calling the argument's register(...)" in info.error
    assert "docs/writing-a-backend.md" in info.error
    assert "returned_spec" not in reg.experts and "returned_payload" not in reg.payloads
    # the others still load
    assert _infos(reg)["fine_one"].status == "loaded" and "fine_b" in reg.experts


def test_a_returned_spec_is_listed_and_fatal_in_strict_mode(misuse_site):
    name = "returns_moe_runtime_register_backends"
    r = run_cli(*_only(name), "plugins", site=misuse_site)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith(f"  {name} "))
    assert ": failed: " in line and "returned [ExpertsBackendSpec(name='returned_spec'" in line
    assert "register(...)" in line
    r = run_cli("--strict-plugins", *_only(name), "plugins", site=misuse_site)
    assert r.returncode == 3, r.stdout + r.stderr
    assert f"plugin {name!r}" in r.stderr and "moe_runtime_register_backends returned" in r.stderr
    assert "Traceback" not in r.stderr


def test_an_explicit_plugin_returning_its_spec_raises():
    plugin = types.ModuleType("explicit_returns")

    @hookimpl
    def moe_runtime_register_backends(register):
        from moe_runtime import ExpertsBackendSpec, Support

        return ExpertsBackendSpec(name="x", factory="m:C", supports=[Support(formats=["bf16"])])

    plugin.moe_runtime_register_backends = moe_runtime_register_backends
    pm = get_plugin_manager(autoload=False, plugins=[plugin], environ={})
    with pytest.raises(RegistryError, match=r"plugin 'explicit_returns' declares something "
                                            r"invalid: its hook moe_runtime_register_backends "
                                            r"returned ExpertsBackendSpec\(name='x'"):
        Registry.from_plugin_manager(pm)


def test_a_misnamed_parameter_is_explained_in_the_text_listing(misuse_site):
    r = run_cli(*_only("wrong_param"), "plugins", site=misuse_site)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("  wrong_param "))
    assert ": failed: PluginValidationError: " in line
    assert "moe_runtime_register_backends(reg) declares argument(s) 'reg'" in line, line
    assert "the hook passes 'register' by keyword" in line, line
    r = run_cli("--strict-plugins", *_only("wrong_param"), "plugins", site=misuse_site)
    assert r.returncode == 3
    assert "declares argument(s) 'reg'" in r.stderr and "passes 'register'" in r.stderr


def test_a_misnamed_parameter_of_an_explicit_plugin_names_the_accepted_arguments():
    plugin = types.ModuleType("explicit_param")

    @hookimpl
    def moe_runtime_register_formats(item):
        pass

    plugin.moe_runtime_register_formats = moe_runtime_register_formats
    with pytest.raises(pluggy.PluginValidationError,
                       match=r"moe_runtime_register_formats\(item\) declares argument\(s\) "
                             r"'item'.*passes 'register' by keyword"):
        get_plugin_manager(autoload=False, plugins=[plugin], environ={})


def test_a_misspelled_hook_names_the_hooks_there_are():
    plugin = types.ModuleType("explicit_typo")

    @hookimpl
    def moe_runtime_register_format(register):  # missing "s"
        pass

    plugin.moe_runtime_register_format = moe_runtime_register_format
    with pytest.raises(pluggy.PluginValidationError,
                       match=r"unknown hook 'moe_runtime_register_format'.*did you mean "
                             r"'moe_runtime_register_formats'.*moe_runtime_register_backends"
                             r"\(register\), moe_runtime_register_formats\(register\)"):
        get_plugin_manager(autoload=False, plugins=[plugin], environ={})


def test_a_hook_function_not_marked_hookimpl_fails_its_plugin(on_path):
    reg = Registry.load(environ={})
    info = _infos(reg)["unmarked"]
    assert info.status == "failed", info
    assert "defines moe_runtime_register_backends(register) without marking it " \
           "@moe_runtime.hookimpl" in info.error
    assert "unmarked_b" not in reg.experts
    with pytest.raises(PluginError, match="unmarked.*without marking it"):
        get_plugin_manager(strict=True, blocked=[n for n in PLUGINS if n != "unmarked"],
                           environ={})


def test_a_hook_wrapper_fails_its_plugin(on_path):
    reg = Registry.load(environ={})
    info = _infos(reg)["wrapper"]
    assert info.status == "failed", info
    assert "its hook moe_runtime_register_backends is marked as a wrapper" in info.error
    assert "wrapper_b" not in reg.experts


def test_a_hook_that_raises_says_where(on_path):
    reg = Registry.load(environ={})
    info = _infos(reg)["raises_key"]
    assert info.status == "failed", info
    assert "its hook moe_runtime_register_backends raised KeyError: 'broken hook on purpose' " \
           "(at " in info.error
    assert f"{_mod('raises_key')}/__init__.py:6, in moe_runtime_register_backends)" in info.error


def test_register_takes_one_record_and_cannot_be_told_another_plugin():
    plugin = types.ModuleType("explicit_two_args")

    @hookimpl
    def moe_runtime_register_backends(register):
        from moe_runtime import ExpertsBackendSpec, Support

        register(ExpertsBackendSpec(name="x", factory="m:C",
                                    supports=[Support(formats=["bf16"])]), "builtin")

    plugin.moe_runtime_register_backends = moe_runtime_register_backends
    pm = get_plugin_manager(autoload=False, plugins=[plugin], environ={})
    with pytest.raises(RegistryError, match=r"explicit_two_args.*raised TypeError"):
        Registry.from_plugin_manager(pm)
