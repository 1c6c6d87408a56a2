"""Expert parallelism over torch.distributed (gloo, several CPU processes) equals one process."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp


def _worker(rank, world, port, path, prompt, queue):
    import torch.distributed as dist

    from moe_runtime.integration.transformers import load_model
    from moe_runtime.planner import Deployment

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        loaded = load_model(path, dtype="float32", deployment=Deployment(ep_size=world),
                            ep_rank=rank, group=dist.group.WORLD)
        plan = loaded.plan.layers[0]
        # each rank holds only its experts
        experts = dict(loaded.model.named_modules())[
            plan.problem.name.replace(".block_sparse_moe.", ".mlp.")]._moe_runtime_executor
        local = experts.experts.setup.num_local_experts  # prepare refuses weights of any others
        # ranks may get different token counts: rank r sees the first prompt rows only
        ids = prompt[: 1 + rank % 2]
        with torch.no_grad():
            logits = loaded.model(ids).logits
        queue.put((rank, plan.comm, local, logits.tolist(), None))  # plain data outlives the process
    except Exception:
        import traceback

        queue.put((rank, None, None, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_expert_parallel_equals_single_process(tiny_checkpoint, world):
    from moe_runtime.integration.transformers import load_model

    path = tiny_checkpoint("qwen3_moe", "mixed", num_experts=6)
    prompt = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(1))
    single = load_model(path, dtype="float32")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, str(path), prompt, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank, comm, local, logits, err in results:
        assert err is None, f"rank {rank} failed:\n{err}"
        assert comm == "torch_all_to_all"
        assert local == len(range(rank, 6, world)) or local in (6 // world, 6 // world + 1)
        with torch.no_grad():
            expected = single.model(prompt[: 1 + rank % 2]).logits
        torch.testing.assert_close(torch.tensor(logits), expected, rtol=1e-4, atol=1e-5)
    assert sum(r[2] for r in results) == 6  # the experts are split, not copied
