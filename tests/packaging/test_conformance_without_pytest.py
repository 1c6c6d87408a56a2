"""`moe-runtime conformance` where pytest is not installed says what to install."""

from __future__ import annotations

import subprocess
import sys

# A child interpreter in which `import pytest` fails as it does where pytest is not installed.
HIDE_PYTEST = """
import sys
class _NoPytest:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pytest", "_pytest"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoPytest())
from moe_runtime.cli import main
sys.exit(main(["conformance", "reference"]))
"""


def test_conformance_without_pytest_names_the_install_command_and_prints_no_traceback():
    out = subprocess.run([sys.executable, "-c", HIDE_PYTEST], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert "pip install 'pytest>=8'" in out.stderr
    assert "Traceback" not in out.stderr
