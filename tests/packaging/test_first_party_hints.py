"""Messages that name a first-party plugin which is not installed, with its install command."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

from moe_runtime.planner import Deployment, PlanError, check_deployment
from moe_runtime.plugin import first_party
from moe_runtime.plugin.first_party import FIRST_PARTY, degraded_plan_hints, unregistered_backend_hint
from moe_runtime.plugin.registry import Registry

ROOT = Path(__file__).resolve().parents[2]


def _nothing_installed(distribution: str) -> bool:
    return False


@pytest.mark.parametrize("plugin", FIRST_PARTY, ids=lambda p: p.distribution)
def test_table_matches_the_plugin_distribution_in_the_checkout(plugin):
    """The table is for messages, but a wrong name or path would send users astray."""
    cfg = configparser.ConfigParser()
    assert cfg.read(ROOT / plugin.path / "setup.cfg")
    assert cfg["metadata"]["name"].strip() == plugin.distribution
    entry_points = [line.split("=")[0].strip()
                    for line in cfg["options.entry_points"]["moe_runtime"].splitlines()
                    if line.strip()]
    assert sorted(entry_points) == sorted(plugin.backends)


def test_pinned_backend_of_a_missing_first_party_plugin_names_the_install_command(monkeypatch):
    monkeypatch.setattr(first_party, "is_installed", _nothing_installed)
    registry = Registry.load(blocked=["flashinfer_cutedsl"], autoload=False)
    with pytest.raises(PlanError) as exc:
        check_deployment(registry, Deployment(experts_backend="flashinfer_cutedsl"))
    message = str(exc.value)
    assert "not a registered experts backend" in message
    assert "moe-runtime-flashinfer-cutedsl" in message
    assert "pip install ./plugins/flashinfer_cutedsl" in message


def test_pinned_communication_backend_of_a_missing_plugin_names_its_install_command(monkeypatch):
    monkeypatch.setattr(first_party, "is_installed", _nothing_installed)
    registry = Registry.load(autoload=False)
    with pytest.raises(PlanError) as exc:
        check_deployment(registry, Deployment(comm_backend="deepep"))
    assert "pip install ./plugins/deepep" in str(exc.value)


def test_installed_but_unregistered_plugin_points_at_moe_runtime_plugins():
    hint = unregistered_backend_hint("triton", installed=lambda d: True)
    assert "installed but did not register it" in hint
    assert "moe-runtime plugins" in hint


def test_unknown_backend_gets_no_first_party_hint():
    assert unregistered_backend_hint("someone_elses_backend", installed=_nothing_installed) == ""


def test_degraded_layers_list_the_missing_experts_plugins_with_install_commands():
    lines = degraded_plan_hints(["model.layers.0.mlp.experts"], installed=_nothing_installed)
    assert lines[0].startswith("1 layer(s) run degraded")
    text = "\n".join(lines)
    assert "pip install ./plugins/flashinfer_cutedsl" in text
    assert "pip install ./plugins/triton" in text
    assert "deepep" not in text  # communication plugins do not run layers


def test_a_plan_without_degraded_layers_lists_nothing():
    assert degraded_plan_hints([], installed=_nothing_installed) == []


def test_installed_plugins_are_not_listed():
    assert degraded_plan_hints(["layer"], installed=lambda d: True) == []


def test_plan_of_a_degraded_nvfp4_layer_lists_the_missing_flashinfer_plugin(
        tmp_path, monkeypatch, capsys):
    """The issue's case: on an sm100 target without the FlashInfer plugin, NVFP4 W4A4 runs as
    W4A16 on triton, and `plan` says which first-party plugin to install and how."""
    pytest.importorskip("moe_runtime_triton")
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint
    from moe_runtime.cli import main
    from moe_runtime.plugin.manager import ENV_BLOCK

    monkeypatch.setenv(ENV_BLOCK, "")  # main() writes -p no:NAME here; restored after the test
    monkeypatch.setattr(first_party, "is_installed",
                        lambda d: d != "moe-runtime-flashinfer-cutedsl")
    ckpt = make_tiny_checkpoint(tmp_path / "nvfp4", arch="qwen3_moe", quant="nvfp4", num_layers=1)
    assert main(["-p", "no:flashinfer_cutedsl", "plan", str(ckpt), "--target-device", "sm100"]) == 0
    out = capsys.readouterr().out
    assert "1 layer(s) run degraded" in out
    assert "pip install ./plugins/flashinfer_cutedsl" in out
    assert "pip install ./plugins/triton" not in out  # installed here


def test_every_plugin_folder_of_the_checkout_has_an_entry():
    from pathlib import Path

    from moe_runtime.plugin.first_party import FIRST_PARTY

    root = Path(__file__).resolve().parents[2]
    folders = {f"plugins/{p.name}" for p in (root / "plugins").iterdir() if (p / "setup.cfg").exists()}
    assert folders == {p.path for p in FIRST_PARTY}
