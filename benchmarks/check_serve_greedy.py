"""Greedy tokens of ``moe-runtime serve`` against transformers' own ``generate``, on CPU or GPU.

One command::

    python benchmarks/check_serve_greedy.py RESULTS.json [--device cuda] [--model DIR]

Without ``--model`` it makes a tiny DeepSeek-V3 ModelOpt export (W4A16_NVFP4: its dequantized
weights are exactly what the experts compute with) with tokenizer files in a temporary folder.
It starts a real ``moe-runtime serve`` on loopback, waits for ``/health``, sends every prompt alone
and then all at once (one batch), and compares each completion's token ids with ``generate`` on
the same checkpoint in this process (ModelOpt weights dequantized into transformers' experts).
RESULTS.json gets the batching line the server logged, the plan's experts backends, every prompt's
tokens from both sides and the first position where they differ. Exit status 0 when every
completion equals ``generate``, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = ["The quick brown fox", "Hello, world! How are you?", "Numbers 0 1 2 3 4 5",
           "Once upon a time there was a small model", "The server listens on a port"]
READY = re.compile(r"serving '(?P<name>[^']+)' .* at (?P<url>http://\S+/v1)")


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _start_server(model: Path, args) -> tuple[subprocess.Popen, list[str], str, str]:
    cmd = [sys.executable, "-m", "moe_runtime.serve", "--model", str(model), "--port", "0",
           "--device", args.device, "--dtype", args.dtype, "--max-batch-size",
           str(len(PROMPTS))]
    if args.moe_runner_backend:
        cmd += ["--moe-runner-backend", args.moe_runner_backend]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines: list[str] = []
    found: dict[str, str] = {}
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            m = READY.search(line)
            if m and not ready.is_set():
                found.update(m.groupdict())
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(args.timeout) or not found:
        proc.kill()
        raise SystemExit("the server did not start:\n" + "\n".join(lines[-40:]))
    return proc, lines, found["url"], found["name"]


def _wait_healthy(root: str, proc: subprocess.Popen, lines: list[str], timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{root}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise SystemExit("the server never became ready:\n" + "\n".join(lines[-40:]))


def _reference(model: Path, args) -> dict[str, list[int]]:
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from moe_runtime.integration.transformers import load_model

    model_obj = load_model(model, dequantize_experts=True, device=args.device,
                           dtype=args.dtype).model.eval()
    if (model / "generation_config.json").is_file():
        model_obj.generation_config = GenerationConfig.from_pretrained(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    pad = model_obj.generation_config.pad_token_id
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            gen = model_obj.generate(torch.tensor([ids], device=args.device), do_sample=False,
                                     max_new_tokens=args.tokens, pad_token_id=pad)
        out[prompt] = gen[0, len(ids):].tolist()
    del model_obj
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="where to write the JSON results")
    parser.add_argument("--model", type=Path, default=None,
                        help="a checkpoint folder with tokenizer files (default: a tiny "
                             "DeepSeek-V3 W4A16_NVFP4 ModelOpt export, made here)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--moe-runner-backend", default=None,
                        help="pin the experts backend of the server (default: the planner's)")
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for start-up")
    args = parser.parse_args(argv)

    import openai

    with tempfile.TemporaryDirectory(prefix="check-serve-greedy-") as tmp:
        model = args.model
        if model is None:
            from moe_runtime.serve.default_model import make_default_model

            model = make_default_model(Path(tmp) / "tiny-deepseek-v3", quant="w4a16_nvfp4",
                                       arch="deepseek_v3")
        proc, lines, url, name = _start_server(model, args)
        try:
            _wait_healthy(url.removesuffix("/v1"), proc, lines, args.timeout)
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

            def served(prompt: str) -> list[int]:
                out = client.completions.create(model=name, prompt=prompt, max_tokens=args.tokens,
                                                temperature=0,
                                                extra_body={"return_token_ids": True})
                return out.choices[0].model_extra["token_ids"]

            alone = {p: served(p) for p in PROMPTS}
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                together = dict(zip(PROMPTS, pool.map(served, PROMPTS)))
            plan = client.get("/moe/plan", cast_to=object)
        finally:
            proc.terminate()
            proc.wait(30)
        expected = _reference(model, args)

    import torch
    import transformers

    rows = []
    for prompt in PROMPTS:
        for mode, tokens in (("alone", alone[prompt]), ("batched", together[prompt])):
            rows.append({"prompt": prompt, "mode": mode, "served": tokens,
                         "generate": expected[prompt],
                         "equal": tokens == expected[prompt],
                         "first_difference": _first_difference(tokens, expected[prompt])})
    result = {
        "model": str(args.model or "tiny DeepSeek-V3 W4A16_NVFP4 (made by this script)"),
        "device": args.device,
        "device_name": (torch.cuda.get_device_name(torch.device(args.device))
                        if args.device.startswith("cuda") else platform.processor() or "cpu"),
        "dtype": args.dtype,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "batching": [line.split("batching: ", 1)[1] for line in lines if "batching: " in line],
        "experts_backends": sorted({layer.get("experts") for layer in plan.get("layers", [])}),
        "all_equal": all(r["equal"] for r in rows),
        "rows": rows,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    equal = sum(r["equal"] for r in rows)
    print(f"{equal}/{len(rows)} completions equal transformers' generate; wrote {args.results}")
    return 0 if result["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
