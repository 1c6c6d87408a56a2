"""One Plan value: JSON round trip, and load_model(path, plan=...) runs it without planning again."""

from __future__ import annotations

import json

import pytest
import torch

from moe_runtime.checkpoint import read_checkpoint
from moe_runtime.checkpoint.problems import problems_from_checkpoint
from moe_runtime.environment import Environment
from moe_runtime.planner import Deployment, Plan, PlanError, plan_model
from moe_runtime.plugin.registry import Registry


def _plan(path, **deployment):
    reg = Registry.load()
    return plan_model(problems_from_checkpoint(read_checkpoint(path)), registry=reg,
                      environment=Environment.probe(device="cpu", modules=reg.required_modules()),
                      deployment=Deployment(**deployment))


@pytest.mark.parametrize("quant", ["mixed", "fp8"])
def test_a_plan_survives_a_json_round_trip(tiny_checkpoint, quant):
    plan = _plan(tiny_checkpoint("qwen3_moe", quant), max_tokens_per_rank=512)
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan


def test_the_plan_commands_json_is_a_plan(tiny_checkpoint, capsys):
    from moe_runtime.cli import main

    path = tiny_checkpoint("qwen3_moe", "mixed")
    assert main(["plan", str(path), "--target-device", "cpu", "--json"]) == 0
    plan = Plan.from_json(json.loads(capsys.readouterr().out))
    assert [lp.problem.name for lp in plan.layers] == [
        p.name for p in problems_from_checkpoint(read_checkpoint(path))]


def test_load_model_runs_a_given_plan_as_it_would_its_own(tiny_checkpoint, monkeypatch):
    from moe_runtime.integration import transformers as integration

    path = tiny_checkpoint("qwen3_moe", "mixed")
    own = integration.load_model(path, dtype="float32")
    given = json.loads(json.dumps(own.plan.to_json()))

    def no_planning(*a, **k):
        raise AssertionError("load_model planned although a plan was given")

    monkeypatch.setattr("moe_runtime.planner.plan_model", no_planning)
    loaded = integration.load_model(path, dtype="float32", plan=given)
    assert loaded.plan == own.plan
    ids = torch.randint(0, 200, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, own.model(ids).logits)


def test_a_plan_of_another_checkpoint_is_refused(tiny_checkpoint):
    from moe_runtime.integration.transformers import load_model

    other = _plan(tiny_checkpoint("qwen3_moe", "mixed", num_experts=6))
    with pytest.raises(PlanError, match="the plan was made for .*num_experts=6.*re-plan it"):
        load_model(tiny_checkpoint("qwen3_moe", "mixed"), dtype="float32", plan=other)


def test_not_a_plan_is_refused_with_how_to_make_one():
    with pytest.raises(PlanError, match="not a moe-runtime plan.*moe-runtime plan CHECKPOINT"):
        Plan.from_json({"layers": []})
