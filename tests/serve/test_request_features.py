"""Request features of OpenAI's API beyond one plain completion, through the official client:
``n``, prompt lists, ``logprobs`` / ``top_logprobs``, ``echo``, presence and frequency penalties,
``x-request-id``, echo with logprobs (prompt scoring, on the dynamic batcher), and the clean
refusals (JSON ``response_format``)."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.serve.conftest import API_KEY


def _completion(client, server, **kwargs):
    kwargs = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 6,
              "temperature": 0, **kwargs}
    return client.completions.create(**kwargs)


def test_n_returns_that_many_choices_and_counts_their_tokens(client, server):
    out = _completion(client, server, n=3, temperature=1.0, seed=11, max_tokens=8)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1  # each choice has a seed of its own
    again = _completion(client, server, n=3, temperature=1.0, seed=11, max_tokens=8)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    ids = _completion(client, server, n=3, temperature=1.0, seed=11, max_tokens=8,
                      extra_body={"return_token_ids": True})
    total = sum(len(c.model_extra["token_ids"]) for c in ids.choices)
    assert ids.usage.completion_tokens == total
    single = _completion(client, server, max_tokens=8)
    assert ids.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once


def test_n_streamed_interleaves_choices_that_add_up_to_the_whole_ones(client, server):
    kwargs = dict(n=2, temperature=1.0, seed=5, max_tokens=10)
    whole = _completion(client, server, **kwargs)
    texts = {0: "", 1: ""}
    finished = {}
    for chunk in _completion(client, server, stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finished == {c.index: c.finish_reason for c in whole.choices}


def test_chat_n_returns_that_many_messages(client, server):
    out = client.chat.completions.create(model=server.model, n=2, max_tokens=4, temperature=0,
                                         messages=[{"role": "user", "content": "Hi"}])
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].message.content == out.choices[1].message.content  # greedy


def test_a_prompt_list_answers_each_prompt_as_alone(client, server):
    prompts = ["The quick brown fox", "Hello, world!", "one two three"]
    batch = _completion(client, server, prompt=prompts)
    alone = [_completion(client, server, prompt=p).choices[0].text for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == alone
    token_lists = _completion(client, server, prompt=[[5, 6, 7], [8, 9]], n=2)
    assert [c.index for c in token_lists.choices] == [0, 1, 2, 3]
    assert token_lists.usage.prompt_tokens == 5


def test_completion_logprobs_have_openai_shape(client, server):
    out = _completion(client, server, logprobs=3, max_tokens=8,
                      extra_body={"return_token_ids": True})
    choice = out.choices[0]
    lp = choice.logprobs
    n = len(choice.model_extra["token_ids"])
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and len(top) <= 3
        # greedy: the chosen token is the likeliest one
        assert math.isclose(logprob, max(top.values()), abs_tol=1e-5)
        assert chosen in top


def test_chat_logprobs_have_openai_shape(client, server):
    out = client.chat.completions.create(
        model=server.model, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": "Count to three."}])
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode(errors="replace") == entry.token
        assert len(entry.top_logprobs) == 2
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-5)
    plain = client.chat.completions.create(
        model=server.model, max_tokens=5, temperature=0,
        messages=[{"role": "user", "content": "Count to three."}])
    assert plain.choices[0].logprobs is None


def test_streamed_logprobs_cover_every_token_once(client, server):
    whole = _completion(client, server, logprobs=1, max_tokens=8)
    tokens = []
    for chunk in _completion(client, server, logprobs=1, max_tokens=8, stream=True):
        if chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
    assert tokens == whole.choices[0].logprobs.tokens


def test_sampled_logprobs_are_the_model_distributions(client, server):
    out = _completion(client, server, logprobs=5, temperature=1.0, seed=3, max_tokens=6)
    for top in out.choices[0].logprobs.top_logprobs:
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-5


def test_echo_puts_the_prompt_before_the_completion(client, server):
    plain = _completion(client, server)
    echoed = _completion(client, server, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in _completion(client, server, echo=True,
                                                              stream=True))
    assert streamed == echoed.choices[0].text


def test_echo_with_logprobs_needs_the_dynamic_batcher(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        _completion(client, server, echo=True, logprobs=1)
    assert info.value.code == "unsupported_echo_logprobs"
    assert "--batching dynamic" in info.value.message


@pytest.fixture(scope="module")
def dynamic(server_factory):
    s = server_factory(["--batching", "dynamic"])
    return s, openai.OpenAI(base_url=s.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def test_echo_with_logprobs_scores_the_prompt(dynamic):
    server, client = dynamic
    prompt = [5, 6, 7, 8, 9]
    first = client.completions.create(model=server.model, prompt=prompt, max_tokens=1,
                                      temperature=0, logprobs=2,
                                      extra_body={"return_token_ids": True})
    [token] = first.choices[0].model_extra["token_ids"]
    generated_logprob = first.choices[0].logprobs.token_logprobs[0]
    # the prompt with that token appended, echoed and scored (as evaluation harnesses do)
    scored = client.completions.create(model=server.model, prompt=prompt + [token], max_tokens=1,
                                       temperature=0, logprobs=2, echo=True)
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 2  # the echoed prompt and one new token
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    # keyed by token text, as OpenAI's shape is: two tokens of one text (say U+FFFD) make one key
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    # the appended token's score is the probability the model gave it when generating it
    assert math.isclose(lp.token_logprobs[len(prompt)], generated_logprob, abs_tol=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    if "\ufffd" not in scored.choices[0].text:  # single bytes of a character decode to U+FFFD
        assert "".join(lp.tokens) == scored.choices[0].text
    chunks = list(client.completions.create(model=server.model, prompt=prompt + [token],
                                            max_tokens=1, temperature=0, logprobs=2, echo=True,
                                            stream=True))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_a_response_format_without_a_type_and_messages_without_content_name_the_field(
        client, server):
    """Both were refused or served naming no precise field (audit, 2026-12-07): a
    response_format of {} was served; empty messages named only 'messages'."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, max_tokens=2, response_format={},
                                       messages=[{"role": "user", "content": "hi"}])
    assert info.value.param == "response_format.type" and "'text'" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, max_tokens=2,
                                       messages=[{"role": "user", "content": ""}])
    assert info.value.param == "messages.0.content" and "no content" in info.value.message


