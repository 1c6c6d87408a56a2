"""The OpenAI-compatible routes, driven by the official ``openai`` client."""

from __future__ import annotations


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert client.models.retrieve(server.model).id == server.model


def test_completion_returns_text_and_usage(client, server):
    out = client.completions.create(model=server.model, prompt="The quick brown fox",
                                    max_tokens=8, temperature=0)
    assert out.object == "text_completion"
    assert out.model == server.model
    choice = out.choices[0]
    assert isinstance(choice.text, str) and choice.text
    assert choice.finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens > 0
    assert 0 < out.usage.completion_tokens <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_max_tokens_bounds_the_completion(client, server):
    out = client.completions.create(model=server.model, prompt="one two three", max_tokens=5,
                                    temperature=0, extra_body={"return_token_ids": True})
    tokens = out.choices[0].model_extra["token_ids"]
    assert out.usage.completion_tokens == len(tokens) <= 5
    if out.choices[0].finish_reason == "length":
        assert len(tokens) == 5


def test_chat_completion_returns_an_assistant_message(client, server):
    out = client.chat.completions.create(
        model=server.model, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hello, how are you?"}])
    assert out.object == "chat.completion"
    msg = out.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert out.usage.prompt_tokens > 10  # the chat template wraps the messages
    assert out.usage.completion_tokens <= 6


def test_streamed_completion_equals_the_whole_one(client, server):
    kwargs = dict(model=server.model, prompt="Once upon a time", max_tokens=20,
                  temperature=0.9, top_p=0.95, seed=7)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_streamed_chat_starts_with_the_role_and_ends_with_usage(client, server):
    messages = [{"role": "user", "content": "Count to ten."}]
    whole = client.chat.completions.create(model=server.model, messages=messages, max_tokens=12,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_seed_makes_sampling_reproducible(client, server):
    kwargs = dict(model=server.model, prompt="Hello, world!", max_tokens=16, temperature=1.0)
    a = client.completions.create(seed=123, **kwargs).choices[0].text
    b = client.completions.create(seed=123, **kwargs).choices[0].text
    c = client.completions.create(seed=124, **kwargs).choices[0].text
    assert a == b
    assert a != c


def test_a_stop_sequence_ends_the_text_before_it(client, server):
    kwargs = dict(model=server.model, prompt="The server listens", max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = full[: full.index(stop)]
    out = client.completions.create(stop=[stop], **kwargs)
    assert out.choices[0].text == cut
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(stop=stop, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_prompt_as_token_ids(client, server):
    out = client.completions.create(model=server.model, prompt=[5, 6, 7, 8], max_tokens=3,
                                    temperature=0)
    assert out.usage.prompt_tokens == 4


def test_plan_route_reports_every_moe_layer(http):
    plan = http.get("/v1/moe/plan").json()
    assert len(plan["layers"]) == 2
    for layer in plan["layers"]:
        assert {"layer", "format", "experts", "communication"} <= set(layer)
    assert [layer["format"] for layer in plan["layers"]] == ["nvfp4_w4a4", "nvfp4_w4a4"]
    assert plan["checkpoint"]["method"] == "modelopt_mixed"
    # every turned-down backend comes with a reason from the closed set
    for r in plan["rejections"]:
        assert r["reason"] and r["message"] and r["backend"] not in {
            lp["experts"] for lp in plan["layers"]}


def test_health_answers_ok(http):
    assert http.get("/health").json() == {"status": "ok"}


def test_one_log_line_per_request(client, server):
    out = client.completions.create(model=server.model, prompt="log me", max_tokens=2,
                                    temperature=0)
    lines = server.lines_with(out.id)
    assert len(lines) == 1
    assert "POST /v1/completions 200" in lines[0]
    assert f"completion_tokens={out.usage.completion_tokens}" in lines[0]
