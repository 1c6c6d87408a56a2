"""Start-up refusals of ``moe-runtime serve`` for inputs that used to pass start-up and fail later
(or fail naming the wrong thing): a ``--tokenizer`` with ids past the model's ``vocab_size``, a
config.json that is a symbolic link loop, a chat template that does not compile, and a
generation_config.json sampling default that is not a number. Each is exit status 1 with a
one-line message naming the file or field and what is accepted, and no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _serve(*argv, timeout=90):
    return subprocess.run([sys.executable, "-m", "moe_runtime.serve", "--port", "0",
                           "--device", "cpu", *argv],
                          capture_output=True, text=True, timeout=timeout)


def _error_line(r) -> str:
    """The one line that says why the start was refused (no traceback around it)."""
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-2000:]
    return errors[0]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A tiny checkpoint of 256 tokens, without tokenizer files."""
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny256", arch="qwen3_moe",
                                quant="bf16", vocab_size=256)


@pytest.fixture(scope="module")
def tiny_ckpt_512(tmp_path_factory) -> Path:
    """A tiny checkpoint of 512 tokens (the tiny tokenizer's), without tokenizer files."""
    from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny512", arch="qwen3_moe",
                                quant="bf16", vocab_size=512)


@pytest.fixture(scope="module")
def tokenizer_512(tmp_path_factory) -> Path:
    from moe_runtime.serve.tiny_tokenizer import save_tokenizer

    folder = tmp_path_factory.mktemp("tok") / "tok512"
    assert save_tokenizer(folder, model_max_length=64) == 512
    return folder


# ------------------------------------------------------------------ 1. --tokenizer too large


def test_a_tokenizer_with_ids_past_vocab_size_is_refused_naming_both_numbers(
        tiny_ckpt, tokenizer_512):
    line = _error_line(_serve(str(tiny_ckpt), "--tokenizer", str(tokenizer_512)))
    assert str(tokenizer_512) in line
    assert "512" in line and "vocab_size" in line and "256" in line
    assert "index out of range in self" not in line


def test_a_tokenizer_within_vocab_size_passes_the_size_check(tiny_ckpt_512, tokenizer_512):
    from transformers import AutoTokenizer

    from moe_runtime.serve.loading import _require_tokenizer_fits

    tok = AutoTokenizer.from_pretrained(tokenizer_512)
    _require_tokenizer_fits(tok, tokenizer_512, tiny_ckpt_512)  # 512 tokens, vocab_size 512


# ------------------------------------------------------------------ 2. config.json link loop


def test_a_config_json_that_is_a_symlink_loop_is_named_as_one(tmp_path):
    folder = tmp_path / "looped"
    folder.mkdir()
    (folder / "config.json").symlink_to("other.json")
    (folder / "other.json").symlink_to("config.json")
    line = _error_line(_serve(str(folder)))
    assert "config.json" in line and "symbolic link loop" in line
    assert "no config.json" not in line


def test_a_config_json_link_to_nothing_is_named_as_one(tmp_path):
    from moe_runtime.serve.model_source import SourceError, resolve_source

    folder = tmp_path / "dangling"
    folder.mkdir()
    (folder / "config.json").symlink_to("gone.json")
    with pytest.raises(SourceError, match=r"link to gone\.json, which does not exist"):
        resolve_source(str(folder))


# ------------------------------------------------------------------ 3. a broken chat template

BROKEN = "{% for message in messages %}\n{{ message['content'] }\n{% endfor %}"


@pytest.fixture()
def chat_ckpt(tiny_ckpt_512, tokenizer_512, tmp_path) -> Path:
    """The tiny checkpoint of 512 tokens with the 512-token tokenizer beside its weights."""
    import shutil

    folder = tmp_path / "chat"
    shutil.copytree(tiny_ckpt_512, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_512 / name, folder / name)
    return folder


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja",
                                   "--chat-template"])
def test_a_chat_template_that_does_not_compile_is_refused_at_start(chat_ckpt, tmp_path, where):
    argv = []
    if where == "tokenizer_config.json":
        config = json.loads((chat_ckpt / where).read_text())
        config["chat_template"] = BROKEN
        (chat_ckpt / where).write_text(json.dumps(config))
        named = str(chat_ckpt / where)
    elif where == "chat_template.jinja":
        (chat_ckpt / where).write_text(BROKEN)
        named = str(chat_ckpt / where)
    else:
        (tmp_path / "broken.jinja").write_text(BROKEN)
        argv = ["--chat-template", str(tmp_path / "broken.jinja")]
        named = str(tmp_path / "broken.jinja")
    line = _error_line(_serve(str(chat_ckpt), *argv))
    assert named in line and "chat template" in line
    assert "line 2" in line  # the Jinja error's line, in the template
    assert "Loading" not in line


@pytest.mark.parametrize("value", [5, True, False, 0, {"default": 7}])
def test_a_chat_template_that_is_not_a_string_is_refused_at_start(chat_ckpt, value):
    # it passed start-up, and every chat request then got a 400 "Can't compile non template
    # nodes" blaming the client's messages
    config = json.loads((chat_ckpt / "tokenizer_config.json").read_text())
    config["chat_template"] = value
    (chat_ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    line = _error_line(_serve(str(chat_ckpt)))
    assert str(chat_ckpt / "tokenizer_config.json") in line, line
    assert "not a string" in line and "every chat request would fail" in line, line
    assert "Loading" not in line


def test_a_chat_template_that_compiles_passes(chat_ckpt):
    from transformers import AutoTokenizer

    from moe_runtime.serve.loading import _require_compilable_chat_template

    tok = AutoTokenizer.from_pretrained(chat_ckpt)
    _require_compilable_chat_template(tok, chat_ckpt, None)


# ------------------------------------------------------------------ 4. non-numeric defaults


@pytest.mark.parametrize("fields, named", [
    ({"temperature": "hot"}, "temperature"), ({"top_p": True}, "top_p"),
    ({"top_k": "20"}, "top_k"), ({"max_new_tokens": [5]}, "max_new_tokens"),
    ({"min_p": {}}, "min_p"), ({"repetition_penalty": "1.1"}, "repetition_penalty")])
def test_a_non_numeric_generation_default_is_refused(tmp_path, fields, named):
    from moe_runtime.serve.loading import LoadError, generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    with pytest.raises(LoadError) as err:
        generation_defaults(tmp_path)
    message = str(err.value)
    assert str(tmp_path / "generation_config.json") in message
    assert f"{named} is {fields[named]!r}" in message and "not a number" in message
    assert "--generation-config vllm" in message


def test_a_null_generation_default_is_no_default(tmp_path):
    from moe_runtime.serve.loading import generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": None,
                                                                 "top_p": 0.9}))
    assert generation_defaults(tmp_path) == {"top_p": 0.9}


def test_a_string_temperature_stops_the_server_at_start(chat_ckpt):
    (chat_ckpt / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    line = _error_line(_serve(str(chat_ckpt)))
    assert "generation_config.json" in line and "temperature is 'hot'" in line
