"""The CPU side of ``benchmarks/bench_triton_moe.py`` for this backend's two paths: the run plan
(``--dry-run``), which of our paths counts as ours, and the tuned-table flags it derives from a
run (the GPU timings themselves are measured on the device, never here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from moe_runtime_triton import ops

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_triton_moe.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_triton_moe", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_lists_the_grouped_path_on_its_formats_and_token_counts(bench, capsys):
    bench.main(["--dry-run", "--shapes", "deepseek-v3", "--tokens", "128", "4096",
                "--formats", "bf16", "fp8_w8a8", "nvfp4_w4a16", "--peers", "mk_triton"])
    lines = capsys.readouterr().out.splitlines()
    by_row = {ln.split(":")[0]: ln for ln in lines if ln.startswith("deepseek-v3 ")}
    assert "triton_grouped" in by_row["deepseek-v3 N=4096 bf16"]
    assert "triton_grouped" in by_row["deepseek-v3 N=4096 fp8_w8a8"]
    assert "triton_grouped" not in by_row["deepseek-v3 N=4096 nvfp4_w4a16"]
    assert "triton_grouped" not in by_row["deepseek-v3 N=128 bf16"]  # below --grouped-min-tokens
    assert "mk_triton_fp8" in by_row["deepseek-v3 N=4096 fp8_w8a8"]
    assert "CUDA graph" in by_row["deepseek-v3 N=128 bf16"]
    assert "CUDA graph" not in by_row["deepseek-v3 N=4096 bf16"]
    assert lines[-1].startswith("6 rows")


def test_bad_arguments_are_named(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--formats", "fp4"])
    assert "unknown format(s) ['fp4']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--shapes", "nope"])
    assert "no shape selected" in capsys.readouterr().err


def _row(triton_us, grouped, peer_us, tokens=4096):
    return {"shape": "s", "tokens": tokens, "format": "bf16", "roofline_us": 100.0,
            "table_key": ops.table_key("bf16", 4, 64, 32, 2),
            "table_config": {"BLOCK_M": 64, "g1": {}, "g2": {}},
            "impl": {"triton": {"eager_us": triton_us}, "triton_grouped": grouped,
                     "mk_triton": {"eager_us": peer_us, "graph_us": peer_us + 5}}}


def test_our_best_is_the_faster_path_and_the_grouped_path_is_no_peer(bench):
    r = _row(1000.0, {"eager_us": 800.0}, 900.0)
    bench.summarize_row(r)
    assert r["ours_best_us"] == 800.0 and r["ours_best_path"] == "triton_grouped"
    assert r["best_peer"] == "mk_triton" and r["speedup_vs_best_peer"] == round(900 / 800, 2)
    r = _row(1000.0, {"skipped": "below --grouped-min-tokens 1024"}, 900.0)
    bench.summarize_row(r)
    assert r["ours_best_path"] == "triton" and r["ours_best_us"] == 1000.0


def test_table_flags_follow_the_measurement(bench, monkeypatch):
    monkeypatch.setattr(ops, "_tuned_table", lambda: {"_meta": {"capability": [9, 0]}})
    rows = [_row(1000.0, {"eager_us": 800.0}, 1.0, tokens=4096),
            _row(1000.0, {"eager_us": 990.0}, 1.0, tokens=16384),  # within the noise margin
            _row(1000.0, {"error": "wrong result"}, 1.0, tokens=1024)]
    table, changes = bench.grouped_table(ops, rows)
    entry = table[ops.table_key("bf16", 4, 64, 32, 2)]
    assert entry["4096"]["grouped_mm"] is True and entry["4096"]["BLOCK_M"] == 64
    assert "grouped_mm" not in entry["16384"]
    assert "1024" not in entry
    assert len(changes) == 2 and changes[0].endswith("-> grouped_mm")
    assert table["_meta"] == {"capability": [9, 0]}


def test_shapes_run_in_the_order_given_and_the_compact_table(bench, capsys):
    bench.main(["--dry-run", "--shapes", "deepseek-v3", "qwen3-30b-a3b", "--tokens", "4096",
                "--formats", "bf16"])
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines[:2]] == ["deepseek-v3", "qwen3-30b-a3b"]
    r = _row(1000.0, {"eager_us": 800.0}, 900.0)
    bench.summarize_row(r)
    skipped = _row(1000.0, {"skipped": "why"}, 900.0, tokens=128)
    bench.summarize_row(skipped)
    table = bench.compact_table([r, skipped, {"shape": "s", "tokens": 1, "skipped": "budget"}])
    body = table.splitlines()[2:]
    assert body[0] == "| s | 4096 | bf16 | 1000.0 | 800.0 | mk_triton 900.0 | 1.12 (triton_grouped) |"
    assert "| skipped |" in body[1] and len(body) == 2


def test_nvfp4_compute_bench_smoke_checks_each_path_and_names_bad_shapes(tmp_path, capsys):
    """``benchmarks/bench_nvfp4_compute.py --smoke`` on CPU (the interpreter: float16 only): both
    paths' rows, their outputs checked against the float32 reference, written as JSON and
    markdown; an unknown shape is named with the known ones."""
    import json

    path = BENCH.parent / "bench_nvfp4_compute.py"
    spec = importlib.util.spec_from_file_location("bench_nvfp4_compute", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "nvfp4_compute.json").read_text())["rows"]
    assert {(r["tokens"], r["path"]) for r in rows} == {(1, "default"), (1, "w4a16"),
                                                         (4, "default"), (4, "w4a16")}
    assert all(r["fp16_err"] < 1e-2 and r["fp16_us"] > 0 for r in rows)
    assert "| tiny | 4 | w4a16 |" in (tmp_path / "nvfp4_compute.md").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        mod.main(["--shapes", "no-such-shape", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "no-such-shape" in err and "deepseek-v3" in err
