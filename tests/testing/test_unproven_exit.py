"""``moe-runtime conformance`` on a machine where none of a backend's declared combinations can run
(a CUDA backend on a CPU-only machine) says so and exits 5, not 0: nothing it declares was proven.
``--allow-unproven`` exits 0 with the same sentence; a backend whose cases ran is unaffected."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_runtime.testing.dists import build_plugin_dist, pip_install_target, run_cli

PLUGIN = '''
    from moe_runtime import ExpertsBackendSpec, Hardware, Support, hookimpl

    @hookimpl
    def moe_runtime_register_backends(register):
        register(ExpertsBackendSpec(
            name="{name}", factory="moe_runtime.backends.reference:ReferenceExperts",
            priority=-5, supports=[Support(formats=["bf16"], hardware=Hardware(devices=[{dev}]))]))
'''


# a communication mode with a token bound: its token-bound cases only plan (no kernel runs), so
# they pass on any machine and must not count as proof
COMM = '''
    from moe_runtime import CommBackendSpec, CommSupport, Hardware, hookimpl

    @hookimpl
    def moe_runtime_register_backends(register):
        register(CommBackendSpec(
            name="gpu_comm", factory="moe_runtime.backends.local:LocalComm", priority=-5,
            supports=[CommSupport(layout="token_major", max_world_size=1, max_tokens_per_rank=128,
                                  hardware=Hardware(devices=["cuda"]), mode="bounded")]))
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("unproven")
    srcs = [build_plugin_dist(root, f"moe-runtime-{name}", name, name,
                              PLUGIN.format(name=name, dev=dev))
            for name, dev in (("gpu_only", '"cuda"'), ("cpu_too", '"cpu"'))]
    srcs.append(build_plugin_dist(root, "moe-runtime-gpu-comm", "gpu_comm", "gpu_comm", COMM))
    pip_install_target(srcs, root / "site")
    return root / "site"


@pytest.fixture(scope="module")
def no_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the cuda-only backend's cases run here")


def test_a_backend_none_of_whose_cases_ran_exits_5_saying_why(site, no_cuda):
    r = run_cli("conformance", "gpu_only", site=site)
    assert r.returncode == 5, r.stdout[-2000:] + r.stderr[-2000:]
    assert "no case that runs backend 'gpu_only' ran on this machine: all " in r.stderr
    assert "were skipped (" in r.stderr and "Its declarations are not proven here" in r.stderr
    assert "--allow-unproven" in r.stderr
    # the refusal, import and factory checks still ran and passed (pytest's own summary)
    assert " passed" in r.stdout and " skipped" in r.stdout and " failed" not in r.stdout


def test_allow_unproven_exits_0_and_still_says_so(site, no_cuda):
    r = run_cli("conformance", "gpu_only", "--allow-unproven", site=site)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "no case that runs backend 'gpu_only' ran on this machine" in r.stderr
    assert "pass --allow-unproven" not in r.stderr


def test_one_unproven_backend_beside_a_proven_one_is_named_alone(site, no_cuda):
    r = run_cli("conformance", "cpu_too", "gpu_only", "--", "-k", "one_token or refuses",
                site=site)
    assert r.returncode == 5, r.stdout[-2000:] + r.stderr[-2000:]
    assert "backend 'gpu_only'" in r.stderr and "backend 'cpu_too'" not in r.stderr


def test_a_backend_whose_cases_ran_exits_0_without_the_sentence(site):
    r = run_cli("conformance", "cpu_too", "--", "-k", "one_token", site=site)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "not proven" not in r.stderr


def test_a_selection_of_no_kernel_case_is_not_called_unproven(site, no_cuda):
    # -k picks only the refusal cases: nothing that runs kernels was asked for
    r = run_cli("conformance", "gpu_only", "--", "-k", "refuses", site=site)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "not proven" not in r.stderr


def test_a_comm_backend_whose_round_trips_were_all_skipped_is_unproven(site, no_cuda):
    r = run_cli("conformance", "gpu_comm", site=site)
    assert r.returncode == 5, r.stdout[-2000:] + r.stderr[-2000:]
    assert "no case that runs backend 'gpu_comm' ran on this machine" in r.stderr
