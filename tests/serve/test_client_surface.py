"""The server seen from real clients: every parameter of the installed ``openai`` client's
``completions.create`` and ``chat.completions.create`` at a value a user would send, the bodies
that well-known third-party clients send by default, and OpenAI's error shape.

A parameter is either honoured (the answer shows it) or refused with a 400 whose ``param`` is the
field and whose message names it and says what is accepted; values that mean the default are
served, and served exactly as the request without them.
"""

from __future__ import annotations

import inspect
import json

import httpx
import openai
import pytest

HELLO = [{"role": "user", "content": "Tell me a story."}]
CLIENT_ONLY = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (parameter, a value a user would send, "ok" or "refused"); "ok" rows are checked further below
COMPLETION_PARAMS = [
    ("model", None, "ok"), ("prompt", None, "ok"),
    ("best_of", 3, "refused"), ("echo", True, "ok"), ("frequency_penalty", 0.5, "ok"),
    ("logit_bias", {"5": 10}, "refused"), ("logprobs", 2, "ok"), ("max_tokens", 3, "ok"),
    ("n", 2, "ok"), ("presence_penalty", 0.5, "ok"), ("seed", 7, "ok"), ("stop", ["\n"], "ok"),
    ("stream", True, "ok"), ("stream_options", {"include_usage": True}, "ok"),
    ("suffix", " The end.", "refused"), ("temperature", 0.7, "ok"), ("top_p", 0.9, "ok"),
    ("user", "user-1", "ok"),
]
CHAT_PARAMS = [
    ("messages", None, "ok"), ("model", None, "ok"),
    ("audio", {"voice": "alloy", "format": "wav"}, "refused"),
    ("frequency_penalty", 0.5, "ok"), ("function_call", {"name": "f"}, "refused"),
    ("functions", [TOOL["function"]], "refused"), ("logit_bias", {"5": 10}, "refused"),
    ("logprobs", True, "ok"), ("max_completion_tokens", 3, "ok"), ("max_tokens", 3, "ok"),
    ("metadata", {"run": "a"}, "ok"), ("modalities", ["text", "audio"], "refused"),
    ("moderation", {"model": "omni-moderation-latest"}, "refused"), ("n", 2, "ok"),
    ("parallel_tool_calls", False, "ok"),
    ("prediction", {"type": "content", "content": "Once upon a time"}, "ok"),
    ("presence_penalty", 0.5, "ok"), ("prompt_cache_key", "story", "ok"),
    ("prompt_cache_options", {"mode": "implicit", "ttl": "30m"}, "ok"),
    ("prompt_cache_retention", "24h", "ok"), ("reasoning_effort", "low", "refused"),
    ("response_format", {"type": "json_object"}, "refused"), ("safety_identifier", "u1", "ok"),
    ("seed", 7, "ok"), ("service_tier", "flex", "ok"), ("stop", ["\n"], "ok"),
    ("store", True, "refused"), ("stream", True, "ok"),
    ("stream_options", {"include_usage": True}, "ok"), ("temperature", 0.7, "ok"),
    ("tool_choice", "required", "refused"), ("tools", [TOOL], "refused"),
    ("top_logprobs", 2, "ok"), ("top_p", 0.9, "ok"), ("user", "user-1", "ok"),
    ("verbosity", "low", "refused"), ("web_search_options", {}, "refused"),
]


def _client_params(create) -> set[str]:
    return set(inspect.signature(create).parameters) - CLIENT_ONLY


def test_every_parameter_of_the_installed_client_is_in_these_tables():
    """A newer client's new parameter fails here until it is given a row (and a behaviour)."""
    assert _client_params(openai.resources.Completions.create) == {
        p for p, _, _ in COMPLETION_PARAMS}
    assert _client_params(openai.resources.chat.Completions.create) == {
        p for p, _, _ in CHAT_PARAMS}


def _call(client, server, chat: bool, **kwargs):
    """One call of the real client; a stream is read to its end (its chunks returned)."""
    base = dict(model=server.model, max_tokens=4, temperature=0)
    if chat:
        out = client.chat.completions.create(messages=HELLO, **{**base, **kwargs})
    else:
        out = client.completions.create(prompt="Once upon a time", **{**base, **kwargs})
    return list(out) if kwargs.get("stream") else out


def _refused(field: str, call) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    err = info.value
    assert err.status_code == 400 and err.param == field, err.body
    assert field in err.message and "accepted" in err.message, err.message
    assert err.code in ("unsupported_parameter", "unsupported_response_format"), err.body


