"""Expert-parallel MoE layer latency: dispatch + experts + combine, per communication backend.

Run one process per GPU (``torchrun --nproc-per-node N benchmarks/bench_ep.py``) or, to check the
script itself, on CPU processes (``torchrun --nproc-per-node 2 benchmarks/bench_ep.py --cpu
--quick``). For each shape (Qwen3.5-397B-A17B, DeepSeek-V3), batch (decode 1-128 tokens per rank,
prefill 4096) and payload (BF16; FP8 with the layer's input scale), every communication backend the
planner accepts for the deployment is timed in the same run: the planner is asked with that backend
pinned, so a backend that cannot run the case is reported with its reason, not skipped silently.
The experts backend is the planner's choice (Triton on Hopper). Medians of CUDA-event timings.
Output: a markdown table on rank 0 and JSON under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

SHAPES = {
    # name: (hidden, intermediate, experts, top_k)
    "qwen3.5-397b-a17b": (4096, 1024, 512, 10),
    "deepseek-v3": (7168, 2048, 256, 8),
}
DECODE = (1, 8, 32, 128)
PREFILL = (4096,)


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="gloo on CPU processes (checks the script)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few repetitions")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT", "bench-ep-out"))
    return p.parse_args()


def _time(fn, reps, device):
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        dist.barrier()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e6)
    # the slowest rank bounds the layer
    t = torch.tensor([statistics.median(samples)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    args = _args()
    device = "cpu" if args.cpu else "cuda"
    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())

    from moe_runtime.backend_api import ExpertsSetup, LayerProblem
    from moe_runtime.environment import Environment
    from moe_runtime.executor import build_executor
    from moe_runtime.planner import Deployment, PlanError, plan_layer
    from moe_runtime.plugin.registry import Registry
    from moe_runtime.reference_math import quantize_expert_weights

    registry = Registry.load()
    env = Environment.probe(device=device, modules=registry.required_modules())
    shapes = {"tiny": (256, 128, 16, 4)} if args.quick else SHAPES
    batches = (1, 8, 64) if args.quick else DECODE + PREFILL
    reps = 3 if args.quick else args.reps
    rows = []
    for shape, (h, i, e, k) in shapes.items():
        for fmt, payload in (("bf16", "unquantized"), ("fp8_w8a8", "fp8")):
            problem = LayerProblem(shape, fmt, "silu", e, k, h, i, dtype="bfloat16")
            weights = None
            for comm in sorted(registry.comms):
                for tokens in batches:
                    dep = Deployment(ep_size=world, comm_backend=comm, payload=payload,
                                     max_tokens_per_rank=tokens)
                    row = {"shape": shape, "format": fmt, "payload": payload, "comm": comm,
                           "tokens_per_rank": tokens, "world": world}
                    try:
                        lp, _ = plan_layer(problem, registry=registry, environment=env,
                                           deployment=dep)
                    except PlanError as exc:
                        row["refused"] = str(exc).split(". ")[0][-200:]
                        rows.append(row)
                        continue
                    setup = ExpertsSetup(problem=problem, runs_as=lp.runs_as, payload=lp.payload,
                                         layout=lp.layout, ep_rank=rank, ep_size=world)
                    if weights is None or weights.num_experts != setup.num_local_experts:
                        gen = torch.Generator().manual_seed(rank)
                        n = setup.num_local_experts
                        w13 = torch.randn((n, 2 * i, h), generator=gen) / h**0.5
                        w2 = torch.randn((n, h, i), generator=gen) / i**0.5
                        weights = quantize_expert_weights(
                            w13, w2, fmt, "silu", a13_amax=torch.tensor(4.0),
                            a2_amax=torch.tensor(4.0)).to(device)
                    ex = build_executor(lp, registry, weights, device=device, ep_rank=rank,
                                        ep_size=world, group=dist.group.WORLD,
                                        max_tokens_per_rank=tokens)
                    x = torch.randn((tokens, h), device=device, dtype=torch.bfloat16)
                    ids = torch.rand((tokens, e), device=device).topk(k, -1).indices.int()
                    tw = torch.softmax(torch.randn((tokens, k), device=device), -1)
                    row.update(experts=lp.experts, layout=lp.layout,
                               us=_time(lambda: ex(x, ids, tw), reps, device))
                    rows.append(row)
                    if rank == 0:
                        print(json.dumps(row), flush=True)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_ep.json").write_text(json.dumps(rows, indent=1))
        lines = ["| shape | format/payload | comm | experts | tokens/rank | us (median, max over ranks) |",
                 "|---|---|---|---|---|---|"]
        for r in rows:
            val = f"{r['us']:.1f}" if "us" in r else f"refused: {r['refused']}"
            lines.append(f"| {r['shape']} | {r['format']}/{r['payload']} | {r['comm']} | "
                         f"{r.get('experts', '-')} | {r['tokens_per_rank']} | {val} |")
        (out / "bench_ep.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
