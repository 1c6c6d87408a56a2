"""``moe-runtime serve``'s options under ``vllm serve``'s names, each on a real server: a positional
model, ``--served-model-name``, ``--chat-template`` and ``chat_template_kwargs``, generation_config
defaults, ``--max-num-seqs``, ``--max-model-len``, the KV-cache budget, ``--dtype half``, CORS,
``--max-request-bytes``, cached hub ids with ``--tokenizer``, and ``--seed``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import openai
import pytest

from tests.serve.conftest import API_KEY, ServerProcess

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# ChatML, plus a line that Qwen3-style templates add when thinking is switched off
TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<|im_start|>no thinking here, please\\n' }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def house_model(model_dir, tmp_path_factory):
    """The default model, whose generation_config.json asks for greedy and 5 new tokens."""
    folder = tmp_path_factory.mktemp("models") / "house"
    shutil.copytree(model_dir, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen.update(temperature=0.0, max_new_tokens=5)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder


@pytest.fixture(scope="module")
def house(server_factory, house_model):
    return server_factory([str(house_model), "--served-model-name", "house-model",
                           "--max-num-seqs", "2", "--max-model-len", "200",
                           "--chat-template", TEMPLATE, "--kv-cache-tokens", "300",
                           "--max-request-bytes", "4096", "--dtype", "half",
                           "--allowed-origins", "http://example.org", "--shutdown-timeout", "2"])


@pytest.fixture(scope="module")
def house_client(house):
    return openai.OpenAI(base_url=house.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def test_a_positional_model_is_served_under_its_served_model_name(house, house_client):
    assert house.model == "house-model"
    [card] = house_client.models.list().data
    assert card.id == "house-model"
    assert card.model_extra["max_model_len"] == 200  # --max-model-len


def test_a_max_model_len_past_the_models_context_is_capped_with_a_warning(server_factory,
                                                                         model_dir):
    # it was capped without a word
    s = server_factory([str(model_dir), "--max-model-len", "5000"])
    [line] = s.lines_with("--max-model-len 5000 is past the model's context of 1024 tokens")
    assert "WARNING" in line and "requests get at most 1024" in line
    models = httpx.get(s.base_url + "/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert models.json()["data"][0]["max_model_len"] == 1024
    s.stop()


def test_dtype_half_is_float16(house):
    plan = httpx.get(house.root + "/v1/moe/plan", headers={"Authorization": f"Bearer {API_KEY}"})
    assert plan.json()["dtype"] == "float16"


def test_the_kv_cache_is_sized_by_kv_cache_tokens(house):
    [line] = house.lines_with("KV cache: ")
    assert "KV cache: 300 tokens" in line and "--kv-cache-tokens" in line
    assert "room for 1 sequence(s) of the full 200-token context" in line


def test_generation_config_defaults_fill_what_a_request_omits(house, house_client):
    assert house.lines_with("sampling defaults from generation_config.json")
    kwargs = dict(model="house-model", prompt="Once upon a time")
    a = house_client.completions.create(**kwargs)
    b = house_client.completions.create(**kwargs)
    greedy = house_client.completions.create(temperature=0, max_tokens=5, **kwargs)
    assert a.choices[0].text == b.choices[0].text == greedy.choices[0].text  # temperature 0
    assert a.usage.completion_tokens <= 5  # max_new_tokens 5
    longer = house_client.completions.create(temperature=0, max_tokens=9, **kwargs)
    assert longer.usage.completion_tokens > 5 or longer.choices[0].finish_reason == "stop"


def test_chat_template_kwargs_reach_the_chat_template(house_client):
    messages = [{"role": "user", "content": "Hello"}]
    plain = house_client.chat.completions.create(model="house-model", messages=messages,
                                                 max_tokens=1)
    off = house_client.chat.completions.create(
        model="house-model", messages=messages, max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = house_client.chat.completions.create(
        model="house-model", messages=messages, max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert off.usage.prompt_tokens > plain.usage.prompt_tokens == on.usage.prompt_tokens


def test_chat_template_kwargs_may_not_replace_the_call_arguments(house_client):
    with pytest.raises(openai.BadRequestError) as info:
        house_client.chat.completions.create(
            model="house-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
            extra_body={"chat_template_kwargs": {"tokenize": False}})
    assert info.value.param == "chat_template_kwargs" and "'tokenize'" in info.value.message


@pytest.mark.parametrize("key, value, said", [
    # apply_chat_template passes it to the tokenizer: its overflowing-token lists once reached
    # the batching thread and stopped it for every request (audit, 2026-12-07)
    ("tokenizer_kwargs", {"return_overflowing_tokens": True}, "argument of the template call"),
    ("return_assistant_tokens_mask", True, "argument of the template call"),
])
def test_chat_template_kwargs_may_not_set_tokenizer_arguments(house_client, key, value, said):
    with pytest.raises(openai.BadRequestError) as info:
        house_client.chat.completions.create(
            model="house-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
            extra_body={"chat_template_kwargs": {key: value}})
    assert info.value.param == "chat_template_kwargs"
    assert f"{key!r}" in info.value.message and said in info.value.message
    # and the server serves on
    ok = house_client.chat.completions.create(
        model="house-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_chat_template_kwargs_may_set_the_generation_prompt_as_in_vllm(house_client):
    """vLLM merges chat_template_kwargs over the request's add_generation_prompt (clients send
    {"add_generation_prompt": true, "enable_thinking": ...} there); a conflict with
    continue_final_message is judged on the merged values."""
    messages = [{"role": "user", "content": "Hi"}]
    plain = house_client.chat.completions.create(model="house-model", messages=messages,
                                                 max_tokens=1)
    same = house_client.chat.completions.create(
        model="house-model", messages=messages, max_tokens=1,
        extra_body={"chat_template_kwargs": {"add_generation_prompt": True}})
    without = house_client.chat.completions.create(
        model="house-model", messages=messages, max_tokens=1,
        extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert same.usage.prompt_tokens == plain.usage.prompt_tokens > without.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        house_client.chat.completions.create(
            model="house-model", max_tokens=1,
            messages=[*messages, {"role": "assistant", "content": "Hel"}],
            extra_body={"chat_template_kwargs": {"continue_final_message": True}})
    assert info.value.param == "continue_final_message"


def test_max_request_bytes_caps_the_body(house):
    body = {"model": "house-model", "prompt": "x" * 5000, "max_tokens": 1}
    r = httpx.post(house.root + "/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 413
    assert "4096 bytes" in r.json()["error"]["message"]


def test_cors_answers_the_allowed_origin_only(house):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(house.root + "/v1/completions",
                       headers={"Origin": "http://example.org", **preflight})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://example.org"
    other = httpx.options(house.root + "/v1/completions",
                          headers={"Origin": "http://elsewhere.example", **preflight})
    assert other.headers.get("access-control-allow-origin") != "http://elsewhere.example"
    get = httpx.get(house.root + "/health", headers={"Origin": "http://example.org"})
    assert get.headers["access-control-allow-origin"] == "http://example.org"


def test_a_preflight_has_a_request_id_and_an_access_line_and_a_refused_one_is_openai_shaped(
        house):
    """The CORS middleware answered preflights outside the one that logs: no x-request-id, no
    access line, and a refusal in plain text ('Disallowed CORS origin')."""
    preflight = {"Access-Control-Request-Method": "POST"}
    for origin, status in (("http://example.org", 200), ("http://elsewhere.example", 400)):
        rid = f"preflight-{status}-{os.getpid()}"
        r = httpx.options(house.root + "/v1/completions",
                          headers={"Origin": origin, "x-request-id": rid, **preflight})
        assert r.status_code == status, r.text
        assert r.headers["x-request-id"] == rid
        (line,) = house.lines_with(f"request_id={rid}")
        assert f" OPTIONS /v1/completions {status} " in line, line
    err = r.json()["error"]
    assert err["code"] == "cors_preflight_refused" and "origin" in err["message"], err
    assert "--allowed-origins" in err["message"]


def test_no_cors_headers_without_allowed_origins(server):
    r = httpx.get(server.root + "/health", headers={"Origin": "http://example.org"})
    assert "access-control-allow-origin" not in r.headers


# ------------------------------------------------------------------------------ hub ids, --seed


def _fake_hub(root, repo: str, source, files=None):
    """``source``'s files as the Hugging Face cache holds a downloaded snapshot of ``repo``."""
    entry = root / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        if files is None or f.name in files:
            shutil.copy(f, snapshot / f.name)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    return snapshot


