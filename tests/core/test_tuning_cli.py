"""``moe-runtime tune`` on a tiny real checkpoint on CPU: the planner's candidates run through their
real prepare and forward (reference and cpu_dequantized), the cache it writes is what the next
``plan`` reads. The tuning loop is also run in-process with a fake timer, so the choice is known."""

from __future__ import annotations

import json
import types

import pytest

from moe_runtime import ExpertsBackendSpec, Hardware, Support, hookimpl
from moe_runtime.checkpoint import read_checkpoint
from moe_runtime.checkpoint.problems import problems_from_checkpoint
from moe_runtime.environment import Environment
from moe_runtime.planner import plan_model
from moe_runtime.plugin.manager import get_plugin_manager
from moe_runtime.plugin.registry import Registry
from moe_runtime.testing.dists import run_cli
from moe_runtime.tuning.cache import Section, cache_key, load_tuning, write_sections
from moe_runtime.tuning.measure import Timing, shapes_to_tune, tune

CPU = Environment("cpu", None, frozenset({"torch"}), "cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tune") / "m", arch="qwen3_moe",
                                quant="bf16", num_layers=3)


def builtin_registry(*specs) -> Registry:
    plugins = []
    if specs:
        plugin = types.ModuleType("tune_test_plugin")

        @hookimpl
        def moe_runtime_register_backends(register):
            for s in specs:
                register(s)

        plugin.moe_runtime_register_backends = moe_runtime_register_backends
        plugins.append(plugin)
    return Registry.from_plugin_manager(
        get_plugin_manager(autoload=False, plugins=plugins, environ={}))


class FakeTimer:
    """Runs the call once (the real backend) and reports the time the test chose for it."""

    def __init__(self, times: dict[str, float]) -> None:
        self.times, self.outputs = times, []

    def __call__(self, fn, case) -> Timing:
        self.outputs.append((case.plan.experts, case.tokens, tuple(fn().shape)))
        return Timing(self.times[case.plan.experts], 1, "fake")


def test_tune_times_each_candidate_of_each_distinct_shape_through_the_real_backends(checkpoint):
    reg = builtin_registry()
    problems = problems_from_checkpoint(read_checkpoint(checkpoint))
    shapes = shapes_to_tune(problems, registry=reg, environment=CPU, tokens=[1, 8])
    assert len(problems) == 3 and len(shapes) == 1  # three layers, one shape
    assert [lp.experts for lp in shapes[0].plans] == ["cpu_dequantized", "reference"]
    timer = FakeTimer({"cpu_dequantized": 20.0, "reference": 10.0})
    found = tune(shapes, [1, 8], registry=reg, device="cpu", timer=timer)
    hidden = problems[0].hidden_size
    assert sorted(timer.outputs) == [("cpu_dequantized", 1, (1, hidden)),
                                     ("cpu_dequantized", 8, (8, hidden)),
                                     ("reference", 1, (1, hidden)), ("reference", 8, (8, hidden))]
    assert {(m.candidate["experts"], m.tokens, m.median_us) for m in found} == {
        ("cpu_dequantized", 1, 20.0), ("cpu_dequantized", 8, 20.0), ("reference", 1, 10.0),
        ("reference", 8, 10.0)}


def test_a_cache_of_tune_makes_the_plan_pick_the_measured_fastest(checkpoint, tmp_path):
    reg = builtin_registry()
    problems = problems_from_checkpoint(read_checkpoint(checkpoint))
    shapes = shapes_to_tune(problems, registry=reg, environment=CPU, tokens=[16])
    found = tune(shapes, [16], registry=reg, device="cpu",
                 timer=FakeTimer({"cpu_dequantized": 20.0, "reference": 10.0}))
    path = tmp_path / "tuning.json"
    write_sections(path, [Section(cache_key(CPU, reg), CPU.to_json(), tuple(found))])
    declared = plan_model(problems, registry=reg, environment=CPU)
    measured = plan_model(problems, registry=reg, environment=CPU,
                          tuning=load_tuning(path, CPU, reg))
    assert {lp.experts for lp in declared.layers} == {"cpu_dequantized"}
    assert {lp.experts for lp in measured.layers} == {"reference"}


