"""``min_p`` and ``repetition_penalty`` (vLLM's and SGLang's extra body fields) through the real
server and the official client's ``extra_body``: accepted values change which tokens are drawn,
bad ones are a 400 naming the field and its range, and the server serves on."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.serve.conftest import API_KEY

PROMPT = "Once upon a time"


def _ids(client, server, max_tokens=12, **kwargs) -> list[int]:
    extra = {"return_token_ids": True, **kwargs.pop("extra_body", {})}
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=max_tokens,
                                    extra_body=extra, **kwargs)
    return out.choices[0].model_extra["token_ids"]


def test_min_p_one_keeps_only_the_likeliest_token(client, server):
    greedy = _ids(client, server, temperature=0)
    sampled = _ids(client, server, temperature=1.0, seed=21)
    assert sampled != greedy, "a seeded draw at temperature 1 leaves the greedy path"
    assert _ids(client, server, temperature=1.0, seed=21, extra_body={"min_p": 0.0}) == sampled
    assert _ids(client, server, temperature=1.0, seed=21, extra_body={"min_p": 1.0}) == greedy


def _below_min_p(out, min_p: float) -> int:
    """Tokens drawn that a ``min_p`` filter would have dropped (logprobs: the model's own)."""
    lp = out.choices[0].logprobs
    count = 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        if chosen < math.log(min_p) + max(top.values()) - 1e-4:
            count += 1
    return count


def test_min_p_drops_the_unlikely_tokens(client, server):
    # at temperature 1 with no other filter, the filter's probabilities are the logprobs' own
    kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=24, temperature=1.0,
                  logprobs=1)
    plain = [client.completions.create(seed=s, **kwargs) for s in range(3)]
    assert sum(_below_min_p(out, 0.3) for out in plain) > 0, "unfiltered draws go below 0.3"
    for s in range(3):
        out = client.completions.create(seed=s, extra_body={"min_p": 0.3}, **kwargs)
        assert _below_min_p(out, 0.3) == 0


def test_repetition_penalty_changes_the_greedy_text(client, server):
    plain = _ids(client, server, max_tokens=40, temperature=0)
    assert len(set(plain)) < len(plain), "the greedy text repeats tokens"
    penalized = _ids(client, server, max_tokens=40, temperature=0,
                     extra_body={"repetition_penalty": 3.0})
    assert len(set(penalized)) > len(set(plain))
    assert _ids(client, server, max_tokens=40, temperature=0,
                extra_body={"repetition_penalty": 1.0}) == plain


def test_chat_reads_both_fields(client, server):
    def chat(temperature=1.0, **extra):
        out = client.chat.completions.create(
            model=server.model, max_tokens=24, temperature=temperature, seed=8,
            messages=[{"role": "user", "content": "Tell me a story"}],
            extra_body={"return_token_ids": True, **extra})
        return out.choices[0].model_extra["token_ids"]

    plain, greedy = chat(), chat(temperature=0)
    assert plain != greedy
    assert chat(min_p=1.0) == greedy
    assert chat(repetition_penalty=3.0) != plain


BAD = [
    ("min_p", -0.1, "must lie in [0, 1]"),
    ("min_p", 1.5, "must lie in [0, 1]"),
    ("min_p", "0.5", "a valid number"),
    ("repetition_penalty", 0, "above 0"),
    ("repetition_penalty", -1.2, "above 0"),
    ("repetition_penalty", True, "a valid number"),
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize(("field", "value", "says"), BAD)
def test_bad_values_are_a_400_naming_the_field_and_range(client, server, chat, field, value,
                                                         says):
    with pytest.raises(openai.BadRequestError) as info:
        if chat:
            client.chat.completions.create(model=server.model, max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}],
                                           extra_body={field: value})
        else:
            client.completions.create(model=server.model, prompt="hi", max_tokens=2,
                                      extra_body={field: value})
    assert info.value.status_code == 400
    assert info.value.param == field
    assert f"'{field}'" in info.value.message and says in info.value.message
    assert repr(value) in info.value.message  # the value sent
    after = client.completions.create(model=server.model, prompt="hi", max_tokens=2,
                                      temperature=0)
    assert after.choices[0].finish_reason in ("length", "stop")


def test_an_infinite_repetition_penalty_is_a_400(server):
    # JSON has no infinity, but 1e400 parses to one
    body = b'{"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e400}'
    r = httpx.post(server.root + "/v1/completions", content=body, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}",
                            "Content-Type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "repetition_penalty"
    assert "must be a finite number above 0" in error["message"]
    assert httpx.get(server.root + "/health").status_code == 200