def test_json_response_format_is_refused_in_openai_shape(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, max_tokens=4,
                                       response_format={"type": "json_object"},
                                       messages=[{"role": "user", "content": "JSON please"}])
    assert info.value.param == "response_format"
    assert info.value.code == "unsupported_response_format"
    assert "'json_object'" in info.value.message and "'text'" in info.value.message
    out = client.chat.completions.create(model=server.model, max_tokens=2,
                                         response_format={"type": "text"},
                                         messages=[{"role": "user", "content": "text is fine"}])
    assert out.choices[0].message.role == "assistant"


def test_frequency_penalty_discourages_repeated_tokens(client, server):
    kwargs = dict(max_tokens=40, extra_body={"return_token_ids": True}, prompt="Hello")
    plain = _completion(client, server, **kwargs).choices[0].model_extra["token_ids"]
    assert len(set(plain)) < len(plain), "the greedy text repeats tokens"
    penalized = _completion(client, server, frequency_penalty=2.0,
                            **kwargs).choices[0].model_extra["token_ids"]
    assert len(set(penalized)) > len(set(plain))
    present = _completion(client, server, presence_penalty=2.0,
                          **kwargs).choices[0].model_extra["token_ids"]
    assert present != plain


def test_top_logprobs_without_logprobs_is_a_400(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, max_tokens=2, top_logprobs=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert info.value.param == "top_logprobs"


def test_too_many_logprobs_is_a_400(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        _completion(client, server, logprobs=50)
    assert info.value.param == "logprobs"


def test_x_request_id_is_echoed_or_made(client, server, api_key):
    raw = client.completions.with_raw_response.create(
        model=server.model, prompt="hi", max_tokens=2, extra_headers={"x-request-id": "abc-123"})
    assert raw.headers["x-request-id"] == "abc-123"
    assert server.lines_with("request_id=abc-123")
    made = httpx.get(server.root + "/health").headers["x-request-id"]
    assert len(made) == 32
    refused = httpx.get(server.root + "/v1/models", headers={"x-request-id": "mine"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "mine"


def test_a_newline_in_the_path_cannot_forge_an_access_line(server, api_key):
    """uvicorn decodes '%0A' in the path to a newline; the access line re-encodes it, so the
    request has one line and no line of the client's making appears in the log."""
    import socket
    import uuid

    rid = f"forge-{uuid.uuid4().hex}"
    forged = f"FORGED-{uuid.uuid4().hex}"
    host, port = server.root.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"GET /health%0A{forged}%20GET%20/x%20200 HTTP/1.1\r\nHost: x\r\n"
                  f"x-request-id: {rid}\r\nConnection: close\r\n\r\n".encode())
        while s.recv(65536):
            pass
    (line,) = server.lines_with(f"request_id={rid}")
    assert f"GET /health%0A{forged}%20GET%20/x%20200 401 " in line, line  # no key sent
    assert not [x for x in server.lines if x.startswith(forged)]


def test_a_stream_sends_a_chunk_per_token_while_its_text_is_held_back(client, server):
    """The detokenizer holds back text that may begin a stop string (and incomplete UTF-8);
    the stream still sends a chunk for every token, its text empty until released, so the
    first chunk is the first token (a client's time to first token) and token-level fields
    arrive in time. Until 2026-12-07 no chunk was sent until text was released: on an H100 the
    openai client's TTFT read ~150 ms where the engine's first token took ~14 ms."""
    whole = _completion(client, server, max_tokens=10)
    text = whole.choices[0].text
    assert len(text) >= 2 and whole.usage.completion_tokens == 10
    # a stop string the whole text is a prefix of, never completed: held back to the end
    stream = _completion(client, server, max_tokens=10, stream=True, stop=[text + "\u2603"],
                         extra_body={"return_token_ids": True},
                         stream_options={"include_usage": True})
    chunks = [c for c in stream if c.choices]
    texts = [c.choices[0].text for c in chunks]
    ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert "".join(texts) == text
    assert len(ids) == 10 and len(chunks) >= 5, texts  # token by token, not one final chunk
    assert texts[0] == "" and all(t == "" for t in texts[:-1]), texts
