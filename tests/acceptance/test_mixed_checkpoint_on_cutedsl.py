"""The case that started the project (SGLang PR 30443), through the real CLI and the real
flashinfer_cutedsl plugin distribution: support comes from the declaration, never a name list."""

from __future__ import annotations

import json

import pytest

from moe_runtime.testing.dists import run_cli

SHAPE = dict(hidden_size=128, intermediate_size=128, num_experts=4)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "mixed", arch="qwen3_moe",
                                quant="mixed", **SHAPE)


@pytest.fixture(scope="module")
def mixed_with_fp8_layer(tmp_path_factory):
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "mixed_fp8", arch="qwen3_moe",
                                quant="mixed", fp8_moe_layers=(1,), num_layers=3, **SHAPE)


def _plan(*args):
    r = run_cli("plan", *args, "--json")
    return r, (json.loads(r.stdout) if r.stdout.strip() else None)


def test_cutedsl_plugin_is_installed_as_a_distribution():
    r = run_cli("plugins", "--json")
    data = json.loads(r.stdout)
    (p,) = [p for p in data["plugins"] if p["name"] == "flashinfer_cutedsl"]
    assert p["status"] == "loaded" and p["distribution"]


def test_mixed_checkpoint_plans_nvfp4_layers_onto_cutedsl_on_sm100(mixed):
    r, data = _plan(str(mixed), "--moe-runner-backend", "flashinfer_cutedsl",
                    "--target-device", "sm100")
    assert r.returncode == 0, r.stderr
    assert data["checkpoint"]["method"] == "modelopt_mixed"  # reported, decides nothing
    assert data["layers"], "MoE layers planned"
    for lp in data["layers"]:
        assert (lp["format"], lp["experts"]) == ("nvfp4_w4a4", "flashinfer_cutedsl")


def test_same_checkpoint_on_sm90_is_refused_saying_10x_is_needed(mixed):
    r, _ = _plan(str(mixed), "--moe-runner-backend", "flashinfer_cutedsl",
                 "--target-device", "sm90")
    assert r.returncode == 1
    assert "compute_capability" in r.stderr
    assert "10.0" in r.stderr and "has 9.0" in r.stderr
    # the refusal names the layers it covers, once for all of them (both MoE layers refuse alike)
    assert "layers 0-1 of model.layers.N.mlp.experts" in r.stderr
    assert r.stderr.count("compute_capability") == 1


def test_fp8_moe_layer_is_planned_elsewhere_when_not_pinned(mixed_with_fp8_layer):
    r, data = _plan(str(mixed_with_fp8_layer), "--target-device", "sm100")
    assert r.returncode == 0, r.stderr
    by_layer = {lp["layer"]: lp for lp in data["layers"]}
    assert by_layer["model.layers.1.mlp.experts"]["format"] == "fp8_w8a8"
    assert by_layer["model.layers.1.mlp.experts"]["experts"] != "flashinfer_cutedsl"
    assert by_layer["model.layers.0.mlp.experts"]["experts"] == "flashinfer_cutedsl"


def test_fp8_moe_layer_is_refused_by_name_when_cutedsl_is_pinned(mixed_with_fp8_layer):
    r, _ = _plan(str(mixed_with_fp8_layer), "--moe-runner-backend", "flashinfer_cutedsl",
                 "--target-device", "sm100")
    assert r.returncode == 1
    assert "layer model.layers.1.mlp.experts (format fp8_w8a8" in r.stderr
    assert "unsupported_format" in r.stderr
    assert "model.layers.0.mlp.experts" not in r.stderr
