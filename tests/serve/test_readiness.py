"""Ready means able to answer: one token through the planned model before /health says ok.

The failures here are real ones: DeepSeek-V3 pinned to transformers' paged cache (the shape error
of issue 18), a router asked for more experts than its layer has, an architecture that no batching
path holds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from starlette.testclient import TestClient

from moe_runtime.serve.app import create_app
from moe_runtime.serve.engine import Engine, ReadinessError
from moe_runtime.serve.loading import load_for_serving


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from moe_runtime.serve.default_model import make_default_model

    return make_default_model(tmp_path_factory.mktemp("ds") / "tiny-deepseek", quant="mixed",
                              arch="deepseek_v3")


def _load(folder):
    return load_for_serving(folder, dtype="float32", progress=False)


def _serve(*argv, timeout=240):
    return subprocess.run([sys.executable, "-m", "moe_runtime.serve", "--port", "0", *argv],
                          capture_output=True, text=True, timeout=timeout)


def test_health_answers_503_until_a_first_token_was_generated(deepseek):
    engine = Engine(_load(deepseek), max_batch_size=2)
    engine.start(probe=False)
    try:
        with TestClient(create_app(engine, manage_engine=False)) as http:
            assert http.get("/health").status_code == 503
            body = {"prompt": "Hello", "max_tokens": 2}
            assert http.post("/v1/completions", json=body).status_code == 503
            assert engine.probe() > 0
            assert http.get("/health").json() == {"status": "ok"}
            assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"]
    finally:
        engine.shutdown()


def test_a_failed_probe_names_the_architecture_the_batching_path_and_the_module(deepseek):
    engine = Engine(_load(deepseek), batching="continuous")
    with pytest.raises(ReadinessError) as err:
        engine.start()
    try:
        message = str(err.value)
        assert message.startswith("DeepseekV3ForCausalLM cannot serve")
        assert "failed in model.layers.0.self_attn (DeepseekV3Attention)" in message
        assert "paged cache stores keys and values in pages of 4 heads x 16" in message
        assert "keys of 4 heads x 32" in message and "index_copy_" in message
        assert "\n" not in message
        assert not engine.healthy
    finally:
        engine.shutdown()


def test_the_probe_catches_a_router_asked_for_more_experts_than_its_layer_has(deepseek):
    loaded = _load(deepseek)
    loaded.model.model.layers[1].mlp.gate.top_k = 9  # the layer has 8 experts
    engine = Engine(loaded)
    with pytest.raises(ReadinessError, match=r"failed in model\.layers\.1\.mlp\.gate "
                                             r"\(DeepseekV3TopkRouter\)"):
        engine.start()
    engine.shutdown()


def test_serve_exits_with_one_paragraph_when_the_first_token_fails(deepseek):
    r = _serve("--model", str(deepseek), "--batching", "continuous")
    assert r.returncode == 1
    [error] = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert error.startswith("error: DeepseekV3ForCausalLM cannot serve")
    assert "model.layers.0.self_attn (DeepseekV3Attention)" in error
    assert "Traceback" not in r.stderr
    assert "ready: " not in r.stderr


def test_debug_adds_the_traceback_of_the_failed_probe(deepseek):
    r = _serve("--model", str(deepseek), "--batching", "continuous", "--debug")
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "index_copy_" in r.stderr


def test_top_k_above_the_expert_count_is_refused_at_start_up(deepseek, tmp_path):
    folder = tmp_path / "topk"
    shutil.copytree(deepseek, folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_experts_per_tok"] = config["n_routed_experts"] + 1
    (folder / "config.json").write_text(json.dumps(config))
    r = _serve("--model", str(folder))
    assert r.returncode == 1
    assert "num_experts_per_tok" in r.stderr or "mlp.gate" in r.stderr
    assert "Traceback" not in r.stderr and "ready: " not in r.stderr


def test_an_architecture_no_batching_path_holds_is_refused_naming_the_served_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3NextForCausalLM"]}))
    r = _serve("--model", str(tmp_path), timeout=120)
    assert r.returncode == 1
    assert "Qwen3NextForCausalLM (Qwen3-Next) plans, but moe-runtime serve cannot serve it" \
        in r.stderr
    assert "recurrent state" in r.stderr and "DeepSeek-V3 (DeepseekV3ForCausalLM)" in r.stderr


def test_a_nan_in_a_weight_is_refused_at_start_up_naming_the_tensor(deepseek, tmp_path):
    """A NaN weight would answer every request with garbage; the server refuses to start and
    names the tensor (the default model's shards are read and rewritten as they are)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "nan"
    shutil.copytree(deepseek, folder)
    name = "model.layers.0.input_layernorm.weight"
    for f in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(f))
        if name in tensors:
            w = tensors[name].clone()
            w[3] = float("nan")
            tensors[name] = w
            save_file(tensors, str(f), metadata={"format": "pt"})
            break
    else:
        pytest.fail(f"{name} is in none of the default model's files")
    r = _serve("--model", str(folder))
    assert r.returncode == 1
    assert f"tensor '{name}'" in r.stderr and "holds 1 NaN or infinite value(s)" in r.stderr
    assert "Traceback" not in r.stderr and "ready: " not in r.stderr
