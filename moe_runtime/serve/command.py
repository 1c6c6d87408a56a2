"""``moe-runtime serve``: its options and its body. Nothing heavy is imported until it runs."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import textwrap
import threading
from pathlib import Path

import attrs

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


ENV_API_KEY = "MOE_RUNTIME_API_KEY"
DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")  # vllm serve's choices
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEFAULT_SHUTDOWN_TIMEOUT = 5.0
DEFAULT_REQUEST_READ_TIMEOUT = 30.0  # seconds for a request to arrive whole (slowloris)
# exit statuses (docs/serve.md lists them)
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _origins(text: str) -> list[str]:
    """A JSON list (vLLM's form) or comma-separated values."""
    import json

    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("a JSON list of strings is expected")
        return value
    return [v.strip() for v in text.split(",") if v.strip()]


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``moe-runtime serve`` to ``parser`` (and the served families to its
    help). Names follow ``vllm serve`` where the meaning is the same; older names stay as
    aliases."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (served_families_text() + "\n\nThe server listens at once: /health answers "
                     "503 while the model loads and until a first token has been generated "
                     "through the planned model; if that fails it exits 1 with an error naming "
                     "the architecture and the failing module. Exit statuses: 0 stopped, 1 "
                     "failed, 2 bad options, 130 interrupted (Ctrl+C). docs/serve.md lists the "
                     "routes, options, environment variables and metrics.")
    model = parser.add_argument_group("model")
    model.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                       help="a local Hugging Face-format checkpoint folder, or the id of a hub "
                            "model already in the Hugging Face cache (org/name; never "
                            "downloaded). Default: the embedded tiny MoE model, made on first "
                            "use in the user cache")
    model.add_argument("--model", metavar="MODEL", default=None,
                       help="the same as the positional MODEL")
    model.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model id clients send (default: the hub id, or the model "
                            "folder's name)")
    model.add_argument("--tokenizer", default=None, metavar="DIR_OR_ID",
                       help="take the tokenizer from this folder or cached hub id (default: the "
                            "model's); a model without tokenizer files is refused at start")
    model.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                       help="a Jinja chat template file, or the template itself inline; it "
                            "replaces the tokenizer's")
    model.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                       help="sampling defaults for requests that omit them (temperature, "
                            "top_p, top_k, max_tokens from max_new_tokens): auto (default: the "
                            "model's generation_config.json), vllm (none: temperature 1, top_p "
                            "1), or a folder holding a generation_config.json")
    model.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="compute dtype (default auto: the checkpoint's; half = float16, "
                            "float = float32)")
    model.add_argument("--device", default="auto",
                       help="torch device to run on: auto (CUDA when present, else cpu), cpu, "
                            "cuda, cuda:1 ...")
    from moe_runtime.cli import add_plan_arguments

    add_plan_arguments(parser.add_argument_group(
        "planning", "the options of `moe-runtime plan`, with the same meaning: the checkpoint is\n"
        "planned once, for the device serve runs on, and that plan runs every MoE layer"),
        serve=True)
    engine = parser.add_argument_group("batching and memory")
    engine.add_argument("--max-num-seqs", "--max-batch-size", dest="max_batch_size", type=int,
                        default=8, metavar="N",
                        help="most requests decoded together (default 8; --max-batch-size is "
                             "the older name)")
    engine.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                        help="cap on prompt + completion tokens (default: the model's context)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                        help="size the KV cache so that the server holds at most this fraction "
                             "of the device's memory, weights included (a CUDA device's total "
                             "memory; on cpu, physical memory). Default: room for --max-num-seqs "
                             "sequences of --max-model-len tokens")
    engine.add_argument("--kv-cache-tokens", type=int, default=None, metavar="TOKENS",
                        help="size the KV cache in tokens instead (all sequences together)")
    engine.add_argument("--batching", default="auto", choices=BATCHING,
                        help="how requests are batched: auto (default: continuous where "
                             "transformers' paged KV cache holds the model's keys and values, "
                             "else dynamic), continuous (paged cache), dynamic (padded "
                             "DynamicCache)")
    engine.add_argument("--seed", type=int, default=None,
                        help="seed the draws of requests that send no seed, so a restarted "
                             "server answers the same unseeded requests in the same order alike "
                             "(default: fresh randomness)")
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1",
                      help="address to listen on (default 127.0.0.1: this machine only)")
    http.add_argument("--port", type=int, default=8000,
                      help="port to listen on (default 8000; 0 picks a free one)")
    http.add_argument("--api-key", default=os.environ.get(ENV_API_KEY),
                      help="require 'Authorization: Bearer KEY' on every route but /health and "
                           f"/metrics (default: ${ENV_API_KEY}, else no key)")
    http.add_argument("--allowed-origins", type=_origins, default=None, metavar="ORIGINS",
                      help="answer cross-origin (CORS) requests from these origins: a JSON list "
                           "or comma-separated, '*' for any (default: no CORS headers)")
    http.add_argument("--allowed-methods", type=_origins, default=["*"], metavar="METHODS",
                      help="CORS: allowed methods (default '*'; with --allowed-origins)")
    http.add_argument("--allowed-headers", type=_origins, default=["*"], metavar="HEADERS",
                      help="CORS: allowed request headers (default '*'; with --allowed-origins)")
    http.add_argument("--allow-credentials", action="store_true",
                      help="CORS: allow credentials (with --allowed-origins)")
    http.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                      metavar="BYTES",
                      help=f"largest request body accepted; larger ones get 413 (default "
                           f"{DEFAULT_MAX_REQUEST_BYTES})")
    http.add_argument("--request-read-timeout", type=float, default=DEFAULT_REQUEST_READ_TIMEOUT,
                      metavar="SECONDS",
                      help="each request (line, headers and body) must arrive within this long "
                           "of the connection opening or of the previous response; a late one "
                           f"gets 408 and the connection is closed (default "
                           f"{DEFAULT_REQUEST_READ_TIMEOUT:g})")
    http.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                      metavar="SECONDS",
                      help="on SIGTERM or Ctrl+C, wait this long for running requests before "
                           f"closing them (default {DEFAULT_SHUTDOWN_TIMEOUT:g})")
    http.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                      help="log level (default info: one line per request)")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of a start-up failure")


