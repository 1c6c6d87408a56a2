"""A model whose outputs are not finite: refused at start-up (the probe's token), and, should it
happen to one request later, answered as a server error naming it, never a 500 from the JSON
encoder (an audit of 2026-12-07 found "Out of range float values are not JSON compliant")."""

from __future__ import annotations

import math

import pytest
import torch
from starlette.testclient import TestClient

from moe_runtime.serve.app import LOGPROB_FLOOR, _json_logprob, create_app
from moe_runtime.serve.engine import Engine, EngineError, ReadinessError
from moe_runtime.serve.loading import load_for_serving


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from moe_runtime.serve.default_model import make_default_model

    return make_default_model(tmp_path_factory.mktemp("nf") / "tiny")


def _lm_head(loaded):
    return loaded.model.get_output_embeddings().weight


def test_a_log_probability_json_cannot_carry_is_mapped_or_refused():
    assert _json_logprob(-1.5, 3) == -1.5 and _json_logprob(None, 3) is None
    assert _json_logprob(-math.inf, 3) == LOGPROB_FLOOR
    for bad in (math.nan, math.inf):
        with pytest.raises(EngineError, match="log-probability of token 7 is"):
            _json_logprob(bad, 7)


def test_the_probe_refuses_a_model_whose_first_token_is_not_finite(folder):
    loaded = load_for_serving(folder, dtype="float32", progress=False)
    with torch.no_grad():
        _lm_head(loaded)[5] = math.nan  # one vocabulary row: every log-probability is NaN
    engine = Engine(loaded, max_batch_size=2)
    with pytest.raises(ReadinessError) as err:
        engine.start()
    engine.shutdown()
    message = str(err.value)
    assert "log-probability of nan" in message and "\n" not in message
    assert "the first module whose output holds inf or NaN is lm_head" in message


def test_a_request_whose_outputs_turn_non_finite_gets_a_server_error_and_the_server_serves_on(
        folder):
    loaded = load_for_serving(folder, dtype="float32", progress=False)
    engine = Engine(loaded, max_batch_size=2)
    engine.start()
    head = _lm_head(loaded)
    kept = head[5].clone()
    try:
        with TestClient(create_app(engine, manage_engine=False)) as http:
            body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 2}
            chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3,
                    "temperature": 0, "logprobs": True, "top_logprobs": 2}
            assert http.post("/v1/completions", json=body).status_code == 200
            with torch.no_grad():
                head[5] = math.nan
            for route, payload in (("/v1/completions", body), ("/v1/chat/completions", chat)):
                r = http.post(route, json=payload)
                assert r.status_code == 500, r.text
                err = r.json()["error"]
                assert err["code"] == "non_finite_output"
                assert "is nan" in err["message"] and "not finite" in err["message"]
                with http.stream("POST", route, json={**payload, "stream": True}) as s:
                    events = [line for line in s.iter_lines() if line.startswith("data: ")]
                assert "not finite" in events[-1] and '"non_finite_output"' in events[-1]
            with torch.no_grad():
                head[5] = kept
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200
            assert all(math.isfinite(v) for v in r.json()["choices"][0]["logprobs"]
                       ["token_logprobs"])
    finally:
        engine.shutdown()
