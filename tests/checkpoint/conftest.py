"""Tiny checkpoints exported by ModelOpt itself (made once per session, shared by the modules)
and the hand-written configs of published checkpoint shapes in ``data/``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``tiny(arch=..., quant=..., **kwargs)`` -> folder; one export per distinct argument set."""
    made: dict[tuple, Path] = {}

    def make(**kwargs) -> Path:
        key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))
        if key not in made:
            from moe_runtime.checkpoint.tiny import make_tiny_checkpoint

            name = "-".join(f"{k}={v}" for k, v in key).replace(" ", "")
            made[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(name[:60]), **kwargs)
        return made[key]

    return make


@pytest.fixture
def data_copy(tmp_path):
    """``data_copy("name")`` -> a writable copy of ``data/name`` (for variants made in a test)."""

    def copy(name: str) -> Path:
        return Path(shutil.copytree(DATA / name, tmp_path / name))

    return copy


# One module-scoped fixture per export the tests read.


@pytest.fixture(scope="module")
def qwen3_bf16(tiny):
    return tiny(arch="qwen3_moe", quant="bf16")


@pytest.fixture(scope="module")
def qwen3_fp8(tiny):
    return tiny(arch="qwen3_moe", quant="fp8")


@pytest.fixture(scope="module")
def qwen3_nvfp4(tiny):
    return tiny(arch="qwen3_moe", quant="nvfp4")


@pytest.fixture(scope="module")
def qwen3_w4a16(tiny):
    return tiny(arch="qwen3_moe", quant="w4a16_nvfp4")


@pytest.fixture(scope="module")
def qwen3_mixed(tiny):
    """3 MoE layers: 0 and 2 NVFP4, 1 FP8; FP8 attention and KV cache; layer 0 o_proj bf16."""
    return tiny(arch="qwen3_moe", quant="mixed", num_layers=3, fp8_moe_layers=(1,),
                kv_cache="fp8")


@pytest.fixture(scope="module")
def mixtral_nvfp4(tiny):
    return tiny(arch="mixtral", quant="nvfp4")


@pytest.fixture(scope="module")
def mixtral_mixed(tiny):
    return tiny(arch="mixtral", quant="mixed", fp8_moe_layers=(0,))


@pytest.fixture(scope="module")
def mixtral_w4a16(tiny):
    return tiny(arch="mixtral", quant="w4a16_nvfp4")


@pytest.fixture(scope="module")
def deepseek_fp8(tiny):
    return tiny(arch="deepseek_v3", quant="fp8")


@pytest.fixture(scope="module")
def deepseek_nvfp4(tiny):
    return tiny(arch="deepseek_v3", quant="nvfp4")


@pytest.fixture(scope="module")
def deepseek_mixed(tiny):
    """Layer 0 dense, MoE layers 1 (FP8) and 2 (NVFP4)."""
    return tiny(arch="deepseek_v3", quant="mixed", num_layers=3, fp8_moe_layers=(1,))
