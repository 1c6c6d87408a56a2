"""docs/writing-a-backend.md, followed literally: its files are the example, its commands run.

The page's blocks are read in order. A block tagged ``file=PATH`` is written to PATH under the
current folder, and must equal that file of ``examples/moe-runtime-example-backend/``. A
``console`` block's ``$ `` lines are run with bash, in a throwaway folder, with ``cd`` followed.
``python -m pip install`` installs the current folder into a ``--target`` folder on PYTHONPATH,
without network. The lines the page shows under a command must appear in its output, in order,
where ``...`` matches anything. A command fails exactly when the page shows an ``error:`` line.
Every other ``python`` block runs as it is.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from moe_runtime.testing import harness
from moe_runtime.testing.dists import pip_install_target

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "writing-a-backend.md"
EXAMPLE = ROOT / "examples" / "moe-runtime-example-backend"
BACKEND = "example_bmm"
PLUGIN = "example"
DISTRIBUTION = "moe-runtime-example-backend"

_FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
_NOT_EXAMPLE_FILES = {"__pycache__", "build", ".pytest_cache"}


@attrs.frozen
class Block:
    lang: str
    options: dict
    body: str


@attrs.frozen
class Command:
    line: str
    shown: tuple[str, ...]


@attrs.frozen
class Ran:
    command: Command
    cwd: Path
    returncode: int
    output: str


def page_blocks() -> list[Block]:
    out = []
    for m in _FENCE.finditer(PAGE.read_text()):
        lang, *opts = m.group("info").split()
        out.append(Block(lang, dict(o.split("=", 1) for o in opts if "=" in o), m.group("body")))
    return out


def commands_of(block: Block) -> list[Command]:
    commands: list[Command] = []
    for line in block.body.splitlines():
        if line.startswith("$ "):
            commands.append(Command(line[2:], ()))
        elif commands:
            commands[-1] = attrs.evolve(commands[-1], shown=commands[-1].shown + (line,))
        else:
            raise AssertionError(f"console block starts with output, not a command: {line!r}")
    return commands


def first_line_not_shown(shown: tuple[str, ...], output: str) -> str | None:
    """The first shown line missing from ``output`` (lines in order, ``...`` matches anything)."""
    actual = [line.rstrip() for line in output.splitlines()]
    i = 0
    for line in shown:
        if line.strip() == "...":
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in line.rstrip().split("...")))
        while i < len(actual) and not pattern.fullmatch(actual[i]):
            i += 1
        if i == len(actual):
            return line
        i += 1
    return None


def example_files() -> dict[str, str]:
    out = {}
    for path in sorted(EXAMPLE.rglob("*")):
        rel = path.relative_to(EXAMPLE)
        if path.is_file() and not any(p in _NOT_EXAMPLE_FILES or p.endswith(".egg-info")
                                      or p.endswith(".pyc") for p in rel.parts):
            out[rel.as_posix()] = path.read_text()
    return out


# ------------------------------------------------------------------------- the page, statically


def test_page_files_are_the_example_folder():
    shown = {b.options["file"]: b.body for b in page_blocks() if "file" in b.options}
    assert sorted(shown) == sorted(example_files()), "the page and the example folder differ"
    for path, body in example_files().items():
        assert shown[path] == body, f"{path}: the page shows something else than {EXAMPLE / path}"


def test_page_python_snippets_run():
    snippets = [b for b in page_blocks() if b.lang == "python" and "file" not in b.options]
    assert snippets
    for i, block in enumerate(snippets):
        exec(compile(block.body, f"{PAGE.name} snippet {i + 1}", "exec"), {"__name__": "snippet"})


def test_page_budget_table_states_the_suites_constants():
    text = PAGE.read_text()
    table = text[text.index("| check | bound |"):]
    table = table[:table.index("\n\n")]
    def sci(v):
        return f"{v:.1e}".replace("e-0", "e-").replace(".0e", "e")

    assert f"`{harness.BUDGET_MULTIPLE:g}` x the worst emulation" in table
    assert f"`{sci(harness.SCALE_BOUND)}` of 1" in table
    assert f"under `{sci(harness.RELIABLE_SCALE)}`" in table
    assert f"at least {harness.MIN_ELEMENTS_FOR_SCALE} elements" in table
    assert f"`{sci(harness.COLUMN_BOUND)}` plus" in table
    assert f"at least {harness.MIN_ROWS_FOR_COLUMNS} rows" in table


def test_page_refusal_example_is_generated_from_the_declaration():
    import importlib.util

    from moe_runtime.plugin.registry import Registry
    from moe_runtime.testing.cases import refusal_cases

    spec = importlib.util.spec_from_file_location(
        "doc_example_plugin", EXAMPLE / "moe_runtime_example" / "plugin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reg = Registry.load(blocked=[PLUGIN], plugins=[module], environ={})
    cases = {(c.format, c.expected, c.environment)
             for c in refusal_cases(reg, reg.experts_spec(BACKEND))}
    assert "BF16 on 7.0" in PAGE.read_text()
    assert ("bf16", "compute_capability", "cuda:7.0") in cases
    assert ("fp8_w8a8", "unsupported_format", "cpu") in cases


def test_page_names_the_example_plugin_and_backend():
    pyproject = (EXAMPLE / "pyproject.toml").read_text()
    assert f'name = "{DISTRIBUTION}"' in pyproject
    assert f'{PLUGIN} = "moe_runtime_example.plugin"' in pyproject
    assert f'moe_conformance = ["{BACKEND}"]' in pyproject


# ------------------------------------------------------------------------ the page, followed


def _environ(site: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MOE_RUNTIME_", "MOE_CONFORMANCE", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory):
    """Follow the page from an empty folder; return what every command did, and the folders."""
    home = tmp_path_factory.mktemp("reader")
    site = tmp_path_factory.mktemp("site")
    env = _environ(site)
    cwd, ran = home, []
    for block in page_blocks():
        if "file" in block.options:
            path = cwd / block.options["file"]
            assert path.parent.is_dir(), f"the page writes {path} before creating its folder"
            path.write_text(block.body)
            continue
        if block.lang != "console":
            continue
        for cmd in commands_of(block):
            if cmd.line.startswith("cd "):
                cwd = (cwd / cmd.line[3:].strip()).resolve()
                ran.append(Ran(cmd, cwd, 0, ""))
            elif cmd.line.startswith("python -m pip install"):
                assert cmd.line.split()[-1] == ".", cmd.line
                pip_install_target([cwd], site)
                ran.append(Ran(cmd, cwd, 0, ""))
            else:
                r = subprocess.run(["bash", "-c", cmd.line], cwd=cwd, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   timeout=600)
                ran.append(Ran(cmd, cwd, r.returncode, r.stdout))
    return {"ran": ran, "site": site, "env": env}


def _ran(walkthrough, prefix: str) -> Ran:
    found = [r for r in walkthrough["ran"] if r.command.line.startswith(prefix)]
    assert found, f"the page runs no command starting with {prefix!r}"
    return found[0]


@pytest.mark.slow
def test_every_command_of_the_page_does_what_the_page_shows(walkthrough):
    problems = []
    for r in walkthrough["ran"]:
        should_fail = any(line.startswith("error:") for line in r.command.shown)
        if (r.returncode != 0) != should_fail:
            problems.append(f"$ {r.command.line}\nexit status {r.returncode}, the page expects "
                            f"{'failure' if should_fail else 'success'}:\n{r.output[-3000:]}")
            continue
        missing = first_line_not_shown(r.command.shown, r.output)
        if missing is not None:
            problems.append(f"$ {r.command.line}\nthe page shows {missing!r}, the command printed:"
                            f"\n{r.output[-3000:]}")
    assert not problems, "\n\n".join(problems)


@pytest.mark.slow
def test_plugins_lists_the_example_plugin_and_its_backend(walkthrough):
    r = _ran(walkthrough, "moe-runtime plugins --json")
    data = json.loads(r.output)
    plugin = next(p for p in data["plugins"] if p["name"] == PLUGIN)
    assert (plugin["distribution"], plugin["status"]) == (DISTRIBUTION, "loaded")
    backend = next(b for b in data["experts_backends"] if b["name"] == BACKEND)
    assert backend["plugin"] == PLUGIN
    assert {f for s in backend["supports"] for f in s["formats"]} == {"bf16", "fp16"}


@pytest.mark.slow
def test_planner_selects_the_example_backend_for_every_moe_layer(walkthrough):
    r = _ran(walkthrough, "moe-runtime plan tiny-qwen3-moe --moe-runner-backend")
    out = subprocess.run(["bash", "-c", r.command.line + " --json"], cwd=r.cwd,
                         env=walkthrough["env"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert len(plan["layers"]) == 2
    assert {(lp["experts"], lp["format"], lp["runs_as"]) for lp in plan["layers"]} == {
        (BACKEND, "bf16", "bf16")}
    assert not any(r["backend"] == BACKEND for r in plan["rejections"])


@pytest.mark.slow
def test_conformance_suite_passes_on_the_example_backend(walkthrough):
    for prefix in ("moe-runtime conformance", "pytest"):
        r = _ran(walkthrough, prefix)
        summary = r.output.strip().splitlines()[-1]
        assert r.returncode == 0 and " passed" in summary, f"$ {r.command.line}\n{r.output[-3000:]}"
        assert not re.search(r"\d+ (failed|error)", summary), summary
