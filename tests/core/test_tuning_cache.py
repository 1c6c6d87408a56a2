"""The tuning cache file: written and read back, and ignored with a note, never a crash, when it is
malformed, stale (other plugin versions) or foreign (another device or environment)."""

from __future__ import annotations

import json

import attrs
import pytest

from moe_runtime.backend_api import LayerProblem
from moe_runtime.environment import Environment
from moe_runtime.planner import Deployment, layer_candidates
from moe_runtime.plugin.manager import get_plugin_manager
from moe_runtime.plugin.registry import Registry
from moe_runtime.tuning.cache import (
    ENV_VAR,
    SCHEMA,
    Measurement,
    Section,
    cache_key,
    candidate_key,
    default_cache_path,
    load_tuning,
    merge,
    problem_key,
    read_sections,
    write_sections,
)

CPU = Environment("cpu", None, frozenset({"torch"}), "cpu")
GPU = Environment("cuda", (9, 0), frozenset({"torch", "triton"}), "NVIDIA H200")
P = LayerProblem("model.layers.0.mlp.experts", "bf16", "silu", 8, 2, 64, 32)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.from_plugin_manager(get_plugin_manager(autoload=False, environ={}))


def measured(registry, env, times: dict[str, float], tokens: int = 16, day="2026-12-01"):
    """A section of ``env`` timing each built-in candidate of ``P`` as ``times`` says."""
    plans = layer_candidates(P, registry=registry, environment=env, deployment=Deployment()).plans
    ms = tuple(Measurement(problem_key(P, 1), candidate_key(lp, tokens), tokens,
                           times[lp.experts], 5, "wall_clock", f"{day}T00:00:00Z")
               for lp in plans if lp.experts in times)
    return Section(cache_key(env, registry), env.to_json(), ms)


def test_a_written_cache_reads_back_equal(tmp_path, registry):
    path = tmp_path / "t.json"
    section = measured(registry, CPU, {"reference": 50.0, "cpu_dequantized": 80.0})
    write_sections(path, [section])
    assert read_sections(path) == [section]
    assert json.loads(path.read_text())["schema"] == SCHEMA


def test_a_matching_cache_is_used_and_says_when_it_was_measured(tmp_path, registry):
    path = tmp_path / "t.json"
    write_sections(path, [measured(registry, CPU, {"reference": 50.0})])
    tuning = load_tuning(path, CPU, registry)
    assert tuning.cache is not None
    assert tuning.notes == (f"tuning cache {path} (measured 2026-12-01) breaks ties between "
                            "equally exact experts backends",)


def test_a_cache_of_other_plugin_versions_is_ignored_as_stale_naming_the_field(tmp_path,
                                                                                registry):
    section = measured(registry, CPU, {"reference": 50.0})
    software = {**section.key["software"], "plugin builtin": "moe-runtime 0.0.9 (loaded)"}
    path = tmp_path / "t.json"
    write_sections(path, [attrs.evolve(section, key={**section.key, "software": software})])
    tuning = load_tuning(path, CPU, registry)
    assert tuning.cache is None
    (note,) = tuning.notes
    assert note.startswith(f"ignored tuning cache {path}: stale: plugin builtin is ")
    assert "'moe-runtime 0.0.9 (loaded)' in the cache" in note
    assert f"moe-runtime tune CHECKPOINT --cache {path}" in note


def test_a_cache_of_another_device_is_ignored_as_foreign(tmp_path, registry):
    path = tmp_path / "t.json"
    write_sections(path, [measured(registry, CPU, {"reference": 50.0})])
    tuning = load_tuning(path, GPU, registry)
    assert tuning.cache is None
    (note,) = tuning.notes
    assert note.startswith(f"ignored tuning cache {path}: foreign: it holds measurements of cpu "
                           f"(environment {CPU.fingerprint()}), not of {GPU.described}")


def test_other_importable_modules_are_another_environment(tmp_path, registry):
    path = tmp_path / "t.json"
    write_sections(path, [measured(registry, CPU, {"reference": 50.0})])
    other = attrs.evolve(CPU, available=frozenset({"torch", "triton"}))
    assert "foreign" in load_tuning(path, other, registry).notes[0]