def _kv_sequences(args, model_dir) -> tuple[int, int | None]:
    """``(sequences, tokens each)`` the KV cache will hold (kv_budget's order), for the memory
    check before the weights are read: ``--kv-cache-tokens N`` is N tokens (cut, as the budget
    cuts it, to ``--max-num-seqs`` sequences of the context), ``--max-num-seqs`` sequences of the
    context otherwise. One sequence only where the cache is not allocated at start: with
    ``--gpu-memory-utilization`` it is sized from what is left once the model is loaded, and the
    dynamic cache (the batching path of models the paged cache cannot hold) grows with its
    requests."""
    try:
        from transformers import AutoConfig

        from moe_runtime.serve.batching import CONTINUOUS, choose_batching

        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        paged = choose_batching(config, args.batching).path == CONTINUOUS
        fields = config.get_text_config() if hasattr(config, "get_text_config") else config
        model_len = getattr(fields, "max_position_embeddings", None)
    except Exception:  # noqa: BLE001 - the checkpoint check and the loader report a bad config
        return 1, args.max_model_len
    if not (isinstance(model_len, int) and not isinstance(model_len, bool) and model_len > 0):
        model_len = None  # the engine then takes the tokenizer's length, else 2048
    context = args.max_model_len
    if context is not None and model_len is not None:  # capped, as the engine caps it
        context = min(context, model_len)
    if not paged or args.gpu_memory_utilization is not None:
        return 1, context
    if args.kv_cache_tokens is not None:
        return 1, min(args.kv_cache_tokens, args.max_batch_size * (context or model_len or 2048))
    return args.max_batch_size, context


def _resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket (bound here so --port 0 can be reported and errors are clear).

    Made with ``IPPROTO_TCP`` named: accepted connections inherit the listener's protocol number,
    and asyncio turns Nagle's algorithm off (``TCP_NODELAY``) only on sockets whose protocol is
    ``IPPROTO_TCP``. With the default 0, a kept-alive connection's small stream chunks waited for
    the client's delayed ACKs: every request after a connection's first arrived about 40 ms late,
    its streamed tokens all at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class UsageError(ValueError):
    """An option's value cannot be used; the message names the option (exit status 2)."""


