"""``moe-runtime``: inspect plugins, plan checkpoints, run the conformance suite, serve models."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from moe_runtime.declarations import describe_comm_support, describe_support
from moe_runtime.tuning.command import add_tune_command, add_tuning_cache_argument

EPILOG = """\
plugins are loaded in this order: names blocked with -p no:NAME or MOE_RUNTIME_BLOCK_PLUGINS
(comma-separated) are skipped; the built-in plugin; entry points of the group 'moe_runtime' (unless
MOE_RUNTIME_DISABLE_PLUGIN_AUTOLOAD=1); a plugin that fails to import is reported by
`moe-runtime plugins` and skipped, or is fatal with --strict-plugins / MOE_RUNTIME_STRICT_PLUGINS=1.
"""


def _blocked(args) -> list[str]:
    out = []
    for item in args.plugin_opts or []:
        if not item.startswith("no:"):
            raise SystemExit(f"-p takes no:NAME to block a plugin, got {item!r}")
        out.append(item[3:])
    return out


def plugin_options(args, environ=None):
    """The :class:`~moe_runtime.plugin.manager.PluginOptions` of a command: the environment variables,
    then the global options ``-p no:NAME``, ``--disable-plugin-autoload``, ``--strict-plugins``."""
    from moe_runtime.plugin.manager import PluginOptions

    return PluginOptions.from_environ(environ).with_command_line(
        blocked=_blocked(args), disable_autoload=args.disable_plugin_autoload,
        strict=args.strict_plugins)


def load_registry(args):
    from moe_runtime.plugin.registry import Registry

    options = getattr(args, "plugin_options", None) or plugin_options(args)
    return Registry.load(options=options)


# ------------------------------------------------------------------------------------ plugins


def cmd_plugins(args) -> int:
    reg = load_registry(args)
    data = {"plugins": [], "experts_backends": [], "communication_backends": [], "formats": []}
    for info in reg.plugin_infos:
        data["plugins"].append({
            "name": info.name, "distribution": info.distribution, "version": info.version,
            "module": info.module, "status": info.status, "error": info.error,
        })
    for name in sorted(reg.experts):
        r = reg.experts[name]
        data["experts_backends"].append({
            "name": name, "plugin": r.plugin, "priority": r.spec.priority,
            "factory": r.spec.factory, "description": r.spec.description,
            "cuda_graphs": r.spec.cuda_graphs,
            "supports": [describe_support(s) for s in r.spec.supports],
        })
    for name in sorted(reg.comms):
        r = reg.comms[name]
        data["communication_backends"].append({
            "name": name, "plugin": r.plugin, "priority": r.spec.priority,
            "factory": r.spec.factory, "description": r.spec.description,
            "modes": [describe_comm_support(s) for s in r.spec.supports],
        })
    for name in sorted(reg.formats):
        f = reg.formats[name]
        data["formats"].append({"name": name, "plugin": f.plugin,
                                "description": f.spec.description})
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print("plugins:")
    for p in data["plugins"]:
        ver = f" {p['version']}" if p["version"] else ""
        dist = f" ({p['distribution']}{ver})" if p["distribution"] else ""
        line = f"  {p['name']}{dist}: {p['status']}"
        if p["error"]:
            line += f": {p['error'].splitlines()[0]}"
        print(line)
    print("experts backends:")
    for b in data["experts_backends"]:
        graphs = ", CUDA graphs" if b["cuda_graphs"] else ""
        print(f"  {b['name']} [plugin {b['plugin']}, priority {b['priority']}{graphs}] "
              f"{b['description']}")
        for s in b["supports"]:
            extra = f" runs as {s['runs_as']}" if s["runs_as"] else ""
            print(f"    formats {','.join(s['formats'])}{extra}; activations "
                  f"{','.join(s['activations'])}; layouts {','.join(s['layouts'])}; payloads "
                  f"{','.join(s['payloads'])}; {','.join(s['devices'])}"
                  # a compute capability is a CUDA device's: none is printed for a CPU-only block
                  + (f" (CUDA cc {s['cuda_capabilities']})" if "cuda" in s["devices"] else "")
                  + (f"; requires {','.join(s['requires'])}" if s["requires"] else ""))
    print("communication backends:")
    for b in data["communication_backends"]:
        print(f"  {b['name']} [plugin {b['plugin']}, priority {b['priority']}] {b['description']}")
        for m in b["modes"]:
            bound = m["max_tokens_per_rank"]
            print(f"    mode {m['mode']}: layout {m['layout']}; payloads {','.join(m['payloads'])}; "
                  f"world size {m['world_size']}"
                  + (f"; at most {bound} tokens/rank" if bound else "")
                  + f"; {','.join(m['devices'])}")
    return 0


# --------------------------------------------------------------------------------------- plan


def add_plan_arguments(p, *, serve: bool = False) -> None:
    """The planning options of ``plan``, also those of ``serve`` (``serve=True``: the help says
    what each means for a server, which plans for the device it runs on, in one process)."""
    p.add_argument("--moe-runner-backend", default=None, metavar="NAME",
                   help="pin the experts backend (default: the planner's choice per layer)")
    p.add_argument("--moe-a2a-backend", default=None, metavar="NAME",
                   help="pin the communication backend (default: the planner's choice)")
    p.add_argument("--moe-a2a-payload", default=None, metavar="PAYLOAD",
                   help="pin the dispatch payload (default: derived from both declarations)")
    p.add_argument("--target-device", default=None, metavar="TARGET",
                   help="the device --device names, described (cpu, sm90, sm100, cuda:9.0 ...): "
                        "serve plans for the device it runs on, so a target that differs from it "
                        "is refused; `moe-runtime plan --target-device` plans for another "
                        "machine" if serve else
                        "plan for this device instead of probing: cpu, sm90, sm100, cuda:9.0 ...")
    p.add_argument("--ep-size", type=int, default=1, metavar="N",
                   help="expert-parallel ranks (default 1); serve runs one process, so only 1 "
                        "is served: `moe-runtime plan --ep-size N` shows the plan of N ranks"
                        if serve else "expert-parallel ranks (default 1)")
    p.add_argument("--max-tokens-per-rank", type=int, default=4096, metavar="N",
                   help="largest batch per rank the deployment sends (default 4096)")
    p.add_argument("--no-degradation", action="store_true",
                   help="refuse declared degradations (e.g. NVFP4 W4A4 run as W4A16)")
    add_tuning_cache_argument(p)


def deployment_from_args(args):
    """The :class:`~moe_runtime.planner.Deployment` the planning options in ``args`` ask for."""
    from moe_runtime.planner import Deployment

    for name in ("ep_size", "max_tokens_per_rank"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least 1, got "
                             f"{getattr(args, name)}")
    return Deployment(
        ep_size=args.ep_size,
        experts_backend=args.moe_runner_backend,
        comm_backend=args.moe_a2a_backend,
        payload=args.moe_a2a_payload,
        max_tokens_per_rank=args.max_tokens_per_rank,
        allow_degradation=not args.no_degradation,
    )


def make_plan(args, checkpoint, registry):
    """Plan ``checkpoint`` (a CheckpointInfo) for the options in ``args``."""
    from moe_runtime.checkpoint.problems import problems_from_checkpoint
    from moe_runtime.environment import Environment
    from moe_runtime.planner import plan_model

    dep = deployment_from_args(args)
    if args.target_device:
        env = Environment.for_target(args.target_device)
    else:
        env = Environment.probe(device=getattr(args, "device", None),
                                modules=registry.required_modules())
    from moe_runtime.tuning.command import tuning_for

    return plan_model(problems_from_checkpoint(checkpoint), registry=registry, environment=env,
                      deployment=dep, tuning=tuning_for(args, env, registry))


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch-size", type=int, default=8, metavar="N",
                   help="sequences served at once, for the memory estimate (default 8, as serve)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="tokens per sequence, for the memory estimate (default: the model's "
                        "context length)")


def _local_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_check(args, path, *, device: str | None, weights_required: bool = True):
    """:func:`check_checkpoint` for the CLI's options; ``device=None``: no memory comparison."""
    from moe_runtime.checkpoint.check import check_checkpoint

    for name in ("max_batch_size", "max_model_len"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least 1, got {value}")
    kwargs = {} if device is not None else {"machine": None}
    return check_checkpoint(path, device=device or "cpu", batch_size=args.max_batch_size,
                            context_tokens=args.max_model_len,
                            ep_size=max(1, getattr(args, "ep_size", 1) or 1),
                            weights_required=weights_required, **kwargs)


def print_findings(report, *, file=None) -> None:
    """Every finding of a failed check, one paragraph each (on stderr by default)."""
    file = file or sys.stderr
    print(f"error: {report.path} cannot be used: {len(report.findings)} problem(s) found",
          file=file)
    for finding in report.findings:
        print(f"error: {finding.paragraph}", file=file)


def cmd_check(args) -> int:
    if args.device is not None and not args.no_memory:
        from moe_runtime.environment import Environment

        problem = Environment.device_problem(args.device)
        if problem:  # not a memory comparison with the host's, nor none at all
            raise SystemExit(f"error: --device: {problem}")
    device = None if args.no_memory else (args.device or _local_device())
    report = run_check(args, args.checkpoint, device=device)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    elif report.ok:
        print(f"checkpoint {report.path}: ok; {report.summary}")
    if not report.ok:
        if not args.json:
            print_findings(report)
        return 2
    return 0


def cmd_plan(args) -> int:
    from moe_runtime.checkpoint import CheckpointError, read_checkpoint
    from moe_runtime.checkpoint.problems import checkpoint_summary
    from moe_runtime.planner import PlanError

    # A described target is not this machine: its memory is estimated, not compared. A folder of
    # config files alone plans (a published config, before its weights are downloaded).
    report = run_check(args, args.checkpoint,
                       device=None if args.target_device else _local_device(),
                       weights_required=False)
    # plan may run on another machine than the one that serves: memory is a warning here.
    warnings = [f for f in report.findings if f.rule == "memory"]
    if len(warnings) < len(report.findings):
        if args.json:
            print(json.dumps({"check": report.to_json(), "error": "the checkpoint check failed",
                              "rejections": []}, indent=2))
        print_findings(report)
        return 2

    def warn(findings) -> None:
        for finding in findings:
            print(f"warning: {finding.paragraph}", file=sys.stderr)

    registry = load_registry(args)
    try:
        ckpt = read_checkpoint(args.checkpoint)
    except CheckpointError as exc:
        warn(warnings)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        plan = make_plan(args, ckpt, registry)
    except (PlanError, ValueError) as exc:
        warn(warnings)
        if args.json:
            rej = [r.to_json() for r in getattr(exc, "rejections", ())]
            print(json.dumps({"checkpoint": checkpoint_summary(ckpt), "error": str(exc),
                              "rejections": rej}, indent=2))
        print("error: " + "\n".join(group_layer_lines(str(exc).splitlines())), file=sys.stderr)
        return 1
    # the experts as the planned backends hold them (cpu_dequantized: a float32 copy)
    report = report.with_plan(plan)
    warn(report.findings)  # the memory as planned replaces the check's estimate: said once
    if args.json:
        print(json.dumps({"checkpoint": checkpoint_summary(ckpt), **plan.to_json(),
                          "check": report.to_json()}, indent=2))
        return 0
    summary = checkpoint_summary(ckpt)
    print(f"checkpoint {ckpt.path}: {summary['architecture']}, method {summary['method']} "
          f"(reported only), {len(plan.layers)} MoE layers")
    print(f"check: {'ok' if report.ok else 'memory warning'}; {report.summary}")
    print(f"environment: {plan.environment.described}; ep size {plan.deployment.ep_size}")
    print_plan_table(plan)
    for note in plan.notes:  # the tuning cache read, or why one was ignored
        print(f"note: {note}")
    from moe_runtime.plugin.first_party import degraded_plan_hints

    for line in degraded_plan_hints(lp.problem.name for lp in plan.layers if lp.degradations):
        print(line)
    return 0


def layer_ranges(names) -> str:
    """``layers 0-5, 7`` for names that differ only in one layer index, else the names."""
    import re

    names = list(dict.fromkeys(names))
    parts = [re.fullmatch(r"(.*?\blayers\.)(\d+)(\..*|)", n) for n in names]
    shapes = {(m.group(1), m.group(3)) for m in parts if m}
    if len(names) == 1 or not all(parts) or len(shapes) != 1:
        return ", ".join(names) if len(names) > 1 else names[0]
    numbers = sorted(int(m.group(2)) for m in parts)
    spans, start = [], numbers[0]
    for prev, cur in zip(numbers, numbers[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    head, tail = shapes.pop()
    return f"layers {', '.join(spans)} of {head}N{tail}"


def group_layer_lines(lines) -> list[str]:
    """Lines ``layer NAME (...): TEXT`` that differ only in NAME, as one line naming the layers."""
    import re

    groups: dict[tuple[str, str], list[str]] = {}
    out: list[object] = []
    for line in lines:
        m = re.fullmatch(r"layer (\S+) (\(.*?\)): (.*)", line)
        if not m:
            out.append(line)
            continue
        key = (m.group(2), m.group(3))
        if key not in groups:
            groups[key] = []
            out.append(key)
        groups[key].append(m.group(1))
    text = []
    for item in out:
        if isinstance(item, tuple):
            names = groups[item]
            where = f"layer {names[0]}" if len(names) == 1 else layer_ranges(names)
            text.append(f"{where} {item[0]}: {item[1]}")
        else:
            text.append(item)
    return text


NOTE_WIDTH = 100  # notes are printed once each, under the table, wrapped to this width


def print_plan_table(plan, *, file=None) -> None:
    """The per-layer table, each distinct note once (numbered), and rejections grouped by
    backend and reason with the layers they hit."""
    import textwrap

    file = file or sys.stdout
    numbers: dict[str, int] = {}
    rows = [("layer", "format", "communication", "experts", "notes")]
    for lp in plan.layers:
        refs = [f"[{numbers.setdefault(n, len(numbers) + 1)}]"
                for n in dict.fromkeys([*lp.degradations, *lp.notes])]
        comm = lp.comm if lp.payload == "unquantized" else f"{lp.comm} ({lp.payload})"
        experts = lp.experts
        if lp.experts_by_tokens:  # measured per batch size: "<=16 humming, <=128 triton, triton"
            experts = ", ".join([*(f"<={r.max_tokens_per_rank} {r.experts}"
                                   for r in lp.experts_by_tokens), f"else {lp.experts}"])
        rows.append((lp.problem.name, lp.problem.format, comm, experts, " ".join(refs)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print(("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4]).rstrip(),
              file=file)
    if numbers:
        print("notes:", file=file)
        for note, n in numbers.items():
            print(textwrap.fill(note, NOTE_WIDTH, initial_indent=f"  [{n}] ",
                                subsequent_indent=" " * (len(str(n)) + 5)), file=file)
    if plan.rejections:
        print("rejected:", file=file)
        grouped: dict[tuple, list[str]] = {}
        for r in plan.rejections:
            grouped.setdefault((r.role, r.backend, r.reason.value, r.message), []).append(r.layer)
        for (role, backend, reason, message), layers in grouped.items():
            print(textwrap.fill(f"{role} {backend}: {reason}: {message} "
                                f"[{layer_ranges(layers)}]", NOTE_WIDTH, initial_indent="  ",
                                subsequent_indent="    "), file=file)


# ---------------------------------------------------------------------------------- the parser


def version_text() -> str:
    """``moe-runtime --version``: the core's version, then each entry-point plugin's distribution.

    Read from installed metadata only: no plugin is imported, so a broken one cannot hide the rest.
    """
    from importlib import metadata

    from moe_runtime import __version__

    lines = [f"moe-runtime {__version__}"]
    seen = set()
    for ep in sorted(metadata.entry_points(group="moe_runtime"), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        key = (ep.name, dist.name if dist else None)
        if key in seen:  # an editable install can list one distribution twice
            continue
        seen.add(key)
        where = f"{dist.name} {dist.version}" if dist else "(distribution unknown)"
        lines.append(f"  plugin {ep.name}: {where}")
    return "\n".join(lines)


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-runtime",
        description="Run Mixture-of-Experts layers through backends chosen from their declarations.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction,
                        help="print the versions of moe-runtime and of its entry-point plugins")
    parser.add_argument("-p", dest="plugin_opts", action="append", metavar="no:NAME",
                        help="block a plugin by name (repeatable)")
    parser.add_argument("--disable-plugin-autoload", action="store_true",
                        help="load no entry-point plugins, only the built-ins")
    parser.add_argument("--strict-plugins", action="store_true",
                        help="fail when a plugin cannot be loaded instead of reporting it")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (default: one paragraph)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("plugins", help="list plugins, backends and their declarations")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("plan", help="show which backends would run each MoE layer of a checkpoint",
                       description="Plan every MoE layer of a local checkpoint folder. Exits 1 when "
                       "a requested backend cannot run a layer, 2 when the checkpoint check finds "
                       "a problem (as `moe-runtime check` does).")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    add_plan_arguments(p)
    add_check_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "check", help="check a checkpoint folder and print every problem found",
        description="Check a local checkpoint folder without loading it: files and JSON, "
        "config.json against the quantization config, safetensors headers, every tensor the "
        "formats require, every scale finite and positive, and the memory serving needs "
        "against this machine. Prints every finding; exits 2 when there is one.")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    add_check_arguments(p)
    p.add_argument("--device", default=None,
                   help="whose memory to compare with: cpu, cuda, cuda:1 (default: CUDA when "
                        "present, else cpu)")
    p.add_argument("--no-memory", action="store_true",
                   help="estimate the memory serving needs but compare it with no machine")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_check)

    add_tune_command(sub)
    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub) -> None:
    try:
        from moe_runtime.testing.command import add_conformance_command
    except ImportError:
        pass
    else:
        add_conformance_command(sub)
    try:
        from moe_runtime.serve import add_serve_arguments, run_serve
    except ImportError:
        pass
    else:
        p = sub.add_parser("serve", help="serve a MoE checkpoint over an OpenAI-compatible HTTP API")
        add_serve_arguments(p)
        p.set_defaults(func=run_serve)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from moe_runtime.plugin.manager import PluginError

    # The global plugin options travel to every command in one record, args.plugin_options.
    args.plugin_options = plugin_options(args)
    try:
        return int(args.func(args) or 0)
    except PluginError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except BrokenPipeError:  # `moe-runtime plugins | head`
        sys.stderr.close()
        return 0
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        if args.debug:
            raise
        from moe_runtime.checkpoint import CheckpointError

        what = "" if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: "
        print(f"error: {what}{exc} (run with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