@pytest.mark.parametrize("field, value", [(p, v) for p, v, how in COMPLETION_PARAMS
                                          if how == "refused"])
def test_completions_parameter_refused_names_field_and_what_is_accepted(client, server, field,
                                                                          value):
    _refused(field, lambda: _call(client, server, False, **{field: value}))


@pytest.mark.parametrize("field, value", [(p, v) for p, v, how in CHAT_PARAMS
                                          if how == "refused"])
def test_chat_parameter_refused_names_field_and_what_is_accepted(client, server, field, value):
    _refused(field, lambda: _call(client, server, True, **{field: value}))


@pytest.mark.parametrize("chat, field, value", [
    (chat, p, v) for chat, table in ((False, COMPLETION_PARAMS), (True, CHAT_PARAMS))
    for p, v, how in table if how == "ok" and v is not None])
def test_every_served_parameter_is_served_at_a_users_value(client, server, chat, field, value):
    extra = {"stream": True} if field == "stream_options" else {}
    if field == "top_logprobs":
        extra = {"logprobs": True}
    if field == "max_completion_tokens":
        extra = {"max_tokens": None}  # _call's max_tokens would disagree (a 400)
    out = _call(client, server, chat, **{field: value}, **extra)
    assert out if isinstance(out, list) else out.choices


# no-ops here (hints for caching, routing and accounting): the greedy answer is the same
CHAT_NOOPS = {p: v for p, v, _ in CHAT_PARAMS if p in {
    "metadata", "parallel_tool_calls", "prediction", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "safety_identifier", "service_tier", "user", "seed"}}


def test_chat_no_op_parameters_change_nothing(client, server):
    plain = _call(client, server, True, max_tokens=10).choices[0].message.content
    same = _call(client, server, True, max_tokens=10, **CHAT_NOOPS).choices[0].message.content
    assert len(CHAT_NOOPS) == 10 and same == plain


