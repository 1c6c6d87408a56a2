"""Serving benchmark: throughput, TTFT, TPOT and GPU memory, moe-runtime vs transformers alone.

Two modes (``--modes``), both on the engine the HTTP server (``moe-runtime serve``) runs:
transformers' continuous batching (CUDA graphs for decode on a GPU), the batched sampler and
incremental detokenization.

- ``in-process``: ``N`` concurrent clients call :class:`moe_runtime.serve.engine.Engine` in this
  process (no HTTP: the engine's numbers).
- ``http``: the same engine behind the server's ASGI app (:func:`moe_runtime.serve.app.create_app`,
  uvicorn on a loopback port, in a thread of this process), ``N`` concurrent clients of the official
  ``openai`` client streaming ``/v1/completions`` (TTFT: the first streamed chunk). The clients
  run in a process of their own, as real clients do (``--http-clients thread`` runs them in this
  process, where their parsing of every streamed chunk shares the GIL with the server and the
  engine's host loop).

Two sides, on the same checkpoint, in the same process:

- ``moe-runtime``: :func:`~moe_runtime.serve.loading.load_for_serving` as the server calls it: every
  MoE layer through moe-runtime's plan (the backend the planner picks, or ``--moe-runner-backend``).
- ``transformers``: ``load_for_serving(..., transformers_experts=True)``: the same checkpoint in
  transformers alone, its default experts implementation on dequantized weights, driven by the
  same engine (the same continuous batching), so the difference is what runs the experts.

Workload: each client sends ``--requests-per-client`` requests one after another (closed loop);
every prompt is ``--prompt-len`` tokens of real text (a different window per request), decoding is
greedy, and EOS is ignored so every request generates exactly ``--max-tokens`` tokens (both sides do
the same work whatever their numerics). Every engine start is warmed up (one short wave per client
count) before it is measured; the sides alternate in each repetition (ABBA) so slow drift on a
shared machine hits both. Reported per client count: requests/s and output tokens/s (medians over
repetitions), time to first token and time per output token after the first (p50 and p90 over all
measured requests), GPU memory (each side's weights, and the most the process held above them
while that side ran: KV cache, activations, graphs), and how many requests produced the same
greedy tokens on both sides (in-process).

With ``--profile-clients N`` each side also runs one eager wave of ``N`` clients (CUDA graphs
off) whose steps are timed by part on the wall clock (the device synchronized at each mark):
attention and MoE module forwards, the rest of the forward, the sampler, and the host loop (the
step's wall time less those).

Writes ``bench_serve.json`` (everything, raw per-repetition numbers included), ``bench_serve.md``
(the table) and ``bench_serve.png`` (output tokens/s and TPOT against clients, every side and
mode) under ``--out``.

Examples::

    python benchmarks/bench_serve.py --out /tmp/serve-cpu                     # the default model
    python benchmarks/bench_serve.py --quick --out /tmp/serve-quick
    python benchmarks/make_bench_checkpoint.py /tmp/q30-48 --preset qwen3-30b-a3b --layers 48
    python benchmarks/bench_serve.py --model /tmp/q30-48 --device cuda --clients 1,4,16,64 --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

SIDES = ("moe-runtime", "transformers")
MODES = ("in-process", "http")

# Prompt material: any text the tokenizer can encode; requests take different windows of it.
_TEXT = (
    "A mixture of experts layer sends every token to a few of its experts. A router scores the "
    "experts, keeps the top ones, and the layer adds their outputs, weighted by the router. Each "
    "expert is a small feed-forward network with a gate projection, an up projection and a down "
    "projection. The quick brown fox jumps over the lazy dog. Once upon a time there was a small "
    "model that lived on a laptop. It answered questions, told stories and counted numbers: one, "
    "two, three, four, five, six, seven, eight, nine, ten. The server listens on a port, reads "
    "requests as JSON, and streams tokens back as events. Hello, world! How are you today? "
)


def _percentile(values, q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _median(values) -> float | None:
    return statistics.median(values) if values else None


def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` distinct prompts of exactly ``length`` tokens (windows of one long text)."""
    base = list(tokenizer(_TEXT, add_special_tokens=False)["input_ids"])
    while len(base) < length + 7 * count + 1:
        base = base + base
    return [base[7 * i: 7 * i + length] for i in range(count)]


# ----------------------------------------------------------------------------------- measuring


async def _request(engine, prompt_ids, max_tokens: int, sampling) -> dict:
    start = time.perf_counter()
    seen_first = None
    last = None
    async for delta in engine.generate(prompt_ids, max_tokens=max_tokens, sampling=sampling):
        if seen_first is None and delta.token_ids:
            seen_first = time.perf_counter() - start
        last = delta
    latency = time.perf_counter() - start
    ttft = last.first_token_s if last.first_token_s is not None else seen_first
    n = len(last.token_ids)
    tpot = (latency - ttft) / (n - 1) if n > 1 and ttft is not None else None
    return {"ttft_s": ttft, "latency_s": latency, "tokens": n, "tpot_s": tpot,
            "finish_reason": last.finish_reason, "token_ids": list(last.token_ids)}