def _env(cache_home, hub):
    return dict(os.environ, XDG_CACHE_HOME=str(cache_home), PYTHONUNBUFFERED="1",
                HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub), TOKENIZERS_PARALLELISM="false")


def _texts(base_url: str, model: str) -> list[str]:
    c = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=120)
    return [c.completions.create(model=model, prompt=p, max_tokens=12, temperature=1.0)
            .choices[0].text for p in ("Hello", "Hello", "The fox")]


def test_a_cached_hub_id_with_a_cached_tokenizer_and_a_seed(model_dir, cache_home, tmp_path):
    hub = tmp_path / "hub"
    weights = _fake_hub(hub, "acme/tiny-moe", model_dir)
    for name in TOKENIZER_FILES:  # the model's snapshot has no tokenizer: --tokenizer gives it
        (weights / name).unlink()
    _fake_hub(hub, "acme/tiny-tokenizer", model_dir, files=TOKENIZER_FILES)
    common = ["--port", "0", "--dtype", "float32", "--api-key", API_KEY, "--seed", "7"]
    servers = [
        ServerProcess(["acme/tiny-moe", "--tokenizer", "acme/tiny-tokenizer",
                       "--gpu-memory-utilization", "0.5", *common], _env(cache_home, hub)),
        ServerProcess([str(model_dir), *common], _env(cache_home, hub)),
    ]
    try:
        for s in servers:
            s.wait_ready()
        hub_server, local = servers
        assert hub_server.model == "acme/tiny-moe"  # the hub id is the served name
        [line] = hub_server.lines_with("KV cache: ")
        assert "--gpu-memory-utilization 0.5 of this machine's physical memory" in line
        assert "cut to the --max-num-seqs 8 sequences of 1024 tokens" in line
        seeded = [_texts(s.base_url, s.model) for s in servers]
        # the same seed: the same unseeded requests in the same order get the same text
        assert seeded[0] == seeded[1]
        assert seeded[0][0] != seeded[0][1]  # each request draws a seed of its own
    finally:
        for s in servers:
            s.stop()


