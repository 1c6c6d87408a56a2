"""A backend whose declarations are registered but whose factory's package is not installed (a
plugin that ships declarations apart from its kernels, an entry point left behind by a partial
uninstall) is refused at planning with what to install, and the layer goes to the next backend
that can run it, instead of being picked and failing at load. Real distributions installed with
pip into a throwaway folder, the real CLI."""

from __future__ import annotations

import json

import pytest

from moe_runtime import ExpertsBackendSpec, Support
from moe_runtime.declarations import Reason, check_factory, factory_module
from moe_runtime.environment import Environment
from moe_runtime.testing.dists import build_plugin_dist, pip_install_target, run_cli

DECLARED_ONLY = '''
    from moe_runtime import hookimpl, ExpertsBackendSpec, Support

    @hookimpl
    def moe_runtime_register_backends(register):
        register(ExpertsBackendSpec(
            name="declared_only", factory="absent_kernels_pkg.experts:Experts",
            supports=[Support(formats=["bf16"])], priority=1000,
            description="declarations whose kernels are a separate distribution"))
'''


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    """The declarations' distribution alone, and beside it a folder with the kernels' package."""
    root = tmp_path_factory.mktemp("declared_only")
    site = root / "site"
    pip_install_target([build_plugin_dist(root, "moe-runtime-declared-only-test",
                                          "declared_only_plugin", "declared_only_test",
                                          DECLARED_ONLY)], site)
    kernels = root / "kernels"
    (kernels / "absent_kernels_pkg").mkdir(parents=True)
    (kernels / "absent_kernels_pkg" / "__init__.py").write_text("")
    (kernels / "absent_kernels_pkg" / "experts.py").write_text(
        "from moe_runtime.backends.reference import ReferenceExperts as Experts\n")
    # the package installed, its factory broken three ways: no such module, no such class, an
    # import inside the module that fails (a kernels wheel of the wrong build)
    broken = {"no_module": "", "no_class": "class Other:\n    pass\n",
              "import_fails": "import surely_absent_cuda_ext  # noqa\nclass Experts:\n    pass\n"}
    for name, body in broken.items():
        pkg = root / name / "absent_kernels_pkg"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        if body:
            (pkg / "experts.py").write_text(body)
    return site, kernels


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", arch="qwen3_moe",
                                quant="bf16", num_layers=2)


def _refused_and_passed_over(checkpoint, site, env=None) -> tuple[str, str]:
    """Plan with the declarations installed: the backend planned for no layer, and its one
    rejection ``(reason, message)``."""
    r = run_cli("plan", str(checkpoint), "--json", site=site, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert "declared_only" not in {lp["experts"] for lp in plan["layers"]}
    (rej,) = {(x["reason"], x["message"]) for x in plan["rejections"]
              if x["backend"] == "declared_only"}
    return rej


def test_the_plan_goes_to_the_next_backend_and_names_what_to_install(sites, checkpoint):
    site, _ = sites
    rej = _refused_and_passed_over(checkpoint, site)
    assert rej[0] == "missing_dependency"
    assert "absent_kernels_pkg.experts:Experts" in rej[1] and "install" in rej[1]


def test_pinning_it_is_refused_with_the_missing_module(sites, checkpoint):
    site, _ = sites
    r = run_cli("plan", str(checkpoint), "--moe-runner-backend", "declared_only", site=site,
                timeout=300)
    assert r.returncode != 0
    assert "'absent_kernels_pkg'" in r.stderr and "not importable" in r.stderr
    assert "Traceback" not in r.stderr


def test_with_the_kernels_installed_its_priority_wins(sites, checkpoint):
    site, kernels = sites
    r = run_cli("plan", str(checkpoint), "--json", site=site,
                env={"PYTHONPATH": f"{site}:{kernels}"}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert {lp["experts"] for lp in json.loads(r.stdout)["layers"]} == {"declared_only"}


def test_probing_looks_for_every_factory_and_a_described_target_assumes_them():
    spec = ExpertsBackendSpec(name="b", factory="surely_absent_pkg.sub:Cls",
                              supports=[Support(formats=["bf16"])])
    assert factory_module(spec.factory) == "surely_absent_pkg"
    probed = Environment.probe(device="cpu", modules=["surely_absent_pkg", "torch"])
    assert probed.checked == {"surely_absent_pkg", "torch"} and probed.available == {"torch"}
    v = check_factory(spec, probed)
    assert v.reason is Reason.MISSING_DEPENDENCY and "'surely_absent_pkg'" in v.message
    assert check_factory(spec, Environment.for_target("sm90"))  # not checked: assumed
    # a hand-built environment says what it has; it is not taken to have looked for the factory
    assert check_factory(spec, Environment("cpu", None, frozenset({"torch"}), "cpu"))
    # equal environments whatever was looked at (fingerprints and caches compare these)
    assert probed == Environment("cpu", None, frozenset({"torch"}), "cpu")


@pytest.mark.parametrize("broken, says", [
    ("no_module", "importing 'absent_kernels_pkg.experts' raised ModuleNotFoundError"),
    ("no_class", "module 'absent_kernels_pkg.experts' has no attribute 'Experts'"),
    ("import_fails", "No module named 'surely_absent_cuda_ext'"),
])
def test_a_package_whose_factory_does_not_load_is_refused_and_the_next_backend_runs(
        sites, checkpoint, broken, says):
    # the top-level package imports, so the module check passes; the factory itself does not load
    site, kernels = sites
    env = {"PYTHONPATH": f"{site}:{kernels.parent / broken}"}
    rej = _refused_and_passed_over(checkpoint, site, env)
    assert rej[0] == "missing_dependency"
    assert "factory 'absent_kernels_pkg.experts:Experts' does not load" in rej[1], rej[1]
    assert says in rej[1], rej[1]
    # pinned: refused at planning with the same sentence, not a traceback at load
    r = run_cli("plan", str(checkpoint), "--moe-runner-backend", "declared_only", site=site,
                env=env, timeout=300)
    assert r.returncode != 0 and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
