"""``moe-runtime serve``: its options and its body. Nothing heavy is imported until it runs."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import textwrap
import threading

LOG_LEVELS = ("debug", "info", "warning", "error")
BATCHING = ("auto", "continuous", "dynamic")  # moe_runtime.serve.batching.CHOICES, without torch


def served_families_text() -> str:
    """The families ``serve`` serves and refuses, from the architecture table (for --help, docs)."""
    from moe_runtime.checkpoint.architectures import served_families, unserved_families

    lines = ["model families served (config.json architectures):"]
    lines += [f"  {family}: {', '.join(names)}" for family, names in served_families().items()]
    by_reason: dict[str, list[str]] = {}
    for family, reason in unserved_families().items():
        by_reason.setdefault(reason, []).append(family)
    for reason, families in by_reason.items():
        lines += textwrap.wrap(f"refused at start-up: {', '.join(families)}: {reason}", width=96,
                               subsequent_indent="  ")
    return "\n".join(lines)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``moe-runtime serve`` to ``parser`` (and the served families to its
    help)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (served_families_text() + "\n\nThe server answers /health with 503 until a "
                     "first token has been generated through the planned model; if that fails it "
                     "exits with an error naming the architecture and the failing module.")
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="a local Hugging Face-format checkpoint folder (default: the embedded "
                             "tiny MoE model, made on first use in the user cache)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000,
                        help="port to listen on (default 8000; 0 picks a free one)")
    parser.add_argument("--moe-runner-backend", default=None, metavar="NAME",
                        help="pin the experts backend (default: the planner's choice per layer)")
    parser.add_argument("--moe-a2a-backend", default=None, metavar="NAME",
                        help="pin the communication backend (default: the planner's choice)")
    parser.add_argument("--device", default="auto",
                        help="torch device to run on: auto (CUDA when present, else cpu), cpu, "
                             "cuda, cuda:1 ...")
    parser.add_argument("--dtype", default="auto",
                        choices=("auto", "bfloat16", "float16", "float32"),
                        help="compute dtype (default auto: the checkpoint's)")
    parser.add_argument("--max-batch-size", type=int, default=8, metavar="N",
                        help="most requests decoded together (default 8)")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                        help="cap on prompt + completion tokens (default: the model's context)")
    parser.add_argument("--api-key", default=os.environ.get("MOE_RUNTIME_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "(default: $MOE_RUNTIME_API_KEY, else no key)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model id clients send (default: the model folder's name)")
    parser.add_argument("--batching", default="auto", choices=BATCHING,
                        help="how requests are batched: auto (default: continuous where "
                             "transformers' paged KV cache holds the model's keys and values, "
                             "else dynamic), continuous (paged cache), dynamic (padded "
                             "DynamicCache)")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        help="log level (default info: one line per request)")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of a start-up failure")


def _resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket (bound here so --port 0 can be reported and errors are clear)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, start the engine and serve until interrupted. Returns the exit status."""
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("moe_runtime.serve")

    if args.max_batch_size < 1:
        print(f"error: --max-batch-size must be at least 1, got {args.max_batch_size}",
              file=sys.stderr)
        return 2
    if args.max_model_len is not None and args.max_model_len < 2:
        print(f"error: --max-model-len must be at least 2, got {args.max_model_len}",
              file=sys.stderr)
        return 2
    try:
        sock = _listen(args.host, args.port)
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1

    with sock:
        try:
            return _serve_on(sock, args, level, log)
        except Exception as exc:  # one paragraph, not a traceback (unless --debug)
            if args.debug:
                raise
            print(f"error: serving failed: {type(exc).__name__}: {exc} (run with "
                  "--debug for the traceback)", file=sys.stderr)
            return 1


def _serve_on(sock: socket.socket, args: argparse.Namespace, level: int, log) -> int:
    from moe_runtime.serve.loading import LoadError, load_for_serving

    model_dir, name = args.model, args.served_model_name
    if model_dir is None:
        from moe_runtime.serve.default_model import DEFAULT_MODEL_NAME, ensure_default_model

        model_dir = ensure_default_model()
        name = name or DEFAULT_MODEL_NAME
    try:
        loaded = load_for_serving(
            model_dir,
            device=_resolve_device(args.device),
            moe_runner_backend=args.moe_runner_backend,
            moe_a2a_backend=args.moe_a2a_backend,
            progress=True,
            dtype=args.dtype,
        )
    except LoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    import uvicorn

    from moe_runtime.serve.app import create_app
    from moe_runtime.serve.batching import BatchingError
    from moe_runtime.serve.engine import Engine, ReadinessError

    try:
        engine = Engine(loaded, max_batch_size=args.max_batch_size,
                        max_model_len=args.max_model_len, batching=args.batching,
                        debug=args.debug)
    except BatchingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    log.info("batching: %s", engine.batching.describe())
    engine.start(probe=False)
    name = name or loaded.name
    # The app does not manage the engine: it is started here, probed on a thread while /health
    # answers 503, and stopped after the server.
    app = create_app(engine, served_model_name=name, api_key=args.api_key, manage_engine=False)
    config = uvicorn.Config(app, log_config=None, log_level=level, access_log=False,
                            lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    failure: list[ReadinessError] = []

    def probe() -> None:
        try:
            seconds = engine.probe()
        except ReadinessError as exc:
            failure.append(exc)
            server.should_exit = True
            return
        log.info("ready: the first token took %.2f s", seconds)

    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    log.info("serving %r (%d MoE layers, context %d tokens) at http://%s:%d/v1%s (ready once a "
             "first token is generated)", name, len(loaded.plan.get("layers", [])),
             engine.context_length, shown, port, " (API key required)" if args.api_key else "")
    threading.Thread(target=probe, name="moe-runtime-readiness", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    if failure:
        print(f"error: {failure[0]}", file=sys.stderr)
        return 1
    return 0 if server.started else 1