def test_completions_parameters_are_honoured(client, server):
    c = lambda **kw: _call(client, server, False, **kw)  # noqa: E731
    out = c(max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    assert [x.index for x in c(n=2).choices] == [0, 1]
    assert c(echo=True).choices[0].text.startswith("Once upon a time")
    lp = c(logprobs=2).choices[0].logprobs
    assert lp is not None and all(len(top) == 2 for top in lp.top_logprobs)
    sampled = [c(seed=7, temperature=0.7, top_p=0.9, max_tokens=8).choices[0].text
               for _ in range(2)]
    assert sampled[0] == sampled[1]  # a seed makes sampling repeatable
    chunks = c(stream=True, stream_options={"include_usage": True})
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    # the penalties and the user are served (their effects are tested in test_request_features)
    for kw in ({"frequency_penalty": 0.5}, {"presence_penalty": 0.5}, {"user": "user-1"},
               {"stop": ["\n"]}):
        assert c(**kw).choices[0].finish_reason in ("stop", "length")


def test_chat_parameters_are_honoured(client, server):
    c = lambda **kw: _call(client, server, True, **kw)  # noqa: E731
    for name in ("max_tokens", "max_completion_tokens"):
        out = c(**{"max_tokens": None, name: 3}, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3, name
    assert [x.index for x in c(n=2).choices] == [0, 1]
    entries = c(logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert entries and all(len(e.top_logprobs) == 2 for e in entries)
    assert c(logprobs=True).choices[0].logprobs.content[0].top_logprobs == []
    sampled = [c(seed=7, temperature=0.7, top_p=0.9, max_tokens=8).choices[0].message.content
               for _ in range(2)]
    assert sampled[0] == sampled[1]
    chunks = c(stream=True, stream_options={"include_usage": True})
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    for kw in ({"frequency_penalty": 0.5}, {"presence_penalty": 0.5}, {"stop": ["\n"]}):
        assert c(**kw).choices[0].finish_reason in ("stop", "length")


# values that mean what their absence means: served, and the answer is the same (greedy)
COMPLETION_DEFAULTS = dict(n=1, stream=False, logprobs=None, echo=False, best_of=1, suffix="",
                           logit_bias={}, stop=[], user="someone", seed=3, stream_options=None,
                           frequency_penalty=0, presence_penalty=0, top_p=1)
CHAT_DEFAULTS = dict(n=1, stream=False, logprobs=False, top_logprobs=0, tool_choice="none",
                     tools=[], functions=[], function_call="none", parallel_tool_calls=True,
                     response_format={"type": "text"}, stop=[], user="someone", seed=3,
                     logit_bias={}, modalities=["text"], store=False, verbosity="medium",
                     metadata={}, service_tier="auto", audio=None, reasoning_effort=None,
                     web_search_options=None, moderation=None, prediction=None,
                     prompt_cache_key="k", prompt_cache_options={}, safety_identifier="s",
                     frequency_penalty=0, presence_penalty=0, top_p=1)


def test_values_meaning_the_default_change_nothing(client, server):
    base = dict(model=server.model, temperature=0, max_tokens=12)
    plain = client.completions.create(prompt="Once upon a time", **base).choices[0].text
    same = client.completions.create(prompt="Once upon a time", **base, **COMPLETION_DEFAULTS)
    assert same.choices[0].text == plain
    chat = dict(base, max_tokens=None, max_completion_tokens=12)
    plain = client.chat.completions.create(messages=HELLO, **chat).choices[0].message.content
    same = client.chat.completions.create(messages=HELLO, **chat, **CHAT_DEFAULTS)
    assert same.choices[0].message.content == plain
    # both token bounds, when equal; different, they are a 400 naming the newer one
    both = client.chat.completions.create(messages=HELLO, **dict(chat, max_tokens=12))
    assert both.choices[0].message.content == plain
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(messages=HELLO, **dict(chat, max_tokens=5))
    assert info.value.param == "max_completion_tokens" and "disagree" in info.value.message


# --------------------------------------------------------------------- third-party clients

def _post(http, path: str, body: dict) -> list[dict] | dict:
    """POST a literal body; a stream must end with [DONE] (its data chunks are returned)."""
    if not body.get("stream"):
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read().decode()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _third_party_bodies(model: str) -> list[tuple[str, str, dict]]:
    text = "Write a short story about a robot."
    return [
        # vLLM `vllm bench serve`, vllm/benchmarks/lib/endpoint_request_func.py,
        # async_request_openai_completions (ignore_eos from its --ignore-eos)
        ("vllm bench completions", "/v1/completions",
         {"model": model, "prompt": text, "repetition_penalty": 1.0, "max_tokens": 8,
          "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
          "ignore_eos": True}),
        # the same file, async_request_openai_chat_completions: content as a list of parts
        ("vllm bench chat", "/v1/chat/completions",
         {"model": model, "messages": [{"role": "user",
                                        "content": [{"type": "text", "text": text}]}],
          "max_completion_tokens": 8, "stream": True,
          "stream_options": {"include_usage": True}, "ignore_eos": True}),
        # vLLM's older benchmarks/backend_request_func.py (v0.6), completions
        ("vllm benchmark_serving v0.6", "/v1/completions",
         {"model": model, "prompt": text, "temperature": 0.0, "best_of": 1, "max_tokens": 8,
          "logprobs": None, "stream": True, "ignore_eos": False}),
        # SGLang python/sglang/bench_serving.py, async_request_openai_completions
        # (--backend vllm / sglang-oai; ignore_eos unless --disable-ignore-eos)
        ("sglang bench_serving completions", "/v1/completions",
         {"model": model, "prompt": text, "temperature": 0.0, "best_of": 1, "max_tokens": 8,
          "stream": True, "ignore_eos": True}),
        # the same file, async_request_openai_chat_completions (--disable-stream: stream false)
        ("sglang bench_serving chat", "/v1/chat/completions",
         {"model": model, "messages": [{"role": "user", "content": text}],
          "temperature": 0.0, "max_tokens": 8, "stream": False}),
        # LangChain ChatOpenAI (libs/partners/openai/langchain_openai/chat_models/base.py,
        # _default_params and _convert_message_to_dict): model and stream always, then every
        # field set; langchain-openai 0.1-0.2 also sent n=1 and temperature 0.7 by default
        ("langchain ChatOpenAI", "/v1/chat/completions",
         {"model": model, "stream": False, "n": 1, "temperature": 0.7,
          "messages": [{"content": "You are helpful.", "role": "system"},
                       {"content": text, "role": "user"},
                       {"content": "Once", "role": "assistant"},
                       {"content": "Go on.", "role": "user", "name": "me"}]}),
        # ChatOpenAI(stream_usage=True).stream(...): _stream sets stream and stream_options
        ("langchain ChatOpenAI stream", "/v1/chat/completions",
         {"model": model, "stream": True, "stream_options": {"include_usage": True},
          "messages": [{"content": text, "role": "user"}]}),
        # lm-evaluation-harness local-completions (lm_eval/models/openai_completions.py,
        # LocalCompletionsAPI._create_payload, generate): token-id prompts (tokenized_requests),
        # the task's stops and the EOS text untrimmed, seed 1234
        ("lm-eval local-completions", "/v1/completions",
         {"prompt": [[72, 101, 108, 108, 111]], "model": model, "max_tokens": 8,
          "temperature": 0, "stop": ["\n\n", "Question:", "Q:", "</s>", "<|im_end|>",
                                     "<|endoftext|>"], "seed": 1234}),
        # LiteLLM hosted_vllm/ provider (docs/my-website/docs/providers/vllm.md): only the
        # parameters given to litellm.completion
        ("litellm hosted_vllm", "/v1/chat/completions",
         {"model": model, "messages": [{"role": "user", "content": text}],
          "temperature": 0.2, "max_tokens": 8}),
    ]


@pytest.mark.parametrize("name", [n for n, _, _ in _third_party_bodies("m")])
def test_a_third_party_clients_default_body_is_served(http, server, name):
    _, path, body = next(b for b in _third_party_bodies(server.model) if b[0] == name)
    out = _post(http, path, body)
    if isinstance(out, list):  # a stream: tokens came, and the usage when asked for
        assert any(c["choices"] for c in out)
        if (body.get("stream_options") or {}).get("include_usage"):
            tokens = out[-1]["usage"]["completion_tokens"]
            bound = body.get("max_tokens") or body.get("max_completion_tokens") or 1 << 20
            assert tokens == bound if body.get("ignore_eos") else 1 <= tokens <= bound
    else:
        assert out["choices"][0]["finish_reason"] in ("stop", "length")


def test_content_parts_a_text_server_cannot_read_are_named(http, server):
    def chat(content, role="user"):
        messages = [{"role": "user", "content": "hi"}, {"role": role, "content": content}]
        if role == "assistant":
            messages.append({"role": "user", "content": "again"})
        return http.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 2,
                                                        "messages": messages})
    image = [{"type": "text", "text": "What is this?"},
             {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]
    err = chat(image).json()["error"]
    assert err["param"] == "messages.1.content"
    assert "part 1 is of type 'image_url'" in err["message"] and "accepted" in err["message"]
    err = chat([{"type": "text"}]).json()["error"]
    assert "needs a string 'text'" in err["message"]
    # an assistant's refusal sent back is its text; a user's "refusal" part is not a thing
    assert chat([{"type": "refusal", "refusal": "I cannot."}], "assistant").status_code == 200
    assert chat([{"type": "refusal", "refusal": "x"}]).status_code == 400


# --------------------------------------------------------------------- error shape

def test_errors_have_openais_shape_with_param_the_field(http, server, api_key):
    model = server.model
    cases = [  # (request, status, param)
        (("POST", "/v1/completions", {"model": model, "prompt": "hi", "temprature": 1}), 400,
         "temprature"),
        (("POST", "/v1/completions", {"model": model, "prompt": "hi", "suffix": "x"}), 400,
         "suffix"),
        (("POST", "/v1/chat/completions", {"model": model, "messages": HELLO,
                                           "temperature": "hot"}), 400, "temperature"),
        (("POST", "/v1/chat/completions", {"model": model}), 400, "messages"),
        (("POST", "/v1/chat/completions", {"model": model, "messages": HELLO,
                                           "stream_options": {"include_usage": True}}), 400,
         "stream_options"),
        (("POST", "/v1/chat/completions", {"model": model, "messages": HELLO,
                                           "max_completion_tokens": 10**6}), 400,
         "max_completion_tokens"),  # the field sent, not its older name
        (("POST", "/v1/completions", {"model": model, "prompt": ["a", [1, 2]]}), 400, "prompt"),
        (("POST", "/v1/completions", {"model": "gpt-4o", "prompt": "hi"}), 404, "model"),
        (("GET", "/v1/completions", None), 405, None),
        (("GET", "/v1/nothing-here", None), 404, None),
    ]
    for (method, path, body), status, param in cases:
        r = http.request(method, path, json=body)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param and err["message"], r.text
        assert err["type"] == "invalid_request_error"
        if param == "prompt":
            assert "a list of token-id lists" in err["message"], err
    r = httpx.post(f"{server.root}/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 401
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
