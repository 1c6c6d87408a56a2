"""Where a serve decode step's time goes: torch.profiler over one wave of the in-process engine.

bench_serve.py's ``--profile-clients`` splits an eager step by module with a device sync around
each one, which says what each part costs alone but not what a graph-replayed step spends. This
script runs the same engine (moe-runtime's side; ``--side transformers`` for transformers' own
experts) with CUDA graphs on and off, one wave of ``--clients`` greedy requests under
``torch.profiler``, and reports per engine step:

- wall time (steps counted at the sampler, as in bench_serve);
- GPU kernel time, in all and by kind (attention, MoE experts, other GEMMs, copies, the rest),
  from the kernels' device durations (inside graphs too);
- the host calls that block (``cudaStreamSynchronize``, ``cudaMemcpy*``) and graph launches;
- the top kernels and the top host-side ops by self time.

Usage (a GPU; the checkpoint from make_bench_checkpoint.py)::

    python benchmarks/profile_serve.py --model /tmp/q30 --clients 1,16 --graphs on,off --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

KINDS = (  # first match wins; names as the profiler reports kernels
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient_attention", "softmax")),
    ("moe", ("moe_", "route_", "_grouped_mm", "grouped", "w4a16")),
    ("gemm", ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "matmul", "splitk")),
    ("copy", ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def _wave(engine, prompts, clients: int, max_tokens: int) -> float:
    from moe_runtime.serve.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)

    async def one(i: int):
        async for _ in engine.generate(prompts[i % len(prompts)], max_tokens=max_tokens,
                                       sampling=greedy):
            pass

    async def all_():
        await asyncio.gather(*(one(i) for i in range(clients)))

    start = time.perf_counter()
    asyncio.run(all_())
    return time.perf_counter() - start


def profile_one(loaded, prompts, args, clients: int, graphs: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from moe_runtime.serve.engine import Engine

    engine = Engine(loaded, max_batch_size=max(args.client_levels),
                    max_model_len=args.prompt_len + args.max_tokens + 1, cuda_graphs=graphs)
    engine.eos_token_ids = []
    engine.start()
    try:
        _wave(engine, prompts, clients, 4)  # warm: compiles, captures
        steps = []
        rows_for = engine.sampler.rows_for

        def counting(keys):
            steps.append(len(keys))
            return rows_for(keys)

        engine.sampler.rows_for = counting
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                         else [])
        try:  # the engine steps on its own thread
            cfg = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        except TypeError:  # an older torch: this thread's ops only (kernels are seen either way)
            cfg = None
        with profile(activities=acts, experimental_config=cfg) as prof:
            wall = _wave(engine, prompts, clients, args.max_tokens)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        engine.sampler.rows_for = rows_for
    finally:
        engine.shutdown()
    n = max(1, len(steps))
    kinds: dict[str, float] = defaultdict(float)
    kernels: dict[str, list] = defaultdict(lambda: [0.0, 0])
    host: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        dev = getattr(ev, "device_type", None)
        if dev is not None and "CUDA" in str(dev):
            us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            kinds[kind_of(ev.name)] += us
            kernels[ev.name][0] += us
            kernels[ev.name][1] += 1
        else:
            host[ev.name][0] += ev.self_cpu_time_total
            host[ev.name][1] += 1
    gpu_us = sum(kinds.values())
    blocking = {k: host[k][1] for k in host if k.startswith(("cudaStreamSynchronize",
                                                              "cudaMemcpy", "cudaDeviceSynchronize",
                                                              "cudaEventSynchronize"))}
    out = {
        "clients": clients, "graphs": graphs, "wall_s": wall, "steps": len(steps),
        "tokens_per_step": sum(steps) / n,
        "wall_ms_per_step": wall * 1e3 / n,
        "gpu_ms_per_step": gpu_us / 1e3 / n,
        "gpu_ms_per_step_by_kind": {k: v / 1e3 / n for k, v in sorted(kinds.items())},
        "graph_launches_per_step": host.get("cudaGraphLaunch", [0, 0])[1] / n,
        "kernel_launches_per_step": host.get("cudaLaunchKernel", [0, 0])[1] / n
        + host.get("cuLaunchKernel", [0, 0])[1] / n + host.get("cuLaunchKernelEx", [0, 0])[1] / n,
        "blocking_calls_per_step": {k: v / n for k, v in blocking.items()},
        "top_kernels": [(k, v[0] / 1e3 / n, v[1] / n) for k, v in
                        sorted(kernels.items(), key=lambda kv: -kv[1][0])[:args.top]],
        "top_host_ops": [(k, v[0] / 1e3 / n, v[1] / n) for k, v in
                         sorted(host.items(), key=lambda kv: -kv[1][0])[:args.top]],
    }
    if args.trace:
        prof.export_chrome_trace(str(Path(args.out) / f"trace_c{clients}_g{int(graphs)}.json"))
    return out


def render(results: list[dict], header: str) -> str:
    lines = [header, "", "| clients | graphs | steps | wall ms/step | GPU ms/step | attention | "
             "MoE | GEMM | copy | other | graph launches/step | kernel launches/step |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        k = r["gpu_ms_per_step_by_kind"]
        lines.append(
            f"| {r['clients']} | {'on' if r['graphs'] else 'off'} | {r['steps']} | "
            f"{r['wall_ms_per_step']:.2f} | {r['gpu_ms_per_step']:.2f} | "
            + " | ".join(f"{k.get(x, 0.0):.2f}" for x in ("attention", "moe", "gemm", "copy",
                                                           "other"))
            + f" | {r['graph_launches_per_step']:.1f} | {r['kernel_launches_per_step']:.0f} |")
    for r in results:
        lines += ["", f"clients {r['clients']}, graphs {'on' if r['graphs'] else 'off'}: "
                  f"blocking host calls per step {json.dumps(r['blocking_calls_per_step'])}", "",
                  "| top kernels | ms/step | calls/step |", "| --- | ---: | ---: |"]
        lines += [f"| `{n[:90]}` | {ms:.3f} | {c:.1f} |" for n, ms, c in r["top_kernels"]]
        lines += ["", "| top host ops (self time) | ms/step | calls/step |", "| --- | ---: | ---: |"]
        lines += [f"| `{n[:90]}` | {ms:.3f} | {c:.1f} |" for n, ms, c in r["top_host_ops"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, metavar="DIR")
    p.add_argument("--device", default="cuda")
    p.add_argument("--side", choices=("moe-runtime", "transformers"), default="moe-runtime")
    p.add_argument("--clients", default="1,16", help="comma-separated client counts")
    p.add_argument("--graphs", default="on,off", help="on, off or both (comma-separated)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--top", type=int, default=15, help="rows of the top-kernel and host tables")
    p.add_argument("--trace", action="store_true", help="also write Chrome traces")
    p.add_argument("--out", default="profile_serve_out")
    args = p.parse_args(argv)
    args.client_levels = [int(c) for c in args.clients.split(",") if c]
    graph_modes = [{"on": True, "off": False}[g] for g in args.graphs.split(",") if g]
    Path(args.out).mkdir(parents=True, exist_ok=True)

    import torch

    from moe_runtime.serve.loading import load_for_serving

    sys.path.insert(0, os.fspath(Path(__file__).resolve().parent))
    from bench_serve import make_prompts

    start = time.perf_counter()
    loaded = load_for_serving(Path(args.model), device=args.device, progress=False,
                              transformers_experts=args.side == "transformers")
    print(f"loaded in {time.perf_counter() - start:.1f} s; attention "
          f"{loaded.model.config._attn_implementation}", flush=True)
    prompts = make_prompts(loaded.tokenizer, max(args.client_levels), args.prompt_len)
    results = []
    for graphs in graph_modes:
        for c in args.client_levels:
            r = profile_one(loaded, prompts, args, c, graphs)
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if not k.startswith("top_")}),
                  flush=True)
            (Path(args.out) / "profile_serve.json").write_text(json.dumps(results, indent=1))
    header = (f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, torch "
              f"{torch.__version__}; `{' '.join(sys.argv)}`; {args.side}; prompts of "
              f"{args.prompt_len} tokens, {args.max_tokens} output tokens, all clients at once")
    md = render(results, header)
    (Path(args.out) / "profile_serve.md").write_text(md)
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.fspath(Path(__file__).resolve().parent.parent))
    sys.exit(main())