@pytest.mark.parametrize("text, why", [
    ("{not json", "malformed: not JSON"),
    ('{"schema": "moe-runtime-tuning/0", "sections": []}',
     "malformed: schema is 'moe-runtime-tuning/0', expected 'moe-runtime-tuning/2'"),
    ('[1, 2]', "malformed: schema is 'list'"),
    ('{"schema": "moe-runtime-tuning/2"}', "malformed: the cache has no field 'sections'"),
])
def test_a_malformed_cache_is_ignored_with_a_note(tmp_path, registry, text, why):
    path = tmp_path / "t.json"
    path.write_text(text)
    tuning = load_tuning(path, CPU, registry)
    assert tuning.cache is None
    assert tuning.notes[0].startswith(f"ignored tuning cache {path}: {why}")


def test_a_measurement_of_the_wrong_type_names_its_field(tmp_path, registry):
    data = {"schema": SCHEMA, "sections": [measured(registry, CPU, {"reference": 5.0}).to_json()]}
    data["sections"][0]["measurements"][0]["median_us"] = "fast"
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    (note,) = load_tuning(path, CPU, registry).notes
    assert note.endswith("malformed: sections[0].measurements[0].median_us is 'fast', "
                         "expected int or float")


def test_a_missing_cache_is_silent_at_the_default_location_and_noted_when_named(tmp_path,
                                                                                registry):
    path = tmp_path / "absent.json"
    assert load_tuning(path, CPU, registry, explicit=False).notes == ()
    assert "does not exist" in load_tuning(path, CPU, registry).notes[0]


def test_merging_replaces_the_same_measurement_keeps_other_devices_drops_stale(registry):
    old = measured(registry, CPU, {"reference": 50.0, "cpu_dequantized": 80.0})
    gpu = attrs.evolve(old, key={**old.key, "device": "NVIDIA H200", "environment": "abc"})
    stale = attrs.evolve(old, key={**old.key, "software": {"plugin x": "1"}})
    new = measured(registry, CPU, {"reference": 20.0}, day="2026-12-02")
    merged = merge([old, gpu, stale], new)
    assert [s.key for s in merged] == [gpu.key, new.key]
    times = {m.candidate["experts"]: m.median_us for m in merged[-1].measurements}
    assert times == {"reference": 20.0, "cpu_dequantized": 80.0}


def test_the_default_location_follows_the_environment_variable(tmp_path):
    assert default_cache_path({ENV_VAR: str(tmp_path / "c.json")}) == tmp_path / "c.json"
    assert default_cache_path({ENV_VAR: "none"}) is None
    assert default_cache_path({ENV_VAR: ""}) is None


def test_the_default_location_is_in_moe_runtimes_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_path({}) == tmp_path / "moe-runtime" / "tuning.json"


def test_a_cache_of_the_eager_only_schema_is_ignored_as_outdated(tmp_path, registry):
    data = {"schema": SCHEMA, "sections": [measured(registry, CPU, {"reference": 5.0}).to_json()]}
    for m in data["sections"][0]["measurements"]:  # as moe-runtime-tuning/1 wrote them
        del m["timed"], m["eager_us"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({**data, "schema": "moe-runtime-tuning/1"}))
    tuning = load_tuning(path, CPU, registry)
    assert tuning.cache is None
    (note,) = tuning.notes
    assert note.startswith(f"ignored tuning cache {path}: outdated: schema 'moe-runtime-tuning/1' "
                           "is an older one: every call was timed eagerly")
    assert f"moe-runtime tune CHECKPOINT --cache {path}" in note
    # the same measurements under today's schema lack how they were timed
    path.write_text(json.dumps(data))
    assert load_tuning(path, CPU, registry).notes[0].endswith(
        "malformed: sections[0].measurements[0] has no field 'timed'")


def test_graph_timed_measurements_read_back_with_their_eager_time(tmp_path, registry):
    section = measured(registry, CPU, {"reference": 50.0})
    graphed = tuple(attrs.evolve(m, timed="graph", eager_us=400.0) for m in section.measurements)
    section = attrs.evolve(section, measurements=graphed)
    path = tmp_path / "t.json"
    write_sections(path, [section])
    (back,) = read_sections(path)
    assert back == section and back.measurements[0].timed == "graph"
    assert back.measurements[0].eager_us == 400.0