def _serve(*argv, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "moe_runtime.serve", "--port", "0", *argv],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_a_hub_id_not_in_the_cache_is_an_error_naming_it(cache_home, tmp_path):
    r = _serve("acme/absent-model", env=_env(cache_home, tmp_path), timeout=30)
    assert r.returncode == 1
    assert "'acme/absent-model' is not in the local cache" in r.stderr
    assert "never downloads" in r.stderr and "Traceback" not in r.stderr


def test_two_different_models_are_refused(tmp_path):
    r = _serve(str(tmp_path), "--model", "/elsewhere", timeout=30)
    assert r.returncode == 2 and "two models given" in r.stderr


@pytest.mark.parametrize("argv, needle", [
    (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must lie in (0, 1]"),
    (["--kv-cache-tokens", "0"], "--kv-cache-tokens must be at least 1"),
    (["--gpu-memory-utilization", "0.5", "--kv-cache-tokens", "9"], "not both"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be at least 1"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must not be negative"),
    (["--seed", str(2**64)], "--seed must be a signed 64-bit integer"),  # was a traceback
    (["--seed", str(2**63)], "--seed must be a signed 64-bit integer"),
    # were an OverflowError's text and exit 1, after the plugins loaded
    (["--port", "70000"], "--port must lie in [0, 65535]"),
    (["--port", "-1"], "--port must lie in [0, 65535]"),
    # were a ValueError after about 4 s of start-up, exit 1
    (["--device", "tpu"], "--device: device 'tpu' is not supported; use cpu, cuda or cuda:N"),
    (["--device", "cuda:x"], "--device: device 'cuda:x' is not supported"),
    # served with no authentication at all (an unset variable in --api-key "$KEY")
    (["--api-key", ""], "--api-key is empty"),
    (["--api-key", "  "], "--api-key is empty"),
    # was ignored: the folder's name was served
    (["--served-model-name", ""], "--served-model-name is empty"),
])
def test_a_bad_number_is_exit_status_2_naming_the_option(argv, needle):
    r = _serve(*argv, timeout=30)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr


def test_an_empty_api_key_from_the_environment_is_refused_naming_the_variable(tmp_path):
    from moe_runtime.serve.command import ENV_API_KEY

    r = _serve(timeout=30, env={**os.environ, ENV_API_KEY: ""})
    assert r.returncode == 2, r.stderr
    assert f"${ENV_API_KEY} is empty" in r.stderr


def test_a_chat_template_that_is_no_file_and_no_template_is_refused():
    r = _serve("--chat-template", "./no/such/template.jinja", timeout=30)
    assert r.returncode == 1
    assert "'./no/such/template.jinja' is neither a file nor a Jinja template" in r.stderr


def test_a_chat_template_file_is_read(house_model, tmp_path, server_factory):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE.replace("no thinking here", "NO THINKING, FROM A FILE"))
    s = server_factory([str(house_model), "--chat-template", str(template)])
    c = openai.OpenAI(base_url=s.base_url, api_key=API_KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Hello"}]
    plain = c.chat.completions.create(model=s.model, messages=messages, max_tokens=1)
    off = c.chat.completions.create(model=s.model, messages=messages, max_tokens=1,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > plain.usage.prompt_tokens
    s.stop()


@pytest.mark.parametrize("argv, needle", [
    (["--kv-cache-tokens", "100"], "cannot hold one sequence of the full context, 1024 tokens"),
    (["--gpu-memory-utilization", "0.000001"], "raise --gpu-memory-utilization"),
])
def test_a_kv_cache_too_small_for_one_context_is_refused_at_start(model_dir, argv, needle):
    r = _serve(str(model_dir), *argv)
    assert r.returncode == 1, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("argv, sized", [
    (["--max-num-seqs", "100000000"], "at batch 100000000 x 1024 tokens"),
    # --kv-cache-tokens is cut to --max-num-seqs sequences of the context, here as in the budget
    (["--kv-cache-tokens", "100000000000", "--max-num-seqs", "100000000"],
     "at batch 1 x 100000000000 tokens"),
    # --max-model-len past the model's context is capped by it, here as in the engine
    (["--max-num-seqs", "100000000", "--max-model-len", "999999"], "x 1024 tokens"),
])
def test_a_kv_cache_larger_than_memory_is_refused_before_loading(model_dir, argv, sized):
    # it loaded every weight, then stopped inside transformers on a bare MemoryError
    r = _serve(str(model_dir), *argv)
    assert r.returncode == 1, r.stderr
    assert "serving needs about" in r.stderr and sized in r.stderr, r.stderr
    assert "KV cache" in r.stderr and "Traceback" not in r.stderr
    assert "Loading" not in r.stderr  # refused by the estimate, before the weights were read


def test_a_kv_cache_tokens_the_budget_cuts_is_not_refused(server_factory, model_dir):
    s = server_factory([str(model_dir), "--kv-cache-tokens", "100000000000"])
    [line] = s.lines_with("KV cache: ")
    assert "8192 tokens" in line and "cut to the --max-num-seqs 8 sequences" in line, line
    s.stop()


def test_the_dynamic_cache_grows_with_its_requests_and_is_not_refused(server_factory, model_dir):
    # allocated as requests come (the path of every model the paged cache cannot hold): the
    # budget only bounds admission, so the options' cache need not fit at start
    s = server_factory([str(model_dir), "--batching", "dynamic", "--max-num-seqs", "100000"])
    assert s.lines_with("dynamic-cache batching")
    r = httpx.post(s.base_url + "/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": s.model, "prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    s.stop()


def test_the_cache_sized_from_the_options_must_fit_the_free_memory(model_dir):
    # the same refusal once loaded (the estimate can be short of what the process holds)
    from transformers import AutoConfig

    from moe_runtime.serve.kv_budget import BudgetError, kv_budget

    config = AutoConfig.from_pretrained(model_dir)
    fits = kv_budget(config=config, dtype_bytes=4, device="cpu", context_length=1024,
                     max_num_seqs=8)
    assert fits.tokens == 8 * 1024
    with pytest.raises(BudgetError, match=r"needs .* GiB, and this machine has .* GiB free once "
                                          r"the model is loaded: lower --max-num-seqs"):
        kv_budget(config=config, dtype_bytes=4, device="cpu", context_length=1024,
                  max_num_seqs=10**9)
    with pytest.raises(BudgetError, match="free once the model is loaded"):
        kv_budget(config=config, dtype_bytes=4, device="cpu", context_length=1024,
                  max_num_seqs=10**10, kv_cache_tokens=10**13)
    # a cache that grows with its requests only bounds admission
    grows = kv_budget(config=config, dtype_bytes=4, device="cpu", context_length=1024,
                      max_num_seqs=10**9, allocated_up_front=False)
    assert grows.tokens == 10**9 * 1024


def test_help_names_the_vllm_options_and_their_aliases():
    r = subprocess.run([sys.executable, "-m", "moe_runtime.cli", "serve", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for option in ("MODEL", "--served-model-name", "--tokenizer", "--chat-template",
                   "--max-num-seqs N, --max-batch-size N", "--max-model-len",
                   "--gpu-memory-utilization", "--kv-cache-tokens", "--seed",
                   "--generation-config", "--allowed-origins", "--allowed-methods",
                   "--allowed-headers", "--allow-credentials", "--max-request-bytes",
                   "--shutdown-timeout", "half"):
        assert option in r.stdout, option


def test_generation_defaults_are_only_what_the_file_sets(tmp_path):
    from moe_runtime.serve.loading import generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
        "max_new_tokens": 64, "repetition_penalty": 1.1, "eos_token_id": [1, 2]}))
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64,
                        "repetition_penalty": 1.1}
    assert generation_defaults(tmp_path / "nothing-here") == {}


@pytest.mark.parametrize("fields, named", [
    ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_p": 0}, "top_p"), ({"max_new_tokens": 0}, "max_new_tokens")])
def test_unusable_generation_defaults_are_refused_at_start(tmp_path, fields, named):
    from moe_runtime.serve.loading import LoadError, generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    with pytest.raises(LoadError, match=named) as err:
        generation_defaults(tmp_path)
    assert "generation_config.json" in str(err.value) and "--generation-config vllm" in str(err.value)


@pytest.mark.parametrize("value, expected", [("vllm", None), ("none", None), ("auto", "auto")])
def test_generation_config_vllm_turns_the_defaults_off(value, expected):
    import argparse

    from moe_runtime.serve.command import add_serve_arguments, resolve_serve_source

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    source = resolve_serve_source(parser.parse_args(["--generation-config", value]))
    assert source.generation_config == expected


def test_the_command_lines_plugin_options_reach_the_plan(tmp_path):
    pytest.importorskip("moe_runtime_triton")
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint
    from moe_runtime.plugin.manager import PluginOptions
    from moe_runtime.serve.loading import LoadError, load_for_serving

    ckpt = make_tiny_checkpoint(tmp_path / "m", arch="qwen3_moe", quant="bf16")
    with pytest.raises(LoadError, match="'triton' is not a registered experts backend"):
        load_for_serving(ckpt, moe_runner_backend="triton", progress=False,
                         plugin_options=PluginOptions(blocked={"triton"}))
    r = subprocess.run([sys.executable, "-m", "moe_runtime.cli", "-p", "no:triton", "serve",
                        str(ckpt), "--port", "0", "--moe-runner-backend", "triton"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "'triton' is not a registered experts backend" in r.stderr


def test_a_bad_graph_prefill_variable_is_exit_status_2_before_loading(tmp_path):
    env = {**os.environ, "MOE_RUNTIME_GRAPH_PREFILL": "yes"}
    r = _serve(str(tmp_path), env=env, timeout=30)  # tmp_path holds no model: never reached
    assert r.returncode == 2, r.stderr
    assert "MOE_RUNTIME_GRAPH_PREFILL='yes'" in r.stderr and "Traceback" not in r.stderr
