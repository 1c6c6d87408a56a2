"""The memory estimate of a plan counts the experts as the planned backend holds them
(``Support.prepared_bytes_per_weight``: cpu_dequantized keeps a float32 copy), not the format's
storage; a refusal names that copy and how to avoid it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from moe_runtime import ExpertsBackendSpec, Support
from moe_runtime import formats as F
from moe_runtime.agreement import plan_fields
from moe_runtime.checkpoint.check import (
    CheckpointRefused,
    check_checkpoint,
    require_memory_for_plan,
)
from moe_runtime.checkpoint.memory import MachineMemory
from moe_runtime.planner import Deployment, Plan
from moe_runtime.plugin.builtin import CPU_DEQUANTIZED
from moe_runtime.plugin.registry import Registry
from moe_runtime.serve.loading import plan_for_serving

NVFP4_STORED = {f.name: f.bytes_per_weight for f in F.BUILTIN_FORMATS}[F.NVFP4_W4A16]


def spec(value) -> ExpertsBackendSpec:
    return ExpertsBackendSpec(name="copying", factory="pkg.mod:Cls",
                              supports=[Support(formats=[F.BF16],
                                                prepared_bytes_per_weight=value)])


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "4", True, 10**400])
def test_prepared_bytes_must_be_positive_finite(value):
    with pytest.raises(ValueError) as err:
        spec(value)
    text = str(err.value)
    assert "'copying'" in text and "prepared_bytes_per_weight" in text and "bf16" in text
    assert "positive finite" in text


@pytest.mark.parametrize("value", [None, 4.0, 2, 0.5625])
def test_prepared_bytes_accepted(value):
    assert spec(value).supports[0].prepared_bytes_per_weight == value


def test_cpu_dequantized_declares_its_float32_copy_once():
    from moe_runtime.backends.cpu_dequantized import COMPUTE_DTYPE

    for support in CPU_DEQUANTIZED.supports:
        assert support.prepared_bytes_per_weight == COMPUTE_DTYPE.itemsize
        # the note says the same number, and the ratio to the format it reads
        stored = {f.name: f.bytes_per_weight for f in F.BUILTIN_FORMATS}[sorted(support.formats)[0]]
        assert f"{COMPUTE_DTYPE.itemsize} bytes per weight" in support.note
        assert f"{COMPUTE_DTYPE.itemsize / stored:.1f}x" in support.note


@pytest.fixture(scope="module")
def w4a16(tiny):
    return tiny(arch="qwen3_moe", quant="w4a16_nvfp4")


@pytest.fixture(scope="module")
def registry():
    return Registry.load()


@pytest.fixture(scope="module")
def plans(w4a16, registry):
    """The plan on CPU (cpu_dequantized) and one pinned to the reference backend."""
    return {name: plan_for_serving(w4a16, "cpu", Deployment(experts_backend=name), registry)
            for name in ("cpu_dequantized", "reference")}


def test_plan_carries_the_declaration_through_json(plans, registry):
    copying, reference = plans["cpu_dequantized"], plans["reference"]
    assert {lp.prepared_bytes_per_weight for lp in copying.layers} == {4.0}
    assert {lp.prepared_bytes_per_weight for lp in reference.layers} == {None}
    for plan in (copying, reference):
        assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    # a plan written before the field existed reads as the format's storage
    older = copying.to_json()
    for lp in older["layers"]:
        del lp["prepared_bytes_per_weight"]
    assert {lp.prepared_bytes_per_weight for lp in Plan.from_json(older).layers} == {None}
    # ranks that would count memory differently disagree on a named field
    name = copying.layers[0].problem.name
    fields = dict(plan_fields(copying, registry).fields)
    assert fields[f"layer {name}: prepared_bytes_per_weight"] == "4.0"


def experts_part(report):
    (part,) = [p for p in report.memory.parts if p.name.startswith("expert weights")]
    return part


def test_estimate_counts_the_planned_copy(w4a16, plans):
    plain = check_checkpoint(w4a16, machine=None)
    copying = plain.with_plan(plans["cpu_dequantized"])
    reference = plain.with_plan(plans["reference"])
    assert plain.ok and copying.ok and reference.ok
    # qwen3_moe tiny: 2 MoE layers of 8 experts, hidden 64, intermediate 32
    weights = 2 * 8 * 3 * 64 * 32
    assert experts_part(copying).bytes - experts_part(plain).bytes == round(
        weights * (4.0 - NVFP4_STORED))
    assert copying.memory.total - plain.memory.total == experts_part(copying).bytes - experts_part(
        plain).bytes
    assert "cpu_dequantized holds 4 bytes per weight after prepare, 7.1x the nvfp4_w4a16" in (
        experts_part(copying).name)
    assert [c.backend for c in copying.memory.backend_copies] == ["cpu_dequantized"]
    assert copying.memory.to_json()["backend_copies"][0]["alternatives"] == ["reference"]
    # the reference backend holds the format's storage: the estimate without a plan
    assert reference.memory == plain.memory and not reference.memory.backend_copies
    # given to the check itself, the plan gives the same estimate
    assert check_checkpoint(w4a16, machine=None, plan=plans["cpu_dequantized"]).memory == (
        copying.memory)


def test_refusal_names_the_copy_and_the_pin(w4a16, plans):
    plain = check_checkpoint(w4a16, machine=None)
    planned = plain.with_plan(plans["cpu_dequantized"]).memory.total
    between = MachineMemory("cpu", (plain.memory.total + planned) // 2, "this host has little")
    report = check_checkpoint(w4a16, machine=between)
    assert report.ok  # the format's storage fits
    require_memory_for_plan(report, plans["reference"])
    with pytest.raises(CheckpointRefused) as err:
        require_memory_for_plan(report, plans["cpu_dequantized"])
    (finding,) = err.value.report.findings
    assert finding.rule == "memory"
    assert "cpu_dequantized holds 4 bytes per weight after prepare" in finding.problem
    assert "--moe-runner-backend (others that run these layers: reference)" in finding.accepted
    assert "a machine with that much memory" in finding.accepted


def test_plan_command_warns_with_the_planned_copy(w4a16, tmp_path, capsys):
    """`moe-runtime plan` on a config whose experts fit at NVFP4 storage on this host but not as
    cpu_dequantized's float32 copy (a config-only folder: no weights of that size are written)."""
    from moe_runtime.cli import main

    available = MachineMemory.probe("cpu")
    if available is None:
        pytest.skip("this host's available memory cannot be read")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for file in Path(w4a16).glob("*.json"):
        shutil.copy(file, folder / file.name)
    config = json.loads((folder / "config.json").read_text())
    # experts: 2 layers x 8 x 3 x 64 x I weights; at 4 bytes twice the host, at storage 0.28x
    inter = 64 * math.ceil(2 * available.available_bytes / (2 * 8 * 3 * 64 * 4) / 64)
    config["moe_intermediate_size"] = inter
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["plan", str(folder), "--max-model-len", "1", "--json"]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, captured.err
    assert "cpu_dequantized holds 4 bytes per weight after prepare" in warnings[0]
    assert "--moe-runner-backend" in warnings[0]
    check = json.loads(captured.out)["check"]
    assert [f["rule"] for f in check["findings"]] == ["memory"]
    assert check["memory"]["backend_copies"][0]["backend"] == "cpu_dequantized"