@pytest.mark.parametrize("timed, eager, why", [
    ("replayed", None, "timed is 'replayed', expected 'graph' or 'eager: <why>'"),
    ("graph", None, "has no field 'eager_us'"),
])
def test_how_a_measurement_was_timed_is_checked(tmp_path, registry, timed, eager, why):
    data = {"schema": SCHEMA, "sections": [measured(registry, CPU, {"reference": 5.0}).to_json()]}
    m = data["sections"][0]["measurements"][0]
    m["timed"] = timed
    del m["eager_us"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    assert load_tuning(path, CPU, registry).notes[0].endswith(why)


def _hostile(field_path, value):
    def edit(m):
        *parents, last = field_path
        for k in parents:
            m = m[k]
        m[last] = value
    return edit


@pytest.mark.parametrize("edit, why", [
    (_hostile(["median_us"], 10**400), "median_us must be a positive finite number"),
    (_hostile(["median_us"], float("inf")), "median_us must be a positive finite number"),
    (_hostile(["median_us"], float("nan")), "median_us must be a positive finite number"),
    (_hostile(["median_us"], -3), "median_us must be a positive finite number"),
    (_hostile(["eager_us"], 10**400), "eager_us must be a positive finite number"),
    (_hostile(["problem", "format"], ["bf16"]), "problem.format is ['bf16'], expected str"),
    (_hostile(["problem", "top_k"], {"a": 1}), "problem.top_k is {'a': 1}, expected int"),
    (_hostile(["problem", "top_k"], True), "problem.top_k is True, expected int"),
    (_hostile(["candidate", "experts"], ["x"]), "candidate.experts is ['x'], expected str"),
    (_hostile(["candidate", "more"], [1]), "candidate.more is [1], expected str or int"),
])
def test_a_hostile_measurement_is_ignored_with_a_note_not_a_crash(tmp_path, registry, edit, why):
    data = {"schema": SCHEMA, "sections": [measured(registry, CPU, {"reference": 5.0}).to_json()]}
    edit(data["sections"][0]["measurements"][0])
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    tuning = load_tuning(path, CPU, registry)
    assert tuning.cache is None
    (note,) = tuning.notes
    assert "malformed: sections[0].measurements[0]" in note and why in note


@pytest.mark.parametrize("text, why", [
    ("[" * 100000 + "]" * 100000, "not JSON (nested too deeply)"),
    ('{"schema": "moe-runtime-tuning/2", "sections": [' + "9" * 5000 + "]}", "not JSON ("),
])
def test_json_that_python_cannot_decode_is_ignored_with_a_note(tmp_path, registry, text, why):
    path = tmp_path / "t.json"
    path.write_text(text)
    tuning = load_tuning(path, CPU, registry)
    assert tuning.cache is None
    assert f"ignored tuning cache {path}: malformed: {why}" in tuning.notes[0]


def test_writing_through_a_symlink_updates_its_target_and_keeps_the_link(tmp_path, registry):
    shared = tmp_path / "shared" / "tuning.json"
    shared.parent.mkdir()
    write_sections(shared, [])
    link = tmp_path / "tuning.json"
    link.symlink_to(shared)
    section = measured(registry, CPU, {"reference": 50.0})
    write_sections(link, [section])
    assert link.is_symlink() and read_sections(shared) == [section]
    assert load_tuning(link, CPU, registry).cache is not None


@pytest.mark.parametrize("given", ["none", "NONE", "", " "])
def test_tuning_cache_none_or_empty_reads_nothing_even_with_a_default_cache(tmp_path, registry,
                                                                            given):
    import argparse

    from moe_runtime.tuning.command import tuning_for

    path = tmp_path / "t.json"
    write_sections(path, [measured(registry, CPU, {"reference": 50.0})])
    environ = {ENV_VAR: str(path)}
    assert tuning_for(argparse.Namespace(tuning_cache=None), CPU, registry, environ).cache
    tuning = tuning_for(argparse.Namespace(tuning_cache=given), CPU, registry, environ)
    assert tuning.cache is None and tuning.notes == ()


def test_a_cache_in_a_folder_this_user_cannot_search_is_ignored_with_a_note(tmp_path, registry,
                                                                           monkeypatch):
    # as root (these tests' machine) every folder is searchable; for other users stat() of a
    # file under a folder without x permission raises PermissionError, which Path.is_file of
    # Python 3.11 lets through
    from pathlib import Path

    path = tmp_path / "locked" / "t.json"
    real_stat = Path.stat

    def stat(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)
    tuning = load_tuning(path, CPU, registry)
    assert tuning.cache is None
    (note,) = tuning.notes
    assert note.startswith(f"ignored tuning cache {path}: malformed: cannot be read (")
    assert "Permission denied" in note