def _check_options(args: argparse.Namespace) -> None:
    if args.model and args.model_tag and args.model != args.model_tag:
        raise UsageError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    if args.max_batch_size < 1:
        raise UsageError(f"--max-num-seqs must be at least 1, got {args.max_batch_size}")
    if args.device != "auto":
        from moe_runtime.environment import Environment

        problem = Environment.device_problem(args.device)
        if problem:
            raise UsageError(f"--device: {problem}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UsageError("--served-model-name is empty: give the name clients send as "
                         "\"model\", or leave it out to serve the folder's name")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must lie in [0, 65535] (0 picks a free one), got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        # an unset variable in `--api-key "$KEY"` must not start a server open to everyone
        source = ("--api-key" if os.environ.get(ENV_API_KEY) != args.api_key
                  else f"${ENV_API_KEY}")
        raise UsageError(f"{source} is empty: give the key clients must send, or leave the "
                         f"option out (and ${ENV_API_KEY} unset) to serve without one")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise UsageError(f"--max-model-len must be at least 2, got {args.max_model_len}")
    util = args.gpu_memory_utilization
    if util is not None and not 0 < util <= 1:
        raise UsageError(f"--gpu-memory-utilization must lie in (0, 1], got {util}")
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < 1:
        raise UsageError(f"--kv-cache-tokens must be at least 1, got {args.kv_cache_tokens}")
    if util is not None and args.kv_cache_tokens is not None:
        raise UsageError("give --gpu-memory-utilization or --kv-cache-tokens, not both")
    if args.max_request_bytes < 1:
        raise UsageError(f"--max-request-bytes must be at least 1, got {args.max_request_bytes}")
    if not args.request_read_timeout > 0 or args.request_read_timeout == float("inf"):
        raise UsageError(f"--request-read-timeout must be a positive number of seconds, got "
                         f"{args.request_read_timeout}")
    if args.shutdown_timeout < 0:
        raise UsageError(f"--shutdown-timeout must not be negative, got {args.shutdown_timeout}")
    if args.seed is not None and not -(2**63) <= args.seed < 2**63:
        raise UsageError(f"--seed must be a signed 64-bit integer, in [{-(2**63)}, {2**63 - 1}] "
                         f"(a request's seed's range), got {args.seed}")
    if args.max_tokens_per_rank < 1:
        raise UsageError(f"--max-tokens-per-rank must be at least 1, got "
                         f"{args.max_tokens_per_rank}")
    if args.ep_size != 1:
        raise UsageError(
            f"--ep-size {args.ep_size}: serve runs one process, so it serves one expert-parallel "
            "rank (--ep-size 1, the default); `moe-runtime plan CHECKPOINT --ep-size "
            f"{args.ep_size}` shows the plan of {args.ep_size} ranks, and load_model(..., "
            f"ep_size={args.ep_size}) runs it on ranks started by torch.distributed")
    from moe_runtime.serve.graph_shapes import async_batching_requested, prefill_graphs_requested

    try:  # read again by the engine; checked here, before any weight is read
        prefill_graphs_requested()
        async_batching_requested()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.target_device:
        from moe_runtime.environment import Environment

        try:
            Environment.for_target(args.target_device)
        except ValueError as exc:
            raise UsageError(f"--target-device: {exc}") from None


def _abort_running(engines: list, sig: int) -> None:
    try:
        name = signal.Signals(sig).name
    except ValueError:  # not a signal number Python names
        name = str(sig)
    for engine in list(engines):
        engine.abort_all(f"the server is shutting down ({name}); the request was not finished")


def check_target_device(target: str, device: str) -> None:
    """Refuse ``--target-device`` unless it describes ``device``, the device serve runs on."""
    from moe_runtime.environment import Environment

    wanted = Environment.for_target(target)
    try:
        here = Environment.probe(device=device)
    except ValueError as exc:
        raise UsageError(f"--device {device}: {exc}") from None
    if (wanted.device, wanted.capability) != (here.device, here.capability):
        raise UsageError(
            f"--target-device {target} describes {wanted.described}, but serve runs on "
            f"{here.described} (--device {device}): serve plans for the device it runs on; "
            f"leave --target-device out, or give one that names this device, and plan for "
            f"another machine with `moe-runtime plan CHECKPOINT --target-device {target}`")


