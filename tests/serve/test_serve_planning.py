"""``serve`` plans once, with the planning options of ``plan``, and hands that one Plan value to
the transformers integration: the same options, the same meaning, the same decisions."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from moe_runtime.serve.command import add_serve_arguments

PLANNING = ("--moe-runner-backend", "--moe-a2a-backend", "--moe-a2a-payload", "--target-device",
            "--ep-size", "--max-tokens-per-rank", "--no-degradation", "--tuning-cache")


def _serve_args(*argv):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def _serve(*argv, timeout=60):
    return subprocess.run([sys.executable, "-m", "moe_runtime.serve", "--port", "0", *argv],
                          capture_output=True, text=True, timeout=timeout)


def test_help_explains_the_planning_options():
    r = subprocess.run([sys.executable, "-m", "moe_runtime.cli", "serve", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    planning = r.stdout.split("planning:")[1].split("batching and memory:")[0]
    for option in PLANNING:
        assert planning.count(option) >= 1, option
    assert "the options of `moe-runtime plan`, with the same meaning" in planning
    assert "a target that differs from it" in planning and "is refused" in planning
    # each option once: serve's parser has no second copy of the pins
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    strings = [s for a in parser._actions for s in a.option_strings]
    assert len(strings) == len(set(strings))


def test_serve_builds_the_deployment_that_plan_builds():
    from moe_runtime.cli import build_parser, deployment_from_args

    argv = ["--moe-runner-backend", "reference", "--moe-a2a-payload", "unquantized",
            "--max-tokens-per-rank", "64", "--no-degradation"]
    served = deployment_from_args(_serve_args(*argv))
    planned = deployment_from_args(build_parser().parse_args(["plan", "ckpt", *argv]))
    assert served == planned
    assert (served.experts_backend, served.payload, served.max_tokens_per_rank,
            served.allow_degradation) == ("reference", "unquantized", 64, False)


def test_serve_plans_once_and_serves_what_plan_decides(model_dir, monkeypatch, capsys):
    """The default model's NVFP4 layers: cpu_dequantized degrades them (W4A16); with
    --no-degradation the plan, and so the served model, picks an exact backend instead."""
    import moe_runtime.planner as planner
    from moe_runtime.cli import deployment_from_args, main
    from moe_runtime.integration.transformers import LoadedModel
    from moe_runtime.serve.loading import load_for_serving

    argv = ["--no-degradation", "--max-tokens-per-rank", "64", "--tuning-cache", "none"]
    assert main(["plan", str(model_dir), "--target-device", "cpu", "--json", *argv]) == 0
    planned = json.loads(capsys.readouterr().out)
    calls = []
    real = planner.plan_model

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(planner, "plan_model", counting)
    args = _serve_args(*argv)
    loaded = load_for_serving(model_dir, dtype="float32", progress=False,
                              deployment=deployment_from_args(args),
                              tuning_cache=args.tuning_cache)
    assert len(calls) == 1, "serve planned the checkpoint more than once"
    import moe_runtime.serve

    assert moe_runtime.serve.LoadedModel is LoadedModel  # one class, the server's and load_model's
    assert isinstance(loaded, LoadedModel) and isinstance(loaded.plan, planner.Plan)
    assert loaded.plan.deployment.max_tokens_per_rank == 64
    assert not loaded.plan.deployment.allow_degradation
    served = loaded.plan_json()
    decisions = [(lp["layer"], lp["experts"], lp["communication"], lp["runs_as"])
                 for lp in served["layers"]]
    assert decisions == [(lp["layer"], lp["experts"], lp["communication"], lp["runs_as"])
                         for lp in planned["layers"]]
    assert all(lp["degradations"] == [] for lp in served["layers"])
    assert all(lp["runs_as"] == lp["format"] for lp in served["layers"])
    # the executor of each layer runs the plan's layer decision
    executors = [m._moe_runtime_executor for m in loaded.model.modules()
                 if hasattr(m, "_moe_runtime_executor")]
    assert [ex.plan for ex in executors] == list(loaded.plan.layers)


def test_the_tuning_cache_option_reaches_the_plan(model_dir, tmp_path):
    from moe_runtime.serve.loading import load_for_serving

    missing = tmp_path / "no-such-tuning.json"
    args = _serve_args("--tuning-cache", str(missing))
    loaded = load_for_serving(model_dir, dtype="float32", progress=False,
                              tuning_cache=args.tuning_cache)
    assert any(f"tuning cache {missing} does not exist" in n for n in loaded.plan.notes)


def test_a_payload_pin_reaches_the_plan(model_dir):
    from moe_runtime.cli import deployment_from_args
    from moe_runtime.serve.loading import LoadError, load_for_serving

    with pytest.raises(LoadError, match="unsupported_payload: payload fp8 is not possible"):
        load_for_serving(model_dir, dtype="float32", progress=False,
                         deployment=deployment_from_args(_serve_args("--moe-a2a-payload", "fp8")))


@pytest.mark.parametrize("argv, needle", [
    (["--ep-size", "2"], "--ep-size 2: serve runs one process"),
    (["--ep-size", "0"], "--ep-size 0: serve runs one process"),
    (["--max-tokens-per-rank", "0"], "--max-tokens-per-rank must be at least 1, got 0"),
    (["--target-device", "sm1x"], "--target-device: target device 'sm1x' not understood"),
    (["--device", "cpu", "--target-device", "sm100"],
     "--target-device sm100 describes target sm100 (compute capability 10.0), but serve runs "
     "on cpu (--device cpu)"),
])
def test_planning_options_serve_cannot_honour_are_exit_status_2(argv, needle):
    r = _serve(*argv, timeout=60)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_a_target_device_naming_the_device_serve_runs_on_is_accepted():
    from moe_runtime.serve.command import UsageError, check_target_device

    check_target_device("cpu", "cpu")
    with pytest.raises(UsageError, match="serve plans for the device it runs on"):
        check_target_device("sm90", "cpu")
