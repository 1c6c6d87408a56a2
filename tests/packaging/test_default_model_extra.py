"""Without nvidia-modelopt, the tiny-model builders say which extra installs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A child interpreter in which `import modelopt` fails as it does after a plain `pip install .`.
HIDE_MODELOPT = """
import sys
class _NoModelopt:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "modelopt":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoModelopt())
import tempfile
try:
    BUILD
except ImportError as exc:
    print(exc)
    sys.exit(3)
"""

BUILDERS = {
    "default_model": "from moe_runtime.serve.default_model import make_default_model; "
                     "make_default_model(tempfile.mkdtemp())",
    "tiny_checkpoint": "from moe_runtime.checkpoint.tiny import make_tiny_checkpoint; "
                       "make_tiny_checkpoint(tempfile.mkdtemp(), arch='qwen3_moe', quant='nvfp4')",
}


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_builder_without_modelopt_names_the_default_model_extra(builder):
    code = HIDE_MODELOPT.replace("BUILD", BUILDERS[builder])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    assert "nvidia-modelopt" in out.stdout
    assert "pip install 'moe-runtime[default-model]'" in out.stdout
