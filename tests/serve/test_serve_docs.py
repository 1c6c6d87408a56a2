"""docs/serve.md lists every option of ``moe-runtime serve``, every route, and every metric series
the server exports: the docs cannot fall behind the code."""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_runtime.serve.access_log import ROUTES as _ROUTES
from moe_runtime.serve.command import add_serve_arguments
from moe_runtime.serve.metrics import ServerMetrics
from moe_runtime.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
    known_fields,
)

DOCS = (Path(__file__).resolve().parents[2] / "docs" / "serve.md").read_text()


def test_every_option_is_documented():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    options = [o for action in parser._actions for o in action.option_strings
               if o not in ("-h", "--help")]
    assert len(options) > 25
    missing = [o for o in options if f"`{o}" not in DOCS and f", {o}`" not in DOCS
               and f"`{o} " not in DOCS]
    assert not missing


def test_every_route_is_documented():
    for route in _ROUTES:
        assert f"`{route}" in DOCS or f"{route}`" in DOCS, route


def test_every_metric_series_is_documented():
    names = {family.name for family in ServerMetrics(model_name="m").registry.collect()}
    assert len(names) > 20
    for name in names:
        shown = (name, name + "_total", name + "_info")  # how the text format writes each kind
        assert any(f"`{n}`" in DOCS or f"`{n}{{" in DOCS for n in shown), name


def test_every_request_field_is_documented():
    """Each field a route knows (implemented, a no-op, or refused unless off) is in the docs'
    Request fields: a field added to the models without a word there fails here."""
    names = (known_fields(CompletionRequest) | known_fields(ChatCompletionRequest)
             | set(StreamOptions.model_fields))
    assert len(names) > 80
    fields = DOCS[DOCS.index("### Request fields"):DOCS.index("## Metrics")]
    assert not sorted(n for n in names if f"`{n}" not in fields)