def chat_template_text(value: str) -> str:
    """``--chat-template``: a file's text, or the value itself when it is a Jinja template."""
    try:
        is_file = Path(value).expanduser().is_file()
    except OSError:  # e.g. a template longer than a file name may be
        is_file = False
    if is_file:
        try:
            return Path(value).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--chat-template {value}: cannot be read: {exc}") from None
    if "{{" in value or "{%" in value:
        return value
    raise UsageError(f"--chat-template {value!r} is neither a file nor a Jinja template (one has "
                     "'{{ ... }}' or '{% ... %}')")


@attrs.frozen
class ServeSource:
    """Where the model comes from, resolved before anything heavy is imported."""

    model_dir: Path | None  # None: the embedded default model (made on first use)
    name: str
    tokenizer_dir: Path | None
    chat_template: str | None
    generation_config: str | Path | None
    chat_template_origin: str | None = None  # "--chat-template FILE", as its refusal names it


def resolve_serve_source(args: argparse.Namespace) -> ServeSource:
    """The model, tokenizer, chat template and generation config that ``args`` name."""
    from moe_runtime.serve.model_source import SourceError, resolve_source

    spec = args.model or args.model_tag
    try:
        model_dir = resolve_source(spec) if spec else None
        tokenizer_dir = (resolve_source(args.tokenizer, what="tokenizer", need_config=False)
                         if args.tokenizer else None)
        gen = args.generation_config
        if gen not in ("auto", "vllm", "none"):
            gen = resolve_source(gen, what="--generation-config", need_config=False)
            if not (gen / "generation_config.json").is_file():
                raise SourceError(f"--generation-config {args.generation_config}: the folder has "
                                  "no generation_config.json; accepted: auto, vllm, or a folder "
                                  "holding one")
    except SourceError as exc:
        raise UsageError(str(exc)) from None
    if spec is None:
        from moe_runtime.serve.default_model import DEFAULT_MODEL_NAME

        name = DEFAULT_MODEL_NAME
    else:
        is_folder = Path(spec).expanduser().is_dir()
        name = model_dir.name if is_folder else spec.partition("@")[0]
    template = chat_template_text(args.chat_template) if args.chat_template else None
    origin = None
    if template is not None:
        origin = ("--chat-template (the inline template)" if template == args.chat_template
                  else f"--chat-template {args.chat_template}")
    return ServeSource(model_dir, args.served_model_name or name, tokenizer_dir, template,
                       None if gen in ("vllm", "none") else gen, origin)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until stopped; returns the exit status (0, 1, 2 or 130; see the --help epilog)."""
    try:
        return _run_serve(args)
    except KeyboardInterrupt:  # Ctrl+C before the server took over the signal, or after
        print("moe-runtime serve: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run_serve(args: argparse.Namespace) -> int:
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("moe_runtime.serve")
    try:
        _check_options(args)
        if args.target_device:  # looks at the device (imports torch) only when one is given
            check_target_device(args.target_device, _resolve_device(args.device))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        source = resolve_serve_source(args)
    except UsageError as exc:  # a model, tokenizer or template that cannot be found or read
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    try:
        sock = _listen(args.host, args.port)
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return EXIT_FAILED

    with sock:
        try:
            return _serve_on(sock, args, source, level, log)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # one paragraph, not a traceback (unless --debug)
            if args.debug:
                raise
            print(f"error: serving failed: {type(exc).__name__}: {exc} (run with "
                  "--debug for the traceback)", file=sys.stderr)
            return EXIT_FAILED


class _StartupFailure(Exception):
    """Loading or the first token failed; the message is the one paragraph to print."""


def _load_engine(args: argparse.Namespace, source: ServeSource, log):
    """Load the model, size the KV cache and start the engine (on the loading thread)."""
    from moe_runtime.serve.batching import BatchingError
    from moe_runtime.serve.engine import Engine, context_length_of
    from moe_runtime.serve.kv_budget import BudgetError, kv_budget
    from moe_runtime.serve.loading import LoadError, load_for_serving

    model_dir = source.model_dir
    if model_dir is None:
        from moe_runtime.serve.default_model import ensure_default_model

        model_dir = ensure_default_model()
    if args.seed is not None:
        import random

        import torch

        random.seed(args.seed)
        torch.manual_seed(args.seed)
    device = _resolve_device(args.device)
    from moe_runtime.cli import deployment_from_args

    try:
        loaded = load_for_serving(
            model_dir, device=device, deployment=deployment_from_args(args), progress=True,
            dtype=args.dtype, tuning_cache=args.tuning_cache,
            token_ranges=args.token_ranges,
            tokenizer=source.tokenizer_dir, chat_template=source.chat_template,
            chat_template_origin=source.chat_template_origin,
            generation_config=source.generation_config,
            kv_sequences=_kv_sequences(args, model_dir),
            # the command line's -p no:NAME and kin (moe-runtime serve); else the environment
            plugin_options=getattr(args, "plugin_options", None))
    except LoadError as exc:
        raise _StartupFailure(_grouped(str(exc))) from None
    for note in getattr(loaded.plan, "notes", ()):  # the tuning cache read, or why ignored
        log.info("plan: %s", note)
    if loaded.generation_defaults:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(loaded.generation_defaults.items()))
        log.info("sampling defaults from generation_config.json for requests that omit them: %s",
                 shown)
    try:
        context = context_length_of(loaded, args.max_model_len)
        if args.max_model_len is not None and args.max_model_len > context:
            log.warning("--max-model-len %d is past the model's context of %d tokens: "
                        "requests get at most %d", args.max_model_len, context, context)
        from moe_runtime.serve.batching import CONTINUOUS, choose_batching

        budget = kv_budget(config=loaded.model.config, dtype_bytes=loaded.model.dtype.itemsize,
                           device=device, context_length=context,
                           max_num_seqs=args.max_batch_size,
                           kv_cache_tokens=args.kv_cache_tokens,
                           gpu_memory_utilization=args.gpu_memory_utilization,
                           allocated_up_front=choose_batching(
                               loaded.model.config, args.batching).path == CONTINUOUS)
        engine = Engine(loaded, max_batch_size=args.max_batch_size,
                        max_model_len=args.max_model_len, batching=args.batching,
                        debug=args.debug, kv_cache_tokens=budget.tokens, seed=args.seed)
    except (BatchingError, BudgetError) as exc:
        raise _StartupFailure(str(exc)) from None
    log.info("batching: %s", engine.batching.describe())
    log.info("KV cache: %s; room for %d sequence(s) of the full %d-token context",
             budget.describe(), budget.tokens // context, context)
    engine.start(probe=False)
    return engine


def _grouped(message: str) -> str:
    """A planner refusal with one line per layer, as ``moe-runtime plan`` groups it."""
    try:
        from moe_runtime.cli import group_layer_lines
    except ImportError:  # pragma: no cover
        return message
    return "\n".join(group_layer_lines(message.splitlines()))


def _serve_on(sock: socket.socket, args: argparse.Namespace, source: ServeSource, level: int,
              log) -> int:
    import uvicorn

    from moe_runtime.serve.app import CorsOptions, create_app
    from moe_runtime.serve.engine import ReadinessError
    from moe_runtime.serve.http_protocol import protocol_with_read_deadline

    cors = None
    if args.allowed_origins:
        cors = CorsOptions(args.allowed_origins, args.allowed_methods, args.allowed_headers,
                           args.allow_credentials)
    # The app answers at once (503 while loading); the model loads on a thread and is attached.
    app = create_app(None, served_model_name=source.name, api_key=args.api_key,
                     max_request_bytes=args.max_request_bytes, manage_engine=False, cors=cors)
    server_state = app.state.server
    config = uvicorn.Config(app, log_config=None, log_level=level, access_log=False,
                            lifespan="on", timeout_graceful_shutdown=args.shutdown_timeout,
                            http=protocol_with_read_deadline(args.request_read_timeout,
                                                             server_state.metrics))
    server = uvicorn.Server(config)
    signals: list[int] = []  # what stopped the server, seen as uvicorn's handler receives it
    uvicorn_handle_exit = server.handle_exit

    def handle_exit(sig, frame) -> None:
        if not signals:
            # a little before uvicorn's graceful-shutdown deadline cancels the running requests
            # (a traceback each, and a cut stream or an empty reply), answer them: a 503, or a
            # stream's error event, and an access line, as the engine is stopping
            delay = max(0.0, args.shutdown_timeout - min(1.0, args.shutdown_timeout / 2))
            timer = threading.Timer(delay, _abort_running, (engines, sig))
            timer.daemon = True
            timer.start()
        signals.append(sig)
        uvicorn_handle_exit(sig, frame)

    # uvicorn re-raises the SIGINT it shut down for from inside asyncio.run, whose own SIGINT
    # handling may swallow it when the serving task is already finishing: read it here instead
    server.handle_exit = handle_exit
    failure: list[str] = []
    engines: list = []
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host

    stopping: list[bool] = []  # set, under the lock, once the server stopped
    ready: list[bool] = []  # set once the first token was generated
    lock = threading.Lock()

    def fail(message: str, debug: bool = False) -> None:
        with lock:
            # Stopped (Ctrl+C, SIGTERM) while the first token was generated: the main thread shut
            # the engine down under the probe, whose failure is the stop's doing, not the
            # model's. Reported, it turned a Ctrl+C into exit 1 and "cannot serve".
            if stopping:
                return
            if debug and args.debug:
                import traceback

                traceback.print_exc()
            failure.append(message)

    def load_and_probe() -> None:
        try:
            engine = _load_engine(args, source, log)
            with lock:  # an engine finished after the stop is shut down here, not left running
                if stopping:
                    engine.shutdown()
                    return
                engines.append(engine)
            if server.should_exit:
                return
            # sampling defaults are known only now: the app reads them from the server state
            server_state.defaults = dict(engine.loaded.generation_defaults)
            server_state.attach(engine)
            log.info("serving %r (%d MoE layers, context %d tokens) at http://%s:%d/v1%s (ready "
                     "once a first token is generated)", source.name,
                     len(engine.loaded.checkpoint.moe_layers), engine.context_length, shown,
                     port, " (API key required)" if args.api_key else "")
            seconds = engine.probe()
        except (_StartupFailure, ReadinessError) as exc:
            fail(str(exc))
        except Exception as exc:
            fail(f"serving failed: {type(exc).__name__}: {exc}" +
                 ("" if args.debug else " (run with --debug for the traceback)"), debug=True)
        else:
            log.info("ready: the first token took %.2f s", seconds)
            ready.append(True)
            return
        server.should_exit = True

    loader = threading.Thread(target=load_and_probe, name="moe-runtime-loader", daemon=True)
    interrupted = False
    # Ctrl+C goes to uvicorn's shutdown from here on, also before uvicorn installs its own
    # handler: otherwise asyncio.run's default handling cancels the serving task in that window
    # (mid-startup), which left the process without an exit in whole-suite test runs
    # (signal handlers can be set from the main thread only: an embedder's thread keeps its own)
    main_thread = threading.current_thread() is threading.main_thread()
    previous_sigint = signal.signal(signal.SIGINT, handle_exit) if main_thread else None
    try:
        # From this line on a Ctrl+C is this try's (until server.run hands it to uvicorn): one
        # arriving as the loading thread starts ends here, through the os._exit below, never by
        # finalizing the interpreter under a thread importing torch
        log.info("listening at http://%s:%d (/health answers 503 until the model is loaded and "
                 "has generated a first token)", shown, port)
        loader.start()
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down for
        interrupted = True
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous_sigint)
        with lock:
            stopping.append(True)
            started = list(engines)
        for engine in started:
            engine.shutdown()
    interrupted = interrupted or signal.SIGINT in signals
    if failure:
        print(f"error: {failure[0]}", file=sys.stderr)
        code = EXIT_FAILED
    elif interrupted:
        log.info("interrupted: stopped")
        code = EXIT_INTERRUPTED
    else:
        code = EXIT_OK if server.started else EXIT_FAILED
    if loader.is_alive() or (interrupted and not ready):
        # stopped while the model loads: the loading thread cannot be interrupted, and letting
        # the interpreter finalize under it (or under the threads and event loops of an engine
        # stopped before its first token) can crash or print a traceback; leave at once
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
