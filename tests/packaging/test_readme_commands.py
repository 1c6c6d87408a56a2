"""The README's install and test commands agree with the packaging files and with CI."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, re.S)


def test_ci_runs_the_readme_test_command_verbatim():
    (line,) = [cmd for block in _bash_blocks() for cmd in block.splitlines()
               if "requirements-dev.txt" in cmd]
    pytest_command = line.split("&&")[-1].strip()
    assert pytest_command.startswith("python -m pytest")
    assert pytest_command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_every_extra_the_readme_installs_is_declared():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = set(cfg["options.extras_require"])
    for plugin in ROOT.glob("plugins/*/setup.cfg"):
        pcfg = configparser.ConfigParser()
        pcfg.read(plugin)
        extras |= {f"{plugin.parent.name}:{e}" for e in pcfg["options.extras_require"]}
    for folder, extra in re.findall(r"pip install '\.(/plugins/\w+)?\[([\w-]+)\]'", README):
        key = f"{folder.rsplit('/', 1)[-1]}:{extra}" if folder else extra
        assert key in extras, key


def test_the_serve_install_brings_the_default_model_exporter():
    (line,) = [cmd for block in _bash_blocks() for cmd in block.splitlines()
               if cmd.rstrip().endswith("moe-runtime serve")]
    assert "'.[default-model]'" in line


def test_the_readme_names_the_cpu_wheel_index_for_stock_machines():
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in README
