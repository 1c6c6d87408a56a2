"""``moe-runtime tune`` and ``plan --tuning-cache``: the command line of the tuning cache."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import attrs

from moe_runtime.tuning.cache import (
    ENV_VAR,
    CacheFormatError,
    OutdatedCacheError,
    Section,
    Tuning,
    cache_key,
    default_cache_path,
    load_tuning,
    merge,
    problem_key,
    read_sections,
    write_sections,
)

DEFAULT_LOCATION = (f"${ENV_VAR}, else tuning.json under $XDG_CACHE_HOME/moe-runtime or "
                    "~/.cache/moe-runtime")


# ------------------------------------------------------------------------------------- plan


def add_tuning_cache_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tuning-cache", default=None, metavar="PATH",
                   help="measurements of `moe-runtime tune` that break ties between equally exact "
                        f"experts backends (default: {DEFAULT_LOCATION}, when it exists; 'none': "
                        "no measurements)")
    p.add_argument("--token-ranges", action="store_true",
                   help="with a tuning cache: run each measured batch size on the experts backend "
                        "measured fastest there (more than 5%% faster than the layer's choice), "
                        "among backends on the same path; each such backend holds its own "
                        "prepared copy of the layer's weights (the plan's memory estimate counts "
                        "them). Without it one backend serves every batch size")


def tuning_for(args, environment, registry, environ=None) -> Tuning:
    """The tuning a ``plan`` reads: ``--tuning-cache``, else the default location. The default
    is skipped for a described target (``--target-device``): no machine measured it."""
    tuning = _tuning_for(args, environment, registry, environ)
    if getattr(args, "token_ranges", False):
        if tuning.cache is None:
            return attrs.evolve(tuning, notes=(*tuning.notes, (
                "--token-ranges: no usable tuning cache, so one experts backend serves every "
                "batch size (measure with `moe-runtime tune CHECKPOINT` first)")))
        return attrs.evolve(tuning, token_ranges=True)
    return tuning


def _tuning_for(args, environment, registry, environ=None) -> Tuning:
    given = getattr(args, "tuning_cache", None)
    if given is not None:
        if given.strip().lower() in ("", "none"):  # as $MOE_RUNTIME_TUNING_CACHE reads them
            return Tuning()
        return load_tuning(given, environment, registry)
    if environment.available is None:
        return Tuning()
    import os

    environ = os.environ if environ is None else environ
    return load_tuning(default_cache_path(environ), environment, registry,
                       explicit=ENV_VAR in environ)


# ------------------------------------------------------------------------------------- tune


def add_tune_command(sub) -> None:
    p = sub.add_parser(
        "tune", help="time every experts backend that could run each layer shape; write a cache",
        description="For each distinct MoE layer shape of a checkpoint (a folder of config files "
        "is enough) and each token count, time every experts backend the planner finds for it on "
        "this machine (random weights of the layer's format, random routing, the backends' real "
        "prepare and forward), and write the medians to a tuning cache that `plan` reads to break "
        "ties between equally exact backends. See docs/tuning.md.")
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("--tokens", default="1,16,128,1024,4096", metavar="N,N,...",
                   help="token counts per batch to time (default 1,16,128,1024,4096)")
    p.add_argument("--cache", default=None, metavar="PATH",
                   help=f"the cache to write into (default: {DEFAULT_LOCATION})")
    p.add_argument("--repeats", type=int, default=20, metavar="N",
                   help="timed calls per measurement, median taken (default 20)")
    p.add_argument("--warmup", type=int, default=3, metavar="N",
                   help="untimed calls first (default 3; at least 1: the first call compiles "
                        "and caches kernels, which must not be timed)")
    p.add_argument("--budget", type=float, default=10.0, metavar="SECONDS",
                   help="fewer repeats (at least 3, or --repeats if fewer) where they would take "
                        "longer (default 10)")
    p.add_argument("--backends", default=None, metavar="NAME,...",
                   help="time only these experts backends (default: every candidate)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: CUDA when present)")
    p.add_argument("--graph-max-tokens", type=int, default=None, metavar="N",
                   help="token counts up to N are also timed as CUDA-graph replays, where the "
                        "candidate captures (default 1024, as engines capture decode batches; "
                        "0: eager calls only)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights and routing each candidate is timed on "
                        "(default 0: the same inputs on every run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_tune)


def _counts(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]  # an empty entry ("1,,2") is a typo
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"error: {flag} takes positive integers separated by commas, e.g. "
                         f"1,16,128; got {text!r}")
    return sorted(set(values))


class _LineProgress:
    """A progress line on stderr, where tqdm is not installed."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.n, self.desc = total, 0, desc

    def update(self, n: int = 1) -> None:
        self.n += n
        print(f"\r{self.desc}: {self.n}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr)


def progress_bar(total: int, desc: str, enabled: bool = True):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return _LineProgress(total, desc)
    return tqdm(total=total, desc=desc, unit="timing", file=sys.stderr)


_LARGEST_CACHE = 256 << 20  # bytes; a cache of every shape of every model is far smaller


def _existing(path: Path, *, warn: bool = True) -> list[Section]:
    """The sections already in the cache at ``path`` (none where there is no file, or an outdated
    cache, which is replaced). A file that is not a tuning cache is never written over: it may be
    anything (a checkpoint's config.json, its weights), so that is an error, raised before any
    timing is done."""
    if not path.is_file():
        return []
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    if size > _LARGEST_CACHE:  # a checkpoint's weights, not a cache: not read into memory
        raise SystemExit(f"error: {path} exists and is not a tuning cache ({size} bytes, where a "
                         "cache holds kilobytes); it is not written over: name a new file (or a "
                         "tuning cache) with --cache, or remove it")
    try:
        return read_sections(path)
    except OutdatedCacheError as exc:
        if warn:
            print(f"warning: {path} is an outdated tuning cache ({exc}); it is replaced",
                  file=sys.stderr)
        return []
    except CacheFormatError as exc:
        if _tuning_schema(path):  # ours, with a bad record: its measurements are lost anyway
            if warn:
                print(f"warning: {path} is a damaged tuning cache ({exc}); it is replaced",
                      file=sys.stderr)
            return []
        try:
            with open(path, "rb") as f:  # readable (one byte: it may be gigabytes of weights)
                f.read(1)
            what = "exists and is not a tuning cache"
        except OSError:
            what = "cannot be read"
        raise SystemExit(f"error: {path} {what} ({exc}); it is not written over: name a new "
                         "file (or a tuning cache) with --cache, or remove it") from None


def _tuning_schema(path: Path) -> bool:
    """Whether the JSON file at ``path`` says it is a moe-runtime tuning cache (any schema)."""
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    schema = data.get("schema") if isinstance(data, dict) else None
    return isinstance(schema, str) and schema.startswith("moe-runtime-tuning/")


def print_results(shapes, measurements, file=None) -> None:
    """Per layer shape: one line per token count, candidates fastest first."""
    from moe_runtime.tuning.measure import TUNED_EP_SIZE

    file = file or sys.stdout
    for shape in shapes:
        p = shape.problem
        head = (f"{p.format} {p.activation} experts {p.num_experts} top-{p.top_k} hidden "
                f"{p.hidden_size} intermediate {p.intermediate_size} {p.dtype} ({p.name})")
        if shape.skipped:
            print(f"{head}: not tuned: {shape.skipped}", file=file)
            continue
        print(head, file=file)
        mine = [m for m in measurements if m.problem == problem_key(p, TUNED_EP_SIZE)]
        for t in sorted({m.tokens for m in mine}):
            row = sorted((m for m in mine if m.tokens == t),
                         key=lambda m: (m.median_us is None, m.median_us or 0.0))
            cells = [f"{m.candidate['experts']} {_how(m)}" for m in row]
            print(f"  {t:>6} tokens: " + ", ".join(cells), file=file)


def _how(m) -> str:
    """A measurement's time and how it was taken, for the table."""
    if m.median_us is None:
        return f"failed ({m.error})"
    if m.graphed:
        return f"{m.median_us:.1f} us graph (eager {m.eager_us:.1f} us)"
    return f"{m.median_us:.1f} us {m.timed.replace(': ', ' (', 1)})"


def run_tune(args) -> int:
    from moe_runtime.checkpoint import CheckpointError, read_checkpoint
    from moe_runtime.checkpoint.problems import problems_from_checkpoint
    from moe_runtime.cli import load_registry
    from moe_runtime.environment import Environment
    from moe_runtime.tuning.measure import GRAPH_MAX_TOKENS, Timer, shapes_to_tune, tune

    tokens = _counts(args.tokens, "--tokens")
    for flag, value in (("--repeats", args.repeats), ("--warmup", args.warmup)):
        if value < 1:
            raise SystemExit(f"error: {flag} must be at least 1, got {value}")
    if not (math.isfinite(args.budget) and args.budget >= 0):
        raise SystemExit("error: --budget must be a finite number of seconds, 0 or more, got "
                         f"{args.budget}")
    graph_max = getattr(args, "graph_max_tokens", None)
    graph_max = GRAPH_MAX_TOKENS if graph_max is None else graph_max
    if graph_max < 0:
        raise SystemExit(f"error: --graph-max-tokens must be 0 (no graphs) or more, got {graph_max}")
    path = Path(args.cache).expanduser() if args.cache else default_cache_path()
    if path is None:
        raise SystemExit(f"error: {ENV_VAR} switches the default cache off; name one with --cache")
    if path.exists() and not path.is_file():
        raise SystemExit(f"error: the tuning cache {path} exists and is not a file; name a file "
                         "with --cache")
    _existing(path, warn=False)  # a file that is not a tuning cache: refused before any timing
    try:
        ckpt = read_checkpoint(args.checkpoint)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    registry = load_registry(args)
    env = Environment.probe(device=args.device, modules=registry.required_modules())
    device = args.device or env.device
    backends = [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends else None
    if backends == []:
        raise SystemExit(f"error: --backends takes experts backend names separated by commas, got "
                         f"{args.backends!r}; registered: {', '.join(sorted(registry.experts))}")
    unknown = sorted(set(backends or ()) - set(registry.experts))
    if unknown:
        raise SystemExit(f"error: --backends {', '.join(unknown)}: not registered experts "
                         f"backends; registered: {', '.join(sorted(registry.experts))}")
    shapes = shapes_to_tune(problems_from_checkpoint(ckpt), registry=registry, environment=env,
                            tokens=tokens, backends=backends)
    total = sum(len(s.plans) for s in shapes) * len(tokens)
    print(f"tuning {len(shapes)} layer shape(s), {total} measurements, on {env.described}",
          file=sys.stderr)
    bar = progress_bar(total, "tune", enabled=not args.no_progress)
    try:
        found = tune(shapes, tokens, registry=registry, device=device, seed=args.seed,
                     timer=Timer(args.warmup, args.repeats, args.budget),
                     progress=bar.update if bar else None, graph_max_tokens=graph_max)
    finally:
        if bar:
            bar.close()
    print_results(shapes, found)
    if not found:
        print(f"error: no layer shape of {args.checkpoint} has a candidate to time here; nothing "
              "written", file=sys.stderr)
        return 1
    section = Section(cache_key(env, registry), env.to_json(), tuple(found))
    write_sections(path, merge(_existing(path), section))
    good = sum(m.median_us is not None for m in found)
    print(f"wrote {good} measurement(s) of {env.described} to {path}"
          + (f" ({len(found) - good} failed)" if good < len(found) else ""))
    return 0 if good else 1
