"""The served families shown in docs/serve.md and ``moe-runtime serve --help`` are the table's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from moe_runtime.checkpoint.architectures import served_families, unserved_families
from moe_runtime.serve.command import served_families_text

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serve.md"


def test_the_docs_block_is_the_generated_list():
    text = DOCS.read_text()
    block = text.split("<!-- served-families:start -->\n")[1].split("<!-- served-families:end -->")[0]
    assert block == f"```\n{served_families_text()}\n```\n"


def test_the_generated_list_names_every_family_of_the_table():
    text = served_families_text()
    for family, names in served_families().items():
        assert f"  {family}: {', '.join(names)}" in text
    for family in unserved_families():
        assert family in text.split("refused at start-up: ")[1]


def test_serve_help_shows_the_served_families():
    r = subprocess.run([sys.executable, "-m", "moe_runtime.cli", "serve", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert served_families_text() in r.stdout
    assert "--batching {auto,continuous,dynamic}" in r.stdout
