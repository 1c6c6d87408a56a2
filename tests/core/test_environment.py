from __future__ import annotations

import pytest

from moe_runtime.environment import Environment


@pytest.mark.parametrize("text,cap", [("sm90", (9, 0)), ("sm100", (10, 0)), ("sm_103", (10, 3)),
                                      ("SM120", (12, 0)), ("cuda:9.0", (9, 0)), ("sm90a", (9, 0))])
def test_target_names_parse_to_capabilities(text, cap):
    env = Environment.for_target(text)
    assert env.device == "cuda" and env.capability == cap and env.available is None


def test_unknown_target_says_what_is_accepted():
    with pytest.raises(ValueError, match="'h200' not understood.*sm90"):
        Environment.for_target("h200")


def test_probe_on_this_machine_checks_modules_without_importing():
    import sys

    sys.modules.pop("json.tool", None)
    env = Environment.probe(device="cpu", modules=["json", "surely_absent_lib"])
    assert env.available == frozenset({"json"})
    assert env.device == "cpu"


def test_fingerprint_differs_when_machines_differ():
    a = Environment("cuda", (9, 0), frozenset({"triton"}))
    b = Environment("cuda", (9, 0), frozenset())
    c = Environment("cuda", (10, 0), frozenset({"triton"}))
    assert len({a.fingerprint(), b.fingerprint(), c.fingerprint()}) == 3
    assert a.fingerprint() == Environment("cuda", (9, 0), frozenset({"triton"})).fingerprint()


def test_probe_refuses_cuda_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        Environment.probe(device="cuda")
