"""A malformed or impossible declaration is refused at registration, naming the plugin, the
backend and what would be accepted; an installed plugin declaring one is reported as failed and
skipped (fatal with --strict-plugins), and the other plugins keep working."""

from __future__ import annotations

import json

import pytest

from moe_runtime import CapabilityRange, CommSupport, ExpertsBackendSpec, Hardware, Support
from moe_runtime.declarations import load_factory
from moe_runtime.plugin.manager import get_plugin_manager
from moe_runtime.plugin.registry import Registry, RegistryError
from moe_runtime.testing.dists import build_plugin_dist, pip_install_target, run_cli

PLUGIN = '''
    from moe_runtime import (CapabilityRange, CommBackendSpec, CommSupport, ExpertsBackendSpec,
                             Hardware, Support, hookimpl)

    @hookimpl
    def moe_runtime_register_backends(register):
        register(ExpertsBackendSpec(name="{name}", factory="{name}_mod.impl:Cls", priority=-5,
                                    supports=[{support}]{extra}))
'''

EXTRA: dict[str, str] = {}  # backend keywords beside the block, by plugin name

# plugin name -> (Support block, what the failure must say)
BAD = {
    "bad_activation": ('Support(formats=["bf16"], activations=["relu"])',
                       "declares unknown activation(s) 'relu'; known activations: ['gelu', "
                       "'silu']"),
    "bad_runs_as": ('Support(formats=["bf16"], runs_as="fp16")',
                    "declares runs_as='fp16'; a format runs only as its declared weight-only "
                    "variant, and bf16 has none"),
    "bad_payload": ('Support(formats=["bf16"], payloads=["unquantized", "fp8"])',
                    "declares payload 'fp8', which none of its formats is calibrated for when run "
                    "as bf16"),
    "bad_format": ('Support(formats=["fp8_block"])',
                   "declares unknown format 'fp8_block'; registered formats:"),
    "bad_device": ('Support(formats=["bf16"], hardware=Hardware(devices=["gpu"]))',
                   "unknown device kind(s) 'gpu'; accepted: a non-empty subset of ['cpu', "
                   "'cuda']"),
    "bad_multiple": ('Support(formats=["bf16"], shape_multiple=0)',
                     "declares shape_multiple=0; accepted: a positive integer"),
    "bad_token_bound": ('Support(formats=["bf16"], max_tokens_per_forward=0)',
                        "declares max_tokens_per_forward=0; accepted: None (any number of "
                        "tokens) or a positive integer"),
    "bad_capability": ('Support(formats=["bf16"], hardware=Hardware(devices=["cuda"], '
                       'cuda_capabilities=[CapabilityRange("nine")]))',
                       "compute capability 'nine' is not of the form MAJOR.MINOR"),
    # an empty set of formats crashed the conformance suite's collection (IndexError)
    "bad_no_formats": ('Support(formats=[])', "declares no formats; a block promises every "
                       "combination of its sets"),
    "bad_inverted_range": ('Support(formats=["bf16"], hardware=Hardware(devices=["cuda"], '
                           'cuda_capabilities=[CapabilityRange("9.0", "8.0")]))',
                           "CapabilityRange('9.0', '8.0'): the upper bound is below the lower "
                           "one, so no device is in it"),
    "bad_requires": ('Support(formats=["bf16"], hardware=Hardware(requires=["flashinfer.jit"]))',
                     "'flashinfer.jit' is not a top-level module name"),
}


