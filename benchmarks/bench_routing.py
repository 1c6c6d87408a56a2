#!/usr/bin/env python3
"""Routing of the Triton backend alone (issue 14: routing at 32K pairs measured apart).

For each (pairs, experts, block M) row: the three large-P routing kernels (count, offsets, scatter)
as ``ops.route_into`` launches them, with the count kernel in its two forms (one atomic per pair,
``route_count_kernel``; or sorted per program with one atomic per (program, expert),
``route_count_sorted_kernel``), each checked against a torch reference (the set of pairs of each
expert's rows, padding, block map) and timed as CUDA-graph replays of 20 launches (median of 15
replays), plus each kernel of the sorted form alone.

Usage: python benchmarks/bench_routing.py [--out DIR]    (CUDA device; writes DIR/routing.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "triton"))

import torch  # noqa: E402

ROWS = [  # (label, tokens, top_k, experts, block_m)
    ("qwen3-30b-a3b 4096 tok", 4096, 8, 128, 128),
    ("qwen3-30b-a3b 1024 tok", 1024, 8, 128, 64),
    ("deepseek-v3 4096 tok", 4096, 8, 256, 128),
    ("qwen3.5-397b 4096 tok", 4096, 10, 512, 128),
    ("qwen3.5-397b 16384 tok", 16384, 10, 512, 128),
]
REPEAT = 20


def check(ids, E, bm, sid, bexp):
    flat = ids.reshape(-1).cpu()
    P = flat.numel()
    s, b = sid.cpu(), bexp.cpu()
    for e in range(E):
        rows = (b == e).nonzero().flatten()
        got = torch.cat([s[r * bm:(r + 1) * bm] for r in rows]) if len(rows) else torch.empty(0)
        want = (flat == e).nonzero().flatten()
        real = got[got < P]
        if sorted(real.tolist()) != want.tolist():
            return f"expert {e}: rows hold the wrong pairs"
        if len(got) != -(-len(want) // bm) * bm:
            return f"expert {e}: {len(got)} rows for {len(want)} pairs"
    return None


def graph_time(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPEAT):
            fn()
    ts = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / REPEAT)
    return round(statistics.median(ts), 2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    import triton
    from moe_runtime_triton import kernels as K
    from moe_runtime_triton import ops

    out = {"device": torch.cuda.get_device_name(), "rows": []}
    for label, n, k, E, bm in ROWS:
        g = torch.Generator(device="cuda").manual_seed(0)
        ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(n)])
        ids = ids.to(torch.int32).contiguous()
        P = ids.numel()
        R = ops.max_sorted_rows(P, E, bm)
        sid = torch.empty(R, dtype=torch.int32, device="cuda")
        bexp = torch.empty(R // bm, dtype=torch.int32, device="cuda")
        row = {"row": label, "pairs": P, "experts": E, "block_m": bm}
        for name, flag in (("per_pair_atomics", False), ("sorted_per_program", True)):
            ops.ROUTE_SORTED_COUNT = flag
            ops.ROUTE_SORTED_MIN_PAIRS = 0  # each form at every size
            sid.fill_(-7)
            ops.route_into(ids, E, bm, sid, bexp)
            torch.cuda.synchronize()
            err = check(ids, E, bm, sid, bexp)
            row[name] = {"error": err} if err else {
                "us": graph_time(lambda: ops.route_into(ids, E, bm, sid, bexp))}
        # the sorted form's kernels alone
        flat = ids.reshape(-1)
        counts = torch.zeros(E, dtype=torch.int32, device="cuda")
        rank = torch.empty(P, dtype=torch.int32, device="cuda")
        starts = torch.empty(E, dtype=torch.int32, device="cuda")
        block = 1024
        grid = triton.cdiv(P, block)
        fill_per = triton.cdiv(triton.cdiv(R, grid), block) * block
        e_p2 = max(16, triton.next_power_of_2(E))
        # each count launch starts from zeroed counters (the zeroing is timed apart and included)
        def count(kernel, **kw):
            return lambda: (counts.zero_(), kernel[(grid,)](flat, counts, rank, sid, P, E, R,
                                                            fill_per, BLOCK=block, num_warps=4,
                                                            **kw))
        stages = {
            "zero_counts": graph_time(lambda: counts.zero_()),
            "zero+count_per_pair_atomics": graph_time(count(K.route_count_kernel)),
            "zero+count_sorted": graph_time(count(K.route_count_sorted_kernel, E_P2=e_p2)),
        }
        count(K.route_count_sorted_kernel, E_P2=e_p2)()  # counts and ranks of one batch
        stages["offsets"] = graph_time(lambda: K.route_offsets_kernel[(1,)](
            counts, bexp, starts, E, R // bm, BLOCK_M=bm, E_P2=e_p2, num_warps=4))
        stages["scatter"] = graph_time(lambda: K.route_scatter_kernel[(grid,)](
            flat, rank, starts, sid, P, E, BLOCK=block, num_warps=4))
        row["stages_us"] = stages
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "routing.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