@pytest.mark.parametrize("value", ["4", -1, 0, True, math.nan, math.inf, 10**400, [4]])
def test_a_plan_file_with_bad_prepared_bytes_is_not_a_plan(plans, value):
    from moe_runtime.planner import PlanError

    data = json.loads(json.dumps(plans["cpu_dequantized"].to_json()))
    data["layers"][0]["prepared_bytes_per_weight"] = value
    with pytest.raises(PlanError) as err:
        Plan.from_json(data)
    assert f"prepared_bytes_per_weight is {value!r}; accepted: a positive finite number" in str(
        err.value)
    assert repr(data["layers"][0]["layer"]) in str(err.value)


def test_a_plan_with_batch_size_ranges_counts_every_backends_copy(w4a16, plans):
    """--token-ranges: the reference serves small batches beside cpu_dequantized's float32 copy;
    both hold the layer's experts."""
    import attrs

    from moe_runtime.planner import ExpertsRange

    copying = plans["cpu_dequantized"]
    ranged = attrs.evolve(copying, layers=tuple(
        attrs.evolve(lp, experts_by_tokens=(ExpertsRange(16, "reference", None),))
        for lp in copying.layers))
    plain = check_checkpoint(w4a16, machine=None)
    weights = 2 * 8 * 3 * 64 * 32
    one = experts_part(plain.with_plan(copying)).bytes
    both = experts_part(plain.with_plan(ranged))
    assert both.bytes - one == round(weights * NVFP4_STORED)
    assert [c.backend for c in plain.with_plan(ranged).memory.backend_copies] == [
        "cpu_dequantized", "reference"]