@pytest.fixture(scope="module")
def bad_site(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_declarations")
    srcs = [build_plugin_dist(root, f"moe-runtime-{name.replace('_', '-')}", f"{name}_mod", name,
                              PLUGIN.format(name=name, support=support,
                                            extra=EXTRA.get(name, "")))
            for name, (support, _) in BAD.items()]
    srcs.append(build_plugin_dist(root, "moe-runtime-good-one", "good_one_mod", "good_one",
                                  PLUGIN.format(name="good_one", extra="",
                                                support='Support(formats=["bf16"])')))
    pip_install_target(srcs, root / "site")
    return root / "site"


@pytest.fixture
def on_path(bad_site, monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(bad_site))
    importlib.invalidate_caches()


def test_each_invalid_declaration_fails_its_plugin_only(on_path):
    reg = Registry.load(environ={})
    infos = {i.name: i for i in reg.plugin_infos}
    for name, (_, says) in BAD.items():
        info = infos[name]
        assert info.status == "failed", (name, info)
        assert f"plugin {name!r} from distribution 'moe-runtime-{name.replace('_', '-')}'" in (
            info.error), info.error
        assert says in info.error, (name, info.error)
        assert name not in reg.experts
    assert infos["good_one"].status == "loaded" and "good_one" in reg.experts
    assert "reference" in reg.experts


def test_an_invalid_declaration_is_fatal_in_strict_mode(on_path):
    with pytest.raises(RegistryError, match=r"plugin 'bad_\w+' from distribution "
                                            r"'moe-runtime-bad-[\w-]+' declares something invalid"):
        Registry.load(strict=True, environ={})


def test_the_cli_lists_invalid_plugins_and_strict_mode_exits_3(bad_site):
    r = run_cli("plugins", "--json", site=bad_site)
    assert r.returncode == 0, r.stderr
    by_name = {p["name"]: p for p in json.loads(r.stdout)["plugins"]}
    assert by_name["bad_runs_as"]["status"] == "failed"
    assert "bf16 has none" in by_name["bad_runs_as"]["error"]
    assert by_name["good_one"]["status"] == "loaded"
    r = run_cli("--strict-plugins", "plugins", site=bad_site)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "declares something invalid" in r.stderr and "Traceback" not in r.stderr


def test_conformance_on_a_failed_plugins_backend_says_why(bad_site):
    r = run_cli("conformance", "bad_payload", site=bad_site)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "backend(s) ['bad_payload'] are not registered" in out, out[-2000:]
    assert "plugin 'bad_payload' (moe-runtime-bad-payload) failed to load" in out, out[-2000:]


def test_an_explicit_plugin_with_an_invalid_declaration_raises():
    import types

    from moe_runtime import hookimpl

    plugin = types.ModuleType("explicit_bad")

    @hookimpl
    def moe_runtime_register_backends(register):
        register(ExpertsBackendSpec(name="x", factory="m:C", priority="high",
                                    supports=[Support(formats=["bf16"])]))

    plugin.moe_runtime_register_backends = moe_runtime_register_backends
    pm = get_plugin_manager(autoload=False, plugins=[plugin], environ={})
    with pytest.raises(RegistryError, match=r"plugin 'explicit_bad' declares something invalid: "
                                            r"its hook moe_runtime_register_backends raised "
                                            r"ValueError: experts backend 'x' declares "
                                            r"priority='high'; accepted: an integer"):
        Registry.from_plugin_manager(pm)


@pytest.mark.parametrize("make, says", [
    (lambda: ExpertsBackendSpec("x", "pkg.experts", [Support(formats=["bf16"])]),
     "factory 'pkg.experts' must be 'module:Class'"),
    (lambda: ExpertsBackendSpec("x", "m:C", [Support(formats=["bf16"])], priority=True),
     "declares priority=True; accepted: an integer"),
    (lambda: ExpertsBackendSpec("x", "m:C", [Support(formats=["bf16"])], cuda_graphs="yes"),
     "declares cuda_graphs='yes'; accepted: True (forward can be captured in a CUDA graph) or "
     "False"),
    (lambda: ExpertsBackendSpec("x y", "m:C", [Support(formats=["bf16"])]),
     "backend name 'x y': accepted: a non-empty string"),
    (lambda: ExpertsBackendSpec("x", "m:C", [CommSupport(layout="masked")]),
     "supports holds CommSupport("),
    (lambda: Support(formats=["bf16"], shape_multiple=16.0), "shape_multiple=16.0"),
    (lambda: Hardware(devices=[]), "no device kind"),
    (lambda: Hardware(cuda_capabilities=["9.0"]), "'9.0' is not a CapabilityRange"),
    (lambda: CommSupport(layout="token_major", max_tokens_per_rank=0),
     "max_tokens_per_rank=0; accepted: None (unbounded) or a positive integer"),
    (lambda: CommSupport(layout="token_major", min_world_size=2, max_world_size=1),
     "max_world_size=1; accepted: None (any) or an integer >= min_world_size (2)"),
    (lambda: CapabilityRange("nine"), "'nine' is not of the form MAJOR.MINOR"),
])
def test_malformed_records_are_refused_when_built(make, says):
    with pytest.raises(ValueError) as exc:
        make()
    assert says in str(exc.value)


def test_a_factory_that_does_not_import_names_the_backend_and_the_cause():
    with pytest.raises(ModuleNotFoundError, match=r"backend 'b': factory 'no_such_mod_xyz.experts:C' does "
                                           r"not load: importing 'no_such_mod_xyz.experts' raised "
                                           r"ModuleNotFoundError"):
        load_factory("no_such_mod_xyz.experts:C", "b")
    with pytest.raises(AttributeError, match=r"module 'moe_runtime.formats' has no attribute 'Nope'"):
        load_factory("moe_runtime.formats:Nope", "b")
    assert load_factory("moe_runtime.declarations:Support") is Support


def test_one_required_module_may_be_a_string():
    # as formats="bf16" is one format: "torch" was split into the modules t, o, r, c, h
    assert Hardware(requires="torch").requires == ("torch",)
    assert Hardware(requires=["torch", "triton"]).requires == ("torch", "triton")
