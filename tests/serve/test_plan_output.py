"""``moe-runtime plan``'s printed table: each note once, rejections and refusals grouped across
layers (a 48-layer model printed the same refusal 48 times, and every row carried 300-character
notes). Here with the planning serve does too: serve prints a refused pin the same way."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moe_runtime.cli import group_layer_lines, layer_ranges


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("plan") / "m", arch="qwen3_moe",
                                quant="mixed", hidden_size=128, intermediate_size=64,
                                num_hidden_layers=6)


def _plan(*argv):
    return subprocess.run([sys.executable, "-m", "moe_runtime.cli", "plan", *argv],
                          capture_output=True, text=True, timeout=120)


def test_layer_ranges_compress_indices():
    names = [f"model.layers.{i}.mlp.experts" for i in (0, 1, 2, 3, 7, 9, 10)]
    assert layer_ranges(names) == "layers 0-3, 7, 9-10 of model.layers.N.mlp.experts"
    assert layer_ranges(["model.layers.4.mlp.experts"]) == "model.layers.4.mlp.experts"
    assert layer_ranges(["a.experts", "b.experts"]) == "a.experts, b.experts"


def test_refusals_that_differ_only_in_the_layer_are_one_line():
    lines = [f"layer model.layers.{i}.mlp.experts (format f): backend x cannot run it"
             for i in range(48)] + ["something else"]
    assert group_layer_lines(lines) == [
        "layers 0-47 of model.layers.N.mlp.experts (format f): backend x cannot run it",
        "something else"]


def test_the_table_names_each_note_once_and_lines_stay_short(six_layers):
    r = _plan(str(six_layers), "--target-device", "sm90")
    assert r.returncode == 0, r.stderr
    table, _, rest = r.stdout.partition("\nnotes:\n")
    rows = [line for line in table.splitlines() if line.startswith("model.layers.")]
    assert len(rows) == 6 and all(row.endswith("[1] [2]") for row in rows)
    notes, _, rejected = rest.partition("rejected:\n")
    assert notes.count("[1] ") == 1 and "activations are not quantized" in notes
    entries = [line for line in rejected.splitlines() if not line.startswith("    ")]
    assert " ".join(rejected.split()).count("[layers 0-5 of model.layers.N.mlp.experts]") == len(
        entries)
    assert rejected.count("flashinfer_cutedsl") == 1
    assert max(len(line) for line in r.stdout.splitlines()) <= 160


def test_a_refused_pin_is_one_line_for_all_layers(six_layers):
    r = _plan(str(six_layers), "--moe-runner-backend", "flashinfer_cutedsl", "--target-device",
              "sm90")
    assert r.returncode == 1
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("error: layers 0-5 of model.layers.N.mlp.experts (format nvfp4_w4a4")