def test_a_backend_that_cannot_prepare_is_recorded_as_failed_not_fatal(checkpoint):
    broken = ExpertsBackendSpec(name="broken", factory="moe_runtime.backends.reference:Missing",
                                priority=99, supports=[Support(formats=["bf16"],
                                                               hardware=Hardware(devices=["cpu"]))])
    reg = builtin_registry(broken)
    problems = problems_from_checkpoint(read_checkpoint(checkpoint))
    shapes = shapes_to_tune(problems, registry=reg, environment=CPU, tokens=[4],
                            backends=["broken", "reference"])
    assert [lp.experts for lp in shapes[0].plans] == ["broken", "reference"]
    found = tune(shapes, [4], registry=reg, device="cpu",
                 timer=FakeTimer({"reference": 10.0}))
    by = {m.candidate["experts"]: m for m in found}
    assert by["broken"].median_us is None and by["broken"].error.startswith(
        "prepare: AttributeError")
    assert by["reference"].median_us == 10.0


def _fastest(cache: dict, tokens: int) -> str:
    (section,) = cache["sections"]
    rows = [m for m in section["measurements"] if m["tokens"] == tokens]
    return min(rows, key=lambda m: m["median_us"])["candidate"]["experts"]


def test_the_tune_command_writes_a_cache_that_the_next_plan_uses(checkpoint, tmp_path):
    path = tmp_path / "tuning.json"
    env = {"MOE_RUNTIME_TUNING_CACHE": str(tmp_path / "unused.json")}
    r = run_cli("tune", str(checkpoint), "--tokens", "1,4", "--cache", str(path), "--repeats",
                "3", "--warmup", "1", "--no-progress", env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"wrote 4 measurement(s) of cpu to {path}" in r.stdout
    assert " us eager (no CUDA graphs on cpu)" in r.stdout  # how each cell was timed
    cache = json.loads(path.read_text())
    assert {m["timed"] for m in cache["sections"][0]["measurements"]} == {
        "eager: no CUDA graphs on cpu"}
    r = run_cli("plan", str(checkpoint), "--tuning-cache", str(path), "--max-tokens-per-rank",
                "4", "--json", env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert {lp["experts"] for lp in plan["layers"]} == {_fastest(cache, 4)}
    assert all(lp["notes"][-1].startswith(f"chosen by measurement (cache {path}, measured ")
               for lp in plan["layers"])
    assert plan["notes"][0].startswith(f"tuning cache {path} (measured ")
    r = run_cli("plan", str(checkpoint), "--tuning-cache", str(path), env=env, timeout=300)
    assert f"note: tuning cache {path} (measured " in r.stdout


def test_plan_reads_the_default_location_and_is_unchanged_without_a_cache(checkpoint, tmp_path):
    absent = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    r = run_cli("plan", str(checkpoint), "--json", env=absent, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["notes"] == []
    (tmp_path / "xdg" / "moe-runtime").mkdir(parents=True)
    (tmp_path / "xdg" / "moe-runtime" / "tuning.json").write_text("{")
    r = run_cli("plan", str(checkpoint), env=absent, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "note: ignored tuning cache " in r.stdout and "malformed: not JSON" in r.stdout
    r = run_cli("plan", str(checkpoint), "--tuning-cache", "none", env=absent, timeout=300)
    assert "note:" not in r.stdout


def test_tune_with_nothing_to_time_says_so_and_writes_nothing(checkpoint, tmp_path):
    path = tmp_path / "tuning.json"
    r = run_cli("tune", str(checkpoint), "--backends", "triton", "--cache", str(path),
                "--no-progress", timeout=300)
    assert r.returncode == 1
    assert "not tuned: none of the named backends runs it" in r.stdout
    assert "nothing written" in r.stderr and not path.exists()


def test_tune_replaces_an_outdated_cache_and_checks_the_graph_bound(checkpoint, tmp_path):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"schema": "moe-runtime-tuning/1", "sections": []}))
    r = run_cli("tune", str(checkpoint), "--tokens", "2", "--cache", str(path), "--repeats", "3",
                "--warmup", "1", "--backends", "cpu_dequantized", "--no-progress", timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"warning: {path} is an outdated tuning cache (schema 'moe-runtime-tuning/1'" in (
        r.stderr)
    assert json.loads(path.read_text())["schema"] == "moe-runtime-tuning/2"
    r = run_cli("tune", str(checkpoint), "--graph-max-tokens", "-1", "--cache", str(path),
                timeout=300)
    assert r.returncode != 0
    assert "--graph-max-tokens must be 0 (no graphs) or more, got -1" in r.stderr


@pytest.mark.parametrize("flags, why", [
    (["--budget", "nan"], "--budget must be a finite number of seconds, 0 or more, got nan"),
    (["--budget", "inf"], "--budget must be a finite number of seconds, 0 or more, got inf"),
    (["--budget", "-1"], "--budget must be a finite number of seconds, 0 or more, got -1.0"),
    (["--backends", ","], "--backends takes experts backend names separated by commas, got ','; "
                          "registered: cpu_dequantized, "),
    # an empty entry was dropped without a word
    (["--tokens", "1,,2"], "--tokens takes positive integers separated by commas, e.g. "
                           "1,16,128; got '1,,2'"),
    (["--tokens", "1,"], "got '1,'"),
])
def test_tune_refuses_bad_arguments_before_timing_anything(checkpoint, tmp_path, capsys, flags,
                                                           why):
    from moe_runtime.cli import main

    path = tmp_path / "tuning.json"
    with pytest.raises(SystemExit) as exc:
        main(["tune", str(checkpoint), "--cache", str(path), "--no-progress", "--tokens", "2",
              *flags])
    assert why in str(exc.value) and not path.exists()


def test_tune_refuses_a_cache_path_that_is_a_folder_before_timing(checkpoint, tmp_path):
    from moe_runtime.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["tune", str(checkpoint), "--cache", str(tmp_path), "--no-progress"])
    assert f"the tuning cache {tmp_path} exists and is not a file" in str(exc.value)


@pytest.mark.parametrize("victim", ["config.json", "model.safetensors", "notes.txt"])
def test_tune_never_writes_over_a_file_that_is_not_a_tuning_cache(checkpoint, tmp_path, victim):
    # --cache pointed at a checkpoint's own files (or any file) by mistake: refused untouched,
    # before any timing (it was replaced by a cache with a warning, destroying the checkpoint)
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    path = folder / victim
    if not path.exists():
        path.write_text("my notes\n")
    before = path.read_bytes()
    r = run_cli("tune", str(folder), "--tokens", "1", "--cache", str(path), "--no-progress",
                timeout=300)
    assert r.returncode != 0, r.stdout + r.stderr
    assert f"{path} exists and is not a tuning cache" in r.stderr, r.stderr
    assert "it is not written over" in r.stderr and "tuning " not in r.stderr.split("error:")[0]
    assert path.read_bytes() == before
    assert "Traceback" not in r.stderr


def test_a_damaged_tuning_cache_of_the_current_schema_is_replaced_with_a_warning(checkpoint,
                                                                                  tmp_path):
    from moe_runtime.tuning.cache import SCHEMA

    path = tmp_path / "cache.json"
    path.write_text(json.dumps({"schema": SCHEMA, "sections": [{"key": 5}]}))
    r = run_cli("tune", str(checkpoint), "--tokens", "1", "--cache", str(path), "--repeats", "3",
                "--no-progress", timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"warning: {path} is a damaged tuning cache" in r.stderr
    assert json.loads(path.read_text())["sections"][0]["measurements"]


def test_a_cache_that_cannot_be_written_leaves_no_temporary_file(tmp_path):
    from moe_runtime.tuning.cache import write_sections

    (tmp_path / "folder").mkdir()
    with pytest.raises(OSError):
        write_sections(tmp_path / "folder", [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]


def test_a_time_below_the_timers_resolution_fails_that_measurement_not_the_cache(checkpoint,
                                                                                  tmp_path):
    # what tune writes, plan reads: a median of 0 us (CUDA events resolve about 0.5 us) would
    # make the whole cache malformed for every later plan
    reg = builtin_registry()
    problems = problems_from_checkpoint(read_checkpoint(checkpoint))
    shapes = shapes_to_tune(problems, registry=reg, environment=CPU, tokens=[16])
    found = tune(shapes, [16], registry=reg, device="cpu",
                 timer=FakeTimer({"cpu_dequantized": 0.0, "reference": 10.0}))
    by = {m.candidate["experts"]: m for m in found}
    assert by["cpu_dequantized"].median_us is None
    assert by["cpu_dequantized"].error == ("timer: median 0.0 us, not a positive time (below "
                                           "the timer's resolution?)")
    path = tmp_path / "tuning.json"
    write_sections(path, [Section(cache_key(CPU, reg), CPU.to_json(), tuple(found))])
    tuning = load_tuning(path, CPU, reg)
    assert tuning.cache is not None, tuning.notes
    assert {lp.experts for lp in plan_model(problems, registry=reg, environment=CPU,
                                            tuning=tuning).layers} == {"cpu_dequantized"}



def test_plan_with_token_ranges_runs_small_batches_on_their_measured_fastest(checkpoint,
                                                                            tmp_path):
    """A real tune's cache with its times set by the test: the reference fastest at 8 tokens,
    cpu_dequantized (declared first) at 4096."""
    path = tmp_path / "tuning.json"
    env = {"MOE_RUNTIME_TUNING_CACHE": str(tmp_path / "unused.json")}
    r = run_cli("tune", str(checkpoint), "--tokens", "8,4096", "--cache", str(path), "--repeats",
                "1", "--warmup", "1", "--no-progress", env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    cache = json.loads(path.read_text())
    times = {("reference", 8): 10.0, ("cpu_dequantized", 8): 40.0,
             ("reference", 4096): 900.0, ("cpu_dequantized", 4096): 100.0}
    for m in cache["sections"][0]["measurements"]:
        m["median_us"] = times[(m["candidate"]["experts"], m["tokens"])]
    path.write_text(json.dumps(cache))
    r = run_cli("plan", str(checkpoint), "--tuning-cache", str(path), "--json", env=env,
                timeout=300)
    assert r.returncode == 0, r.stderr
    assert all(lp["experts_by_tokens"] == [] for lp in json.loads(r.stdout)["layers"])
    r = run_cli("plan", str(checkpoint), "--tuning-cache", str(path), "--token-ranges", "--json",
                env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    layers = json.loads(r.stdout)["layers"]
    assert {lp["experts"] for lp in layers} == {"cpu_dequantized"}
    assert [[(x["max_tokens_per_rank"], x["experts"]) for x in lp["experts_by_tokens"]]
            for lp in layers] == [[(8, "reference")]] * 3
    r = run_cli("plan", str(checkpoint), "--tuning-cache", str(path), "--token-ranges", env=env,
                timeout=300)
    assert r.returncode == 0, r.stderr
    assert "<=8 reference, else cpu_dequantized" in r.stdout
    assert "1-8 tokens per rank on reference, larger batches on cpu_dequantized" in " ".join(
        r.stdout.split())


def test_a_file_given_as_the_checkpoint_and_a_folder_as_the_cache_are_named_as_such(
        checkpoint, tmp_path):
    # "no such directory" for a file that exists, "does not exist" for a folder that does
    f = tmp_path / "f"
    f.write_text("")
    r = run_cli("tune", str(f), "--tokens", "1", "--cache", str(tmp_path / "c.json"),
                "--no-progress", timeout=120)
    assert r.returncode != 0 and f"{f}: not a checkpoint folder (a file, not a directory)" in (
        r.stderr), r.stderr
    r = run_cli("plan", str(checkpoint), "--tuning-cache", str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"tuning cache {tmp_path} is a folder, not a file" in r.stdout + r.stderr