async def _wave(engine, prompts, *, clients: int, per_client: int, max_tokens: int, bar=None):
    from moe_runtime.serve.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    results: list[dict | None] = [None] * (clients * per_client)

    async def client(c: int) -> None:
        for k in range(per_client):
            i = c * per_client + k
            results[i] = await _request(engine, prompts[i % len(prompts)], max_tokens, greedy)
            results[i]["prompt"] = i % len(prompts)
            if bar is not None:
                bar.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    wall = time.perf_counter() - start
    return wall, results


async def _http_request(client, model: str, prompt_ids, max_tokens: int) -> dict:
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = await client.completions.create(
        model=model, prompt=list(prompt_ids), max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    latency = time.perf_counter() - start
    tpot = (latency - first) / (tokens - 1) if tokens > 1 and first is not None else None
    return {"ttft_s": first, "latency_s": latency, "tokens": tokens, "tpot_s": tpot}


async def _http_wave(url: str, model: str, prompts, *, clients: int, per_client: int,
                     max_tokens: int, bar=None):
    import openai

    results: list[dict | None] = [None] * (clients * per_client)
    # the client's default pool holds 1000 connections: every client count here gets its own
    async with openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0,
                                  timeout=600) as client:
        async def one(c: int) -> None:
            for k in range(per_client):
                i = c * per_client + k
                results[i] = await _http_request(client, model, prompts[i % len(prompts)],
                                                 max_tokens)
                if bar is not None:
                    bar.update(1)

        # the client object's own first-request set-up (its transport and TLS context, made
        # lazily: 3-35 ms here) is the client's cost, not the server's: paid before the clock
        await client.models.list()
        start = time.perf_counter()
        await asyncio.gather(*(one(c) for c in range(clients)))
        wall = time.perf_counter() - start
    return wall, results


def _http_wave_sync(url: str, model: str, prompts, clients: int, per_client: int,
                    max_tokens: int):
    """:func:`_http_wave` for a client process (no progress bar there)."""
    return asyncio.run(_http_wave(url, model, prompts, clients=clients, per_client=per_client,
                                  max_tokens=max_tokens))


class _Clients:
    """Where the HTTP clients run: ``process`` (one spawned process for every wave of a side's
    engine, so that the clients' work does not share this process's GIL with the server and the
    engine) or ``thread`` (this process's event loop)."""

    def __init__(self, where: str) -> None:
        self._pool = None
        if where == "process":
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    def wave(self, url: str, model: str, prompts, *, clients: int, per_client: int,
             max_tokens: int, bar=None):
        if self._pool is None:
            return asyncio.run(_http_wave(url, model, prompts, clients=clients,
                                          per_client=per_client, max_tokens=max_tokens, bar=bar))
        wall, results = self._pool.submit(_http_wave_sync, url, model, list(prompts), clients,
                                          per_client, max_tokens).result()
        if bar is not None:
            bar.update(len(results))
        return wall, results

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


class _HttpServer:
    """The server's ASGI app around a started engine, on a loopback port, in a thread."""

    def __init__(self, engine, name: str) -> None:
        import socket
        import threading

        import uvicorn

        from moe_runtime.serve.app import create_app

        app = create_app(engine, served_model_name=name, manage_engine=False)
        # IPPROTO_TCP named, so asyncio sets TCP_NODELAY on the connections (see serve's _listen)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning",
                                                    access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="bench-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        if self.thread.is_alive():  # it holds the app, so the engine and the model, alive
            print("warning: the bench's HTTP server thread did not stop within 30 s; its side's "
                  "model stays in memory while it runs", file=sys.stderr, flush=True)


def _captured(engine, before: dict) -> dict:
    """CUDA graphs captured during a measured wave (its steps of shapes warm-up did not reach:
    each one a capture stall inside the measurement), and their seconds."""
    now = engine.graph_captures
    return {"graphs": now["serving"] - before["serving"],
            "seconds": now["serving_s"] - before["serving_s"]}


def _summarize(wall: float, results: list[dict], captured: dict | None = None) -> dict:
    tokens = sum(r["tokens"] for r in results)
    return {
        "captured": captured or {"graphs": 0, "seconds": 0.0},
        "wall_s": wall,
        "requests": len(results),
        "output_tokens": tokens,
        "req_per_s": len(results) / wall,
        "out_tok_per_s": tokens / wall,
        "ttft_s": [r["ttft_s"] for r in results],
        "tpot_s": [r["tpot_s"] for r in results if r["tpot_s"] is not None],
        "latency_s": [r["latency_s"] for r in results],
        "tokens_per_request": sorted({r["tokens"] for r in results}),
    }


