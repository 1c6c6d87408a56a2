"""vLLM's stopping controls through the real server, on both batching paths: ``ignore_eos``,
``stop_token_ids``, ``min_tokens`` (EOS and stop tokens masked until then, stop strings not
searched), ``include_stop_str_in_output``; and the sampler's mask on its own (the CUDA-graph
``static`` mode included).

The default model is random: to have an EOS the greedy decode reaches, the module serves a copy of
it whose ``eos_token_id`` is a token its greedy decode makes a few steps in.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from moe_runtime.serve.detokenize import IncrementalDetokenizer
from moe_runtime.serve.sampling import BatchSampler, SamplingParams
from moe_runtime.serve.tiny_tokenizer import special_token_ids
from tests.serve.conftest import API_KEY

PROMPT = [5, 6, 7, 8]
LENGTH = 12


def _generate(http, model: str, path: str = "/v1/completions", **body) -> dict:
    body = {"model": model, "max_tokens": LENGTH, "temperature": 0, "return_token_ids": True,
            **body}
    if path == "/v1/completions":
        body.setdefault("prompt", PROMPT)
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(out: dict) -> tuple[list[int], str]:
    choice = out["choices"][0]
    return choice["token_ids"], choice["finish_reason"]


@pytest.fixture(scope="module")
def greedy(http, server) -> list[int]:
    """The default model's greedy tokens after PROMPT, EOS ignored."""
    ids, reason = _ids(_generate(http, server.model, ignore_eos=True))
    assert reason == "length" and len(ids) == LENGTH
    return ids


@pytest.fixture(scope="module")
def eos_at(greedy) -> int:
    """A position whose greedy token did not occur before it and is no special token."""
    specials = set(special_token_ids().values())
    for k in range(2, LENGTH - 4):
        if greedy[k] not in greedy[:k] and greedy[k] not in specials:
            return k
    pytest.fail(f"no fresh token in the greedy decode {greedy}")


@pytest.fixture(scope="module", params=["continuous", "dynamic"])
def eos_server(request, tmp_path_factory, model_dir, greedy, eos_at, server_factory):
    folder = tmp_path_factory.mktemp("eos-model") / "eos-model"
    shutil.copytree(model_dir, folder)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((folder / name).read_text())
        data["eos_token_id"] = greedy[eos_at]
        (folder / name).write_text(json.dumps(data))
    proc = server_factory([str(folder), "--batching", request.param])
    with httpx.Client(base_url=proc.root, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield proc, client


def test_eos_stops_and_ignore_eos_runs_to_max_tokens(eos_server, greedy, eos_at):
    proc, http = eos_server
    eos = _generate(http, proc.model)
    assert _ids(eos) == (greedy[:eos_at + 1], "stop")
    assert eos["choices"][0]["stop_reason"] is None  # vLLM's: no stop_reason for an EOS
    assert _ids(_generate(http, proc.model, ignore_eos=True)) == (greedy, "length")
    # the EOS made a stop token again by the request: ignore_eos drops only the model's EOS
    out = _generate(http, proc.model, ignore_eos=True, stop_token_ids=[greedy[eos_at]])
    assert _ids(out) == (greedy[:eos_at + 1], "stop")
    assert out["choices"][0]["stop_reason"] == greedy[eos_at]


def test_min_tokens_holds_the_eos_off(eos_server, greedy, eos_at):
    proc, http = eos_server
    least = eos_at + 3
    ids, reason = _ids(_generate(http, proc.model, min_tokens=least))
    assert ids[:eos_at] == greedy[:eos_at]  # the same up to where the EOS was masked
    assert greedy[eos_at] not in ids[:least] and len(ids) >= least
    assert reason == ("stop" if ids[-1] == greedy[eos_at] else "length")
    # min_tokens equal to max_tokens: exactly that many, whatever the stops
    ids, reason = _ids(_generate(http, proc.model, min_tokens=LENGTH, max_tokens=LENGTH))
    assert len(ids) == LENGTH and greedy[eos_at] not in ids


def test_the_controls_hold_in_one_batch_and_streamed(eos_server, greedy, eos_at):
    proc, http = eos_server
    bodies = [{}, {"ignore_eos": True}, {"min_tokens": eos_at + 2},
              {"ignore_eos": True, "stop_token_ids": [greedy[eos_at + 1]]},
              {"min_tokens": 3, "temperature": 1.0, "seed": 7, "ignore_eos": True}] * 2
    alone = [_ids(_generate(http, proc.model, **b)) for b in bodies[:5]]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: _ids(_generate(http, proc.model, **b)), bodies))
    assert together == alone * 2
    assert alone[3][0] == greedy[:greedy.index(greedy[eos_at + 1]) + 1]
    events = []
    with http.stream("POST", "/v1/completions", json={
            "model": proc.model, "prompt": PROMPT, "max_tokens": LENGTH, "temperature": 0,
            "return_token_ids": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:])["choices"][0])
    assert [t for e in events for t in e["token_ids"]] == greedy[:eos_at + 1]
    assert events[-1]["finish_reason"] == "stop"


