"""Expert-parallel ranks compare their plans at start-up: a difference stops every rank with one
message naming the ranks and the first field that differs; a silent rank stops the others in time.

Real torch.distributed: gloo processes on CPU, as tests/execution/test_expert_parallel.py.
"""

from __future__ import annotations

import os
import socket
import time

import attrs
import pytest
import torch.multiprocessing as mp

from moe_runtime.agreement import (
    PlanAgreementTimeout,
    PlanFingerprint,
    PlanMismatchError,
    compare,
    first_difference,
)


def test_the_first_differing_field_is_reported_with_every_ranks_value():
    same = [("moe-runtime version", "0.1.0"), ("plugin x", "x 1.0"), ("environment.device", "cpu")]
    other = [("moe-runtime version", "0.1.0"), ("plugin x", "x 1.1"), ("environment.device", "cuda")]
    by_rank = {0: PlanFingerprint(same), 1: PlanFingerprint(other), 2: PlanFingerprint(same)}
    assert first_difference(by_rank) == ("plugin x", {0: "x 1.0", 1: "x 1.1", 2: "x 1.0"})
    with pytest.raises(PlanMismatchError, match=r"'plugin x': ranks 0, 2: 'x 1.0'; rank 1: 'x 1.1'"):
        compare(by_rank)


def test_a_plugin_only_one_rank_has_is_a_difference():
    a = PlanFingerprint([("plugin x", "x 1.0")])
    b = PlanFingerprint([("plugin x", "x 1.0"), ("plugin y", "y 2.0")])
    assert first_difference({0: a, 1: b}) == ("plugin y", {0: "(absent)", 1: "y 2.0"})
    assert first_difference({0: a, 1: a}) is None


def _probe_site(root, version: str) -> str:
    """A folder with a real plugin distribution 'moe-runtime-agreement-probe' at ``version``."""
    site = root / f"site-{version}"
    info = site / f"moe_runtime_agreement_probe-{version}.dist-info"
    info.mkdir(parents=True)
    (site / "agreement_probe_plugin.py").write_text('"""A plugin that declares nothing."""\n')
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: moe-runtime-agreement-probe\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        "[moe_runtime]\nagreement_probe = agreement_probe_plugin\n")
    return str(site)


def _plan_directly(site):
    """A plan of two layers with the plugins installed here plus the probe found in ``site``."""
    import sys

    from moe_runtime.backend_api import LayerProblem
    from moe_runtime.environment import Environment
    from moe_runtime.planner import Deployment, plan_model
    from moe_runtime.plugin.registry import Registry

    sys.path.insert(0, site)
    registry = Registry.load(blocked=["humming"], environ={})
    problems = [LayerProblem(f"model.layers.{i}.mlp.experts", "bf16", "silu", 8, 2, 32, 16)
                for i in range(2)]
    plan = plan_model(problems, registry=registry, environment=Environment.for_target("cpu"),
                      deployment=Deployment(ep_size=4))
    return plan, registry


def _worker(rank, world, port, scenario, arg, queue):
    import torch.distributed as dist

    from moe_runtime.agreement import agree_on_plan
    from moe_runtime.environment import Environment
    from moe_runtime.planner import Deployment

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    start = time.monotonic()
    try:
        if scenario == "environment":  # through load_model, rank 1 sees another environment
            from moe_runtime.integration.transformers import load_model

            env = None
            if rank == 1:  # as if triton were importable here
                from moe_runtime.plugin.registry import Registry

                env = Environment.probe(device="cpu", modules=Registry.load().required_modules())
                env = attrs.evolve(env, available=env.available ^ {"triton"})
            load_model(arg, dtype="float32", deployment=Deployment(ep_size=world), ep_rank=rank,
                       group=dist.group.WORLD, environment=env, agreement_timeout=60)
        elif scenario == "refusal":  # rank 1 pins a backend that cannot run expert parallel
            from moe_runtime.integration.transformers import load_model

            dep = Deployment(ep_size=world, comm_backend="local" if rank == 1 else None)
            load_model(arg, dtype="float32", deployment=dep, ep_rank=rank,
                       group=dist.group.WORLD, agreement_timeout=60)
        elif scenario == "plugin_version":  # rank 2 has another version of one plugin
            plan, registry = _plan_directly(arg[1] if rank == 2 else arg[0])
            agree_on_plan(plan, registry, timeout=60)
        elif scenario == "silent_rank":  # rank 1 never reports
            if rank == 0:
                plan, registry = _plan_directly(arg)
                agree_on_plan(plan, registry, timeout=3)
            else:
                time.sleep(6)
        queue.put((rank, None, None, None, time.monotonic() - start))
    except Exception as exc:
        import traceback

        detail = (getattr(exc, "field", None), getattr(exc, "values", None)
                  or getattr(exc, "missing", None))
        queue.put((rank, type(exc).__name__, str(exc), detail,
                   time.monotonic() - start if isinstance(exc, PlanAgreementTimeout)
                   else traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _run(world, scenario, arg):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, scenario, arg, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return results


def test_two_ranks_with_different_environments_both_stop_with_one_message(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", "mixed", num_experts=6)
    results = _run(2, "environment", str(path))
    messages = set()
    for rank, kind, message, (field, values), _ in results:
        assert kind == "PlanMismatchError", f"rank {rank}: {kind}: {message}"
        assert field == "environment.available"
        assert values[0] != values[1] and "triton" in values[0] + values[1]
        messages.add(message)
    (message,) = messages  # the same words on every rank
    assert "rank 0: " in message and "; rank 1: " in message


def test_a_rank_whose_planning_fails_stops_the_others_at_once(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", "mixed", num_experts=6)
    results = _run(2, "refusal", str(path))
    assert results[1][1] == "PlanError"  # its own error, word for word
    rank, kind, message, (field, values), _ = results[0]
    assert (kind, field) == ("PlanMismatchError", "plan")
    assert values[0] == "made" and values[1].startswith("refused: layer model.layers.0")


def test_four_ranks_one_with_another_plugin_version_all_stop(tmp_path):
    sites = (_probe_site(tmp_path, "1.0"), _probe_site(tmp_path, "1.1"))
    results = _run(4, "plugin_version", sites)
    for rank, kind, message, (field, values), _ in results:
        assert kind == "PlanMismatchError", f"rank {rank}: {kind}: {message}"
        assert field == "plugin agreement_probe"
        assert values[2] == "moe-runtime-agreement-probe 1.1 (loaded)"
        assert message.count("rank") >= 2 and "ranks 0, 1, 3" in message and "rank 2" in message


def test_a_rank_that_never_reports_stops_the_others_within_the_timeout(tmp_path):
    results = _run(2, "silent_rank", _probe_site(tmp_path, "1.0"))
    rank, kind, message, (_, missing), seconds = results[0]
    assert kind == "PlanAgreementTimeout", message
    assert missing == [1] and "rank 1 of the expert-parallel group" in message
    assert seconds < 30