def _memory() -> tuple[float, float] | None:
    """(GiB allocated now, most allocated since the last reset) on the current CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.memory_allocated() / 2**30, torch.cuda.max_memory_allocated() / 2**30


def _log_level(args, side: str, mode: str, clients: int, summary: dict) -> None:
    """One JSON line per measured wave, printed and appended to ``OUT/progress.jsonl`` as soon
    as the wave ends, so that a run stopped before the report still leaves its numbers."""
    tpot = summary["tpot_s"]
    line = {"side": side, "mode": mode, "clients": clients, "wall_s": round(summary["wall_s"], 3),
            "out_tok_per_s": round(summary["out_tok_per_s"], 1),
            "ttft_p50_ms": round((_median([t for t in summary["ttft_s"] if t is not None])
                                  or 0) * 1e3, 2),
            "tpot_p50_ms": round((_median(tpot) or 0) * 1e3, 2),
            "tpot_p90_ms": round((_percentile(tpot, 0.9) or 0) * 1e3, 2),
            "graphs_captured": summary["captured"]["graphs"],
            "capture_s": round(summary["captured"]["seconds"], 3)}
    text = json.dumps(line)
    print(text, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "progress.jsonl", "a") as f:
        f.write(text + "\n")


def _run_side(loaded, prompts, args, levels, *, warm_levels: bool, bar, side: str = "") -> dict:
    """Start an engine on ``loaded``, warm it up, measure every client count in every mode,
    shut it down. Returns ``{mode: {clients: (summary, results)}}`` and ``"memory"``."""
    from moe_runtime.serve.engine import Engine

    engine = Engine(loaded, max_batch_size=args.max_batch_size,
                    max_model_len=args.prompt_len + args.max_tokens + 1,
                    gqa_attention=_gqa(args, side), fused_norms=_norms(args, side),
                    fused_rope=_rope(args, side))
    if args.ignore_eos:
        engine.eos_token_ids = []  # every request runs to max_tokens, on both sides alike
    before = _memory()
    if before is not None:
        import torch

        torch.cuda.reset_peak_memory_stats()
    engine.start()
    out: dict = {"graphs": engine.batching.graphs.describe(),
                 "attention": ("grouped-query (moe_runtime/serve/paged_attention.py)"
                               if engine.gqa_attention else "transformers' paged|sdpa"),
                          "norms": ("one kernel each (moe_runtime/serve/fused_norm.py)"
                                    if engine.fused_norms else "the model's own"),
                          "rope": ("one kernel per tensor (moe_runtime/serve/fused_rope.py)"
                                   if engine.fused_rope else "the model's own")}
    warm = dict(per_client=1, max_tokens=min(args.max_tokens, args.warmup_tokens))
    measured = dict(per_client=args.requests_per_client, max_tokens=args.max_tokens, bar=bar)
    try:
        if "in-process" in args.mode_list:
            for c in (levels if warm_levels else levels[-1:]):
                asyncio.run(_wave(engine, prompts, clients=c, **warm))
            out["in-process"] = {}
            for c in levels:
                before_wave = engine.graph_captures
                wall, results = asyncio.run(_wave(engine, prompts, clients=c, **measured))
                out["in-process"][c] = (_summarize(wall, results, _captured(engine, before_wave)),
                                        results)
                _log_level(args, side, "in-process", c, out["in-process"][c][0])
        if "http" in args.mode_list:
            http = _HttpServer(engine, "bench")
            clients = _Clients(args.http_clients)
            try:
                for c in (levels if warm_levels else levels[-1:]):
                    clients.wave(http.url, "bench", prompts, clients=c, **warm)
                out["http"] = {}
                for c in levels:
                    before_wave = engine.graph_captures
                    wall, results = clients.wave(http.url, "bench", prompts, clients=c,
                                                 **measured)
                    out["http"][c] = (_summarize(wall, results,
                                                 _captured(engine, before_wave)), results)
                    _log_level(args, side, "http", c, out["http"][c][0])
            finally:
                clients.close()
                http.close()
    finally:
        after = _memory()
        engine.shutdown()
    if before is not None:
        out["memory"] = {"peak_above_weights_gib": after[1] - before[0]}
    return out


class _Spans:
    """Times of module forwards by kind (attention, MoE, the whole model) and of the sampler,
    grouped by engine step, on the wall clock. On a GPU every mark first synchronizes the device,
    so each part is its launch and its kernels and the parts add up to the step (CUDA events
    between hooks did not: they timed the GPU's idle gaps too); the profiled wave is slower than
    the measured ones for it."""

    def __init__(self, model, sampler) -> None:
        import torch

        self.cuda = next(model.parameters()).is_cuda
        self.steps: list[dict[str, list]] = []
        self.step_starts: list[float] = []
        self._handles = []
        kinds = {"attention": [], "moe": [], "forward": [model]}
        for name, module in model.named_modules():
            if name.endswith(".self_attn"):
                kinds["attention"].append(module)
            elif name.endswith(".mlp") and hasattr(module, "experts"):
                kinds["moe"].append(module)
        for kind, modules in kinds.items():
            for module in modules:
                self._handles.append(module.register_forward_pre_hook(self._pre(kind)))
                self._handles.append(module.register_forward_hook(self._post(kind)))
        self._sampler = sampler
        self._sample, self._rows_for = sampler.sample, sampler.rows_for

        def rows_for(keys):
            self.step_starts.append(time.perf_counter())
            self.steps.append({"attention": [], "moe": [], "forward": [], "sampler": []})
            return self._rows_for(keys)

        def sample(logits, rows, *args, **kwargs):
            start = self._mark()
            tokens = self._sample(logits, rows, *args, **kwargs)
            if self.steps:
                self.steps[-1]["sampler"].append((start, self._mark()))
            return tokens

        sampler.rows_for, sampler.sample = rows_for, sample
        self._torch = torch
        self._open: dict[int, object] = {}

    def _mark(self) -> float:
        if self.cuda:
            self._torch.cuda.synchronize()
        return time.perf_counter()

    def _pre(self, kind):
        def hook(module, args):
            self._open[id(module)] = self._mark()
        return hook

    def _post(self, kind):
        def hook(module, args, output):
            start = self._open.pop(id(module), None)
            if start is not None and self.steps:
                self.steps[-1][kind].append((start, self._mark()))
        return hook

    def close(self) -> dict:
        """Medians over steps (ms per step): each kind's total, and the wall time between steps."""
        for h in self._handles:
            h.remove()
        self._sampler.rows_for, self._sampler.sample = self._rows_for, self._sample
        totals = {k: [sum((b - a) * 1e3 for a, b in step[k]) for step in self.steps]
                  for k in ("attention", "moe", "forward", "sampler")}
        gaps = [(b - a) * 1e3 for a, b in zip(self.step_starts, self.step_starts[1:])]
        out = {f"{k}_ms": _median(v) for k, v in totals.items()}
        out["step_ms"] = _median(gaps)
        out["steps"] = len(self.steps)
        return out


def _gqa(args, side: str) -> bool | None:
    """moe-runtime's side: on with ``--gqa-attention``, else the engine's default (on CUDA: on,
    unless MOE_RUNTIME_GQA_ATTENTION=0); transformers alone always keeps paged|sdpa."""
    return (True if args.gqa_attention else None) if side == SIDES[0] else False


def _norms(args, side: str) -> bool | None:
    """moe-runtime's side: on with ``--fused-norms``, else the engine's default (on CUDA: on,
    unless MOE_RUNTIME_FUSED_NORMS=0); transformers alone always keeps its own norms."""
    return (True if args.fused_norms else None) if side == SIDES[0] else False


def _rope(args, side: str) -> bool | None:
    """moe-runtime's side: on with ``--fused-rope``, else the engine's default (on CUDA: on,
    unless MOE_RUNTIME_FUSED_ROPE=0); transformers alone always keeps its own."""
    return (True if args.fused_rope else None) if side == SIDES[0] else False


def _profile_side(loaded, prompts, args, clients: int, side: str = "") -> dict:
    """One eager wave of ``clients`` requests (graphs off: a graph's inside cannot be timed), with
    the time of every step split into attention, MoE, the rest of the forward, the sampler and
    what is left (the host loop: scheduling, inputs, outputs)."""
    from moe_runtime.serve.engine import Engine

    engine = Engine(loaded, max_batch_size=args.max_batch_size,
                    max_model_len=args.prompt_len + args.max_tokens + 1, cuda_graphs=False,
                    gqa_attention=_gqa(args, side), fused_norms=_norms(args, side),
                    fused_rope=_rope(args, side))
    if args.ignore_eos:
        engine.eos_token_ids = []
    engine.start()
    try:
        asyncio.run(_wave(engine, prompts, clients=clients, per_client=1, max_tokens=4))
        spans = _Spans(loaded.model, engine.sampler)
        try:
            asyncio.run(_wave(engine, prompts, clients=clients, per_client=1,
                              max_tokens=args.max_tokens))
        finally:
            out = spans.close()
    finally:
        engine.shutdown()
    known = [out[k] for k in ("forward_ms", "sampler_ms", "step_ms")]
    if all(v is not None for v in known):
        out["other_forward_ms"] = out["forward_ms"] - out["attention_ms"] - out["moe_ms"]
        out["host_ms"] = out["step_ms"] - out["forward_ms"] - out["sampler_ms"]
    out["clients"] = clients
    return out


def _profiles(loaded, prompts, args, sides=None) -> dict | None:
    """``--profile-clients``'s tables by side (``sides``, default every side); a failure is
    reported, not raised (it comes after the measurements, which are written either way)."""
    if not args.profile_clients:
        return None
    out = {}
    for side in sides or args.side_list:
        try:
            out[side] = _profile_side(loaded[side], prompts, args, args.profile_clients,
                                      side=side)
            print(json.dumps({"profile": side, **out[side]}, default=str), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            print(f"profiling {side} failed: {type(exc).__name__}: {exc}", flush=True)
    return out or None


# ----------------------------------------------------------------------------------- reporting


def _environment(device: str) -> dict:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "host": platform.node(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "device": device}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
        env["cuda"] = torch.version.cuda
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        env["cpu"] = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    env["cpu"] = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    return env


def _side_experts(plan: dict) -> str:
    """What runs the experts, e.g. ``triton (nvfp4_w4a4 as nvfp4_w4a16)``."""
    seen = []
    for layer in plan.get("layers", []):
        experts = layer.get("experts")
        runs_as = layer.get("runs_as")
        fmt = layer.get("format")
        text = str(experts)
        if runs_as and runs_as != fmt and plan.get("loader") == "transformers":
            text += f" ({fmt} dequantized to {runs_as})"
        elif runs_as and runs_as != fmt:
            text += f" ({fmt} run as {runs_as})"
        elif fmt:
            text += f" ({fmt})"
        if text not in seen:
            seen.append(text)
    return "; ".join(seen) or "?"


def _fmt(x, scale=1.0, digits=1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def render_markdown(report: dict) -> str:
    env, work, model = report["environment"], report["workload"], report["model"]
    where = env.get("gpu") or env.get("cpu") or env["device"]
    lines = [
        f"Device: {where} ({env['device']}; torch {env['torch']}, transformers "
        f"{env['transformers']}{', triton ' + env['triton'] if env.get('triton') else ''}; "
        f"{env['cpu_count']} CPU cores, {env['torch_threads']} torch threads). "
        f"Date: {report['date']}.",
        f"Command: `{report['command']}`",
        f"Model: `{model['path']}`: {model['summary']}.",
        f"Workload: prompts of {work['prompt_len']} tokens, {work['max_tokens']} output tokens "
        f"per request ({'EOS ignored' if work['ignore_eos'] else 'stops at EOS'}), greedy; each "
        f"client sends {work['requests_per_client']} request(s) back to back; engine max batch "
        f"{work['max_batch_size']}; {work['repeats']} repetition(s), "
        f"{'one side at a time' if report.get('one_side_at_a_time') else 'sides alternating'}; "
        f"req/s and tok/s are medians over repetitions, TTFT/TPOT over all measured requests"
        + ("; HTTP clients in a process of their own"
           if work.get("http_clients", "thread") == "process" and "http" in work.get("modes", ())
           else "; HTTP clients in the server's process" if "http" in work.get("modes", ())
           else "") + ".",
        "",
    ]
    for side in report["sides"]:
        s = report["side_info"][side]
        mem = ""
        if s.get("weights_gib") is not None:
            mem = (f"; GPU memory: weights {s['weights_gib']:.2f} GiB, at most "
                   f"{s.get('peak_above_weights_gib', 0.0):.2f} GiB more while serving")
        lines.append(f"- `{side}`: experts run by {s['experts']}; loaded in {s['load_s']:.1f} s"
                     f"{mem}; {s.get('graphs', '')}; attention: {s.get('attention')}; "
                     f"norms: {s.get('norms')}; rotary embedding: {s.get('rope')}.")
    lines += ["", "| mode | clients | side | req/s | output tok/s | TTFT p50 (ms) | TTFT p90 (ms) "
              "| TPOT p50 (ms) | TPOT p90 (ms) | tok/s vs transformers | graphs captured in "
              "the waves (s) |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    agg = report["results"]
    for mode in work["modes"]:
        for c in work["clients"]:
            base = agg.get("transformers", {}).get(mode, {}).get(str(c), {}).get(
                "out_tok_per_s")
            for side in report["sides"]:
                a = agg[side][mode][str(c)]
                ratio = (f"{a['out_tok_per_s'] / base:.2f}x" if base and side != "transformers"
                         else "")
                lines.append(
                    f"| {mode} | {c} | {side} | {_fmt(a['req_per_s'], digits=2)} | "
                    f"{_fmt(a['out_tok_per_s'])} | {_fmt(a['ttft_p50_s'], 1e3)} | "
                    f"{_fmt(a['ttft_p90_s'], 1e3)} | {_fmt(a['tpot_p50_s'], 1e3)} | "
                    f"{_fmt(a['tpot_p90_s'], 1e3)} | {ratio} | "
                    f"{a.get('graphs_captured', 0)} ({a.get('capture_s', 0.0):.2f}) |")
    prof = report.get("profile") or {}
    if prof:
        c = next(iter(prof.values()))["clients"]
        lines += ["", f"One eager decode step at {c} clients (CUDA graphs off, medians over "
                      "steps; the host loop is the step's wall time less the model forward and "
                      "the sampler):", "",
                  "| side | step (ms) | attention (ms) | MoE (ms) | rest of forward (ms) "
                  "| sampler (ms) | host loop (ms) |", "| --- | ---: | ---: | ---: | ---: | ---: "
                  "| ---: |"]
        for side, p in prof.items():
            lines.append(f"| {side} | {_fmt(p['step_ms'], digits=2)} | "
                         f"{_fmt(p['attention_ms'], digits=2)} | {_fmt(p['moe_ms'], digits=2)} | "
                         f"{_fmt(p.get('other_forward_ms'), digits=2)} | "
                         f"{_fmt(p['sampler_ms'], digits=2)} | "
                         f"{_fmt(p.get('host_ms'), digits=2)} |")
    eq = report.get("greedy_agreement")
    if eq:
        lines += ["", f"Greedy outputs identical on both sides: {eq['identical']}/{eq['compared']} "
                  f"requests (mean common prefix {eq['mean_common_prefix']:.1f} of "
                  f"{work['max_tokens']} tokens)."]
    return "\n".join(lines) + "\n"


def render_png(report: dict, path: Path) -> bool:
    """Output tokens/s and TPOT p50 against clients, one line per side and mode; False when
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    work, agg = report["workload"], report["results"]
    fig, (tput, tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n, side in enumerate(report["sides"]):
        for mode in work["modes"]:
            xs = work["clients"]
            style = dict(linestyle="-" if mode == "in-process" else "--", marker="o",
                         color=f"C{3 * n}", label=f"{side} ({mode})")
            tput.plot(xs, [agg[side][mode][str(c)]["out_tok_per_s"] for c in xs], **style)
            tpot.plot(xs, [(agg[side][mode][str(c)]["tpot_p50_s"] or 0) * 1e3 for c in xs],
                      **style)
    for ax, title in ((tput, "output tokens/s"), (tpot, "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(work["clients"], [str(c) for c in work["clients"]])
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    tput.legend(fontsize=8)
    env = report["environment"]
    fig.suptitle(f"{report['model']['summary'].split(',')[0]}, "
                 f"{report['model']['summary'].split(',')[1].strip()} on "
                 f"{env.get('gpu') or env.get('cpu') or env['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _agreement(raw: dict, sides: list[str]) -> dict | None:
    """Compare each side's first-repetition greedy tokens (in-process), request by request."""
    if len(sides) != 2 or any("in-process" not in raw[s][0] for s in sides):
        return None
    a, b = (raw[s][0]["in-process"] for s in sides)
    same = compared = 0
    prefixes = []
    for c in a:
        for ra, rb in zip(a[c][1], b[c][1], strict=True):
            x, y = ra["token_ids"], rb["token_ids"]
            compared += 1
            same += x == y
            n = 0
            while n < min(len(x), len(y)) and x[n] == y[n]:
                n += 1
            prefixes.append(n)
    return {"compared": compared, "identical": same,
            "mean_common_prefix": statistics.fmean(prefixes) if prefixes else 0.0}


# ----------------------------------------------------------------------------------- main


def _resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _model_summary(path: Path, plan: dict) -> str:
    cfg = json.loads((path / "config.json").read_text())
    ck = plan.get("checkpoint", {})
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    return (f"{(cfg.get('architectures') or ['?'])[0]}, {cfg.get('num_hidden_layers')} layers, "
            f"hidden {cfg.get('hidden_size')}, {experts} experts top-"
            f"{cfg.get('num_experts_per_tok')}, expert intermediate "
            f"{cfg.get('moe_intermediate_size') or cfg.get('intermediate_size')}, vocab "
            f"{cfg.get('vocab_size')}, {cfg.get('dtype') or cfg.get('torch_dtype')}, quant "
            f"{ck.get('quant_algo') or (cfg.get('quantization_config') or {}).get('quant_algo')}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, metavar="DIR",
                   help="checkpoint folder (default: the embedded default model)")
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda, cuda:1")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    p.add_argument("--clients", default="1,8,32",
                   help="comma-separated concurrent client counts (default 1,8,32)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup-tokens", type=int, default=4)
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="engine max batch (default: the largest client count)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"in-process (the engine), http (the server with the openai client); "
                        f"default {','.join(MODES)}")
    p.add_argument("--http-clients", choices=("process", "thread"), default="process",
                   help="where the http mode's openai clients run: a process of their own "
                        "(default, as real clients), or a thread of the server's process "
                        "(their work then shares its GIL with the server and the engine)")
    p.add_argument("--sides", default=",".join(SIDES),
                   help=f"which sides to run (default {','.join(SIDES)})")
    p.add_argument("--moe-runner-backend", default=None, metavar="NAME",
                   help="pin moe-runtime's experts backend (default: the planner's choice)")
    p.add_argument("--gqa-attention", action="store_true",
                   help="moe-runtime's side attends with moe_runtime/serve/paged_attention.py "
                        "(no repeated keys) in continuous batching's small steps, also off CUDA; "
                        "transformers alone keeps its paged|sdpa (default: the engine's, on for "
                        "CUDA; MOE_RUNTIME_GQA_ATTENTION=0 turns moe-runtime's off)")
    p.add_argument("--fused-norms", action="store_true",
                   help="moe-runtime's side runs the model's RMSNorm modules as one kernel each "
                        "(moe_runtime/serve/fused_norm.py, CUDA); transformers alone keeps its "
                        "own norms (default: the engine's, on for CUDA; "
                        "MOE_RUNTIME_FUSED_NORMS=0 turns moe-runtime's off)")
    p.add_argument("--fused-rope", action="store_true",
                   help="moe-runtime's side runs the rotary embedding as one kernel for the "
                        "queries and one for the keys (moe_runtime/serve/fused_rope.py, CUDA; "
                        "bit-identical); transformers alone keeps its own (default: the engine's, "
                        "on for CUDA; MOE_RUNTIME_FUSED_ROPE=0 turns moe-runtime's off)")
    p.add_argument("--profile-clients", type=int, default=None, metavar="N",
                   help="also time one eager wave of N clients per side, step by step: "
                        "attention, MoE, rest of the forward, sampler, host loop")
    p.add_argument("--one-side-at-a-time", action="store_true",
                   help="load, run and free each side before the next is loaded (for a card that "
                        "cannot hold both sides' weights at once, e.g. 80 GB with a full-depth "
                        "checkpoint whose other side is dequantized to bf16); repetitions do not "
                        "alternate between the sides then")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore it, fixed output lengths)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: clients 1,4, prompt 16, 8 tokens, 1 repetition")
    p.add_argument("--out", default="bench-serve-out", metavar="DIR")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.prompt_len, args.max_tokens = "1,4", 16, 8
        args.requests_per_client, args.repeats = 1, 1
    args.client_levels = sorted({int(c) for c in args.clients.split(",") if c.strip()})
    if not args.client_levels or min(args.client_levels) < 1:
        p.error("--clients needs positive integers")
    args.side_list = [s.strip() for s in args.sides.split(",") if s.strip()]
    bad = [s for s in args.side_list if s not in SIDES]
    if bad or not args.side_list:
        p.error(f"--sides: choose from {', '.join(SIDES)}")
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.mode_list if m not in MODES]
    if bad or not args.mode_list:
        p.error(f"--modes: choose from {', '.join(MODES)}")
    args.max_batch_size = args.max_batch_size or max(args.client_levels)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python " + " ".join([os.path.relpath(__file__)] + list(
        sys.argv[1:] if argv is None else argv))
    from tqdm.auto import tqdm

    from moe_runtime.serve.loading import load_for_serving

    if args.model is None:
        from moe_runtime.serve.default_model import ensure_default_model

        model_dir = ensure_default_model(progress=not args.no_progress)
    else:
        model_dir = Path(args.model)
    device = _resolve_device(args.device)
    levels = args.client_levels

    loaded, info, plans = {}, {}, {}

    def load(side):
        held = _memory()
        start = time.perf_counter()
        loaded[side] = load_for_serving(
            model_dir, device=device, progress=not args.no_progress, dtype=args.dtype,
            moe_runner_backend=args.moe_runner_backend if side == "moe-runtime" else None,
            transformers_experts=side == "transformers")
        if device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
        plans[side] = loaded[side].plan_json()
        info[side] = {"load_s": time.perf_counter() - start,
                      "experts": _side_experts(plans[side]), "plan": plans[side]}
        if held is not None:
            info[side]["weights_gib"] = _memory()[0] - held[0]
        print(f"{side}: loaded in {info[side]['load_s']:.1f} s; experts: {info[side]['experts']}",
              flush=True)

    def free(side):
        import gc
        import threading

        del loaded[side]
        gc.collect()
        if device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
            left = torch.cuda.memory_allocated() / 2**30
            info[side]["allocated_after_free_gib"] = left
            # what a side still holds after it is freed (the 2026-12-07 01:26 run kept 47 GiB)
            print(f"{side}: freed; {left:.2f} GiB still allocated; threads: "
                  f"{[t.name for t in threading.enumerate()]}", flush=True)

    sequential = args.one_side_at_a_time and len(args.side_list) > 1
    for side in (args.side_list[:1] if sequential else args.side_list):
        load(side)
    first = loaded[args.side_list[0]]
    count = max(levels) * args.requests_per_client
    prompts = make_prompts(first.tokenizer, count, args.prompt_len)
    del first
    total = (len(args.side_list) * len(args.mode_list) * args.repeats
             * sum(c * args.requests_per_client for c in levels))
    bar = tqdm(total=total, desc="requests", unit="req", disable=args.no_progress)
    raw: dict[str, list[dict]] = {s: [] for s in args.side_list}
    profiles: dict = {}
    if sequential:
        for side in args.side_list:
            if side not in loaded:
                load(side)
            for rep in range(args.repeats):
                bar.set_postfix_str(f"rep {rep + 1}/{args.repeats} {side}")
                raw[side].append(_run_side(loaded[side], prompts, args, levels,
                                           warm_levels=rep == 0, bar=bar, side=side))
            profiles.update(_profiles({side: loaded[side]}, prompts, args, sides=[side]) or {})
            free(side)
    else:
        for rep in range(args.repeats):
            order = args.side_list if rep % 2 == 0 else list(reversed(args.side_list))
            for side in order:
                bar.set_postfix_str(f"rep {rep + 1}/{args.repeats} {side}")
                raw[side].append(_run_side(loaded[side], prompts, args, levels,
                                           warm_levels=rep == 0, bar=bar, side=side))
        profiles = _profiles(loaded, prompts, args) or {}
    bar.close()

    results: dict[str, dict] = {}
    for side in args.side_list:
        results[side] = {}
        info[side]["graphs"] = raw[side][0]["graphs"]
        for key in ("attention", "norms", "rope"):
            info[side][key] = raw[side][0].get(key)
        peaks = [r["memory"]["peak_above_weights_gib"] for r in raw[side] if "memory" in r]
        if peaks:  # above what the process held when the engine started (every side's weights)
            info[side]["peak_above_weights_gib"] = max(peaks)
        for mode in args.mode_list:
            results[side][mode] = {}
            for c in levels:
                reps = [r[mode][c][0] for r in raw[side]]
                ttft = [t for r in reps for t in r["ttft_s"] if t is not None]
                tpot = [t for r in reps for t in r["tpot_s"]]
                results[side][mode][str(c)] = {
                    "req_per_s": _median([r["req_per_s"] for r in reps]),
                    "out_tok_per_s": _median([r["out_tok_per_s"] for r in reps]),
                    "req_per_s_each": [r["req_per_s"] for r in reps],
                    "ttft_p50_s": _median(ttft),
                    "ttft_p90_s": _percentile(ttft, 0.9),
                    "tpot_p50_s": _median(tpot),
                    "tpot_p90_s": _percentile(tpot, 0.9),
                    "latency_p50_s": _median([x for r in reps for x in r["latency_s"]]),
                    # graphs captured inside the measured waves (all repetitions), seconds
                    "graphs_captured": sum(r["captured"]["graphs"] for r in reps),
                    "capture_s": sum(r["captured"]["seconds"] for r in reps),
                    "tokens_per_request": sorted({n for r in reps
                                                  for n in r["tokens_per_request"]}),
                    "repetitions": [{k: v for k, v in r.items()} for r in reps],
                }

    report = {
        "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "command": command,
        "environment": _environment(device),
        "model": {"path": str(model_dir), "summary": _model_summary(
            Path(model_dir), plans[args.side_list[0]])},
        "workload": {"clients": levels, "prompt_len": args.prompt_len,
                     "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
                     "requests_per_client": args.requests_per_client, "repeats": args.repeats,
                     "modes": args.mode_list, "http_clients": args.http_clients,
                     "max_batch_size": args.max_batch_size, "dtype": args.dtype,
                     "moe_runner_backend": args.moe_runner_backend},
        "sides": args.side_list,
        "side_info": info,
        "results": results,
        "greedy_agreement": _agreement(raw, args.side_list),
        "profile": profiles or None,
        "one_side_at_a_time": sequential,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_serve.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    md = render_markdown(report)
    if render_png(report, out / "bench_serve.png"):
        md += "\n![output tokens/s and TPOT against clients](bench_serve.png)\n"
    (out / "bench_serve.md").write_text(md)
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.fspath(Path(__file__).resolve().parent.parent))
    sys.exit(main())