def test_stop_token_ids_end_the_request_on_the_default_server(http, server, greedy, eos_at):
    out = _generate(http, server.model, stop_token_ids=[greedy[eos_at]])
    assert _ids(out) == (greedy[:eos_at + 1], "stop")
    assert out["choices"][0]["stop_reason"] == greedy[eos_at]  # vLLM's: the stop token id
    vocab = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2,
                                               "stop_token_ids": [10**7]})
    assert vocab.status_code == 400 and vocab.json()["error"]["param"] == "stop_token_ids"
    assert "[0, " in vocab.json()["error"]["message"]
    negative = http.post("/v1/completions", json={"prompt": PROMPT, "stop_token_ids": [-1]})
    assert negative.status_code == 400 and negative.json()["error"]["param"] == "stop_token_ids"
    assert "0 or more" in negative.json()["error"]["message"]


def test_min_tokens_holds_stop_strings_off_and_must_fit(http, server):
    plain = _generate(http, server.model, prompt="Once upon a time", max_tokens=24)
    text = plain["choices"][0]["text"]
    stop = text[len(text) // 4:len(text) // 4 + 2].strip() or text[:1]
    cut = _generate(http, server.model, prompt="Once upon a time", max_tokens=24, stop=stop)
    cut_ids, reason = _ids(cut)
    assert reason == "stop" and stop not in cut["choices"][0]["text"]
    assert cut["choices"][0]["stop_reason"] == stop
    assert plain["choices"][0]["stop_reason"] is None
    held = _generate(http, server.model, prompt="Once upon a time", max_tokens=24, stop=stop,
                     min_tokens=len(cut_ids) + 4)
    assert len(held["choices"][0]["token_ids"]) >= len(cut_ids) + 4
    kept = _generate(http, server.model, prompt="Once upon a time", max_tokens=24, stop=stop,
                     include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == cut["choices"][0]["text"] + stop
    sglang = _generate(http, server.model, prompt="Once upon a time", max_tokens=24, stop=stop,
                       no_stop_trim=True)
    assert sglang["choices"][0]["text"] == kept["choices"][0]["text"]
    too_many = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                                  "min_tokens": 5})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "min_tokens"
    # without max_tokens the default (16) grows to min_tokens
    grown = _generate(http, server.model, prompt="hi", max_tokens=None, min_tokens=20,
                      ignore_eos=True)
    assert len(grown["choices"][0]["token_ids"]) == 20


# ------------------------------------------------------------------------------ the sampler

V = 12


@pytest.mark.parametrize("static", [False, True])
def test_the_sampler_masks_stop_tokens_until_min_tokens(static):
    s = BatchSampler(V, max_slots=4, max_batch=4, max_bans=3, static=static)
    logits = torch.zeros(3, V)
    logits[:, 0] = 5.0  # token 0 (a stop token, the padding entries' index too) is the likeliest
    logits[:, 4] = 4.0
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(0, 4)),
              SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=(0,)),
              SamplingParams(temperature=1.0, seed=3, min_tokens=2, stop_token_ids=(0, 4))]
    keys = [s.open(p) for p in params]
    steps = [s.sample(logits, s.rows_for(keys)).tolist() for _ in range(3)]
    masked = {0, 4}
    assert steps[0][0] not in masked and steps[1][0] not in masked and steps[2][0] == 0
    assert [steps[0][1], steps[1][1]] == [4, 0]  # only token 0 was masked, for one step
    assert steps[0][2] not in masked and steps[1][2] not in masked
    with pytest.raises(ValueError, match="stop tokens for min_tokens"):
        s.open(SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=(1, 2, 3, 5)))


def test_the_detokenizer_keeps_special_tokens_and_stop_strings_when_asked(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok("Hello there", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    plain = IncrementalDetokenizer(tok)
    assert tok.eos_token not in plain.step(ids) + plain.finish()
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert (kept.step(ids) + kept.finish()).endswith(tok.eos_token)
    cut = IncrementalDetokenizer(tok, ("there",), include_stop=True)
    assert cut.step(ids) + cut.finish() == "Hello there" and cut.stopped
    held = IncrementalDetokenizer(tok, ("Hello",))
    assert held.step(ids, check_stops=False) + held.finish() == "Hello there"
    assert not held.stopped
