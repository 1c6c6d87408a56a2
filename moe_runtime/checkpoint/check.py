"""``check_checkpoint(path)``: what a checkpoint folder must satisfy, checked before anything is
allocated, with every finding reported at once.

The rules, in the order they run (a rule is skipped when what it reads failed before it):

1. the folder exists and holds files, and every file in it can be read;
2. every top-level ``*.json`` file is a JSON object, and config.json exists;
3. config.json names a supported architecture whose MoE fields read, its sizes are positive
   integers and its query heads split evenly over the key/value heads, and its routing can be
   done: ``num_experts_per_tok`` at most the experts; with grouped top-k, ``n_group`` divides the
   experts, ``topk_group`` is at most ``n_group`` and the kept groups hold the top-k experts;
   the special token ids (``eos_token_id``, ``bos_token_id``, ``pad_token_id``) of config.json
   and generation_config.json are token ids of the vocabulary; ``sliding_window`` is null or a
   window of at least one token (0 only where no layer attends over a window);
4. the quantization config reads; config.json and hf_quant_config.json agree on every setting
   both state; every group size stated is its format's block size;
5. every safetensors header is well formed: known dtypes, each tensor's bytes inside its file and
   exactly ``dtype size x shape`` long; the index's shards exist and hold the tensors it maps;
6. the tensors match the configs: every module the quantization config names exists; no tensor
   belongs to a decoder layer beyond ``num_hidden_layers``; every MoE layer's experts ``0..E-1``
   store each projection as its format defines (:data:`LAYOUTS`: dtypes, shapes, scales, an
   input scale exactly when activations are quantized), no expert lies beyond ``E``, the router
   is ``[E, hidden]``; embeddings are ``[vocab_size, hidden_size]``; every other linear is stored
   in its resolved format's dtype with that format's scales; the embeddings, the final norm, each
   declared layer's two norms and (untied) ``lm_head.weight`` exist, and in a served family every
   decoder layer stores the module weights and biases the other layers of its kind (MoE, dense)
   store; the attention tensors have the shapes transformers' attention builds from config.json
   (its head size derived as the architecture's attention derives it:
   :meth:`~moe_runtime.checkpoint.architectures.Architecture.attention_tensors`);
7. every scale tensor is finite and positive: one vectorized pass over the scales' bytes (never
   the weights), timed; every per-tensor scale keeps what it scales finite in float32
   (``weight_scale_2`` times NVFP4's largest value, 6 x 448; ``weight_scale``/``input_scale``
   times FP8's 448);
8. the memory serving needs (:mod:`moe_runtime.checkpoint.memory`) fits the machine: the
   experts at their format's storage, or, for a plan (:meth:`CheckReport.with_plan`, the
   ``plan`` argument), at the bytes per weight each layer's planned backend holds after
   ``prepare`` (``cpu_dequantized``'s float32 copy).

:func:`require_sound_checkpoint` runs the check and raises :class:`CheckpointRefused`; a clean
result is remembered per folder state, so the loaders that call it one after the other pay once.
"""

from __future__ import annotations

import bisect
import errno
import math
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import attrs

from moe_runtime import formats
from moe_runtime.checkpoint.architectures import (
    MAX_LAYERS,
    Architecture,
    AttentionCache,
    MoEStructure,
    architecture_of,
)
from moe_runtime.checkpoint.memory import (
    MachineMemory,
    MemoryEstimate,
    estimate_memory,
    human,
    memory_problem,
    memory_remedies,
)
from moe_runtime.checkpoint.quant_config import (
    ALGO_FORMATS,
    CONFIG,
    QuantizationSpec,
    quantization_sources,
    read_json_file,
    read_quantization,
)
from moe_runtime.checkpoint.records import CheckpointError, MoELayerInfo
from moe_runtime.checkpoint.resolution import canonical_name, resolve_module
from moe_runtime.checkpoint.tensors import (
    DTYPE_SIZES,
    INDEX_FILE,
    HeaderError,
    TensorMeta,
    _short,
    header_entry_problem,
    layout_problem,
    read_header,
    weight_map_of,
)

# What each rule is about (a closed set: tests and --json readers key on it).
RULES = ("folder", "json", "config", "routing", "quantization", "agreement", "group_size",
         "safetensors", "index", "modules", "tensors", "scales", "memory")

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64", "F8_E4M3", "F8_E5M2")
# config.json sizes every supported architecture builds its model from
_SIZE_FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size",
                "max_position_embeddings")
# null in these is refused by transformers' config classes of every supported architecture
# (head_dim and num_key_value_heads may be null in some: the class derives them)
_NOT_NULL_FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "max_position_embeddings")
_SCALE_LEAF = re.compile(r"(?:^|_)scale(?:_\d+)?$")
GENERATION_CONFIG = "generation_config.json"
# special token ids the model and generation read; eos_token_id alone may list several
_TOKEN_IDS = ("eos_token_id", "bos_token_id", "pad_token_id")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_LISTED = 3  # tensors named in one finding before "and N more"


@attrs.frozen
class TensorLayout:
    """How one weight format stores a linear ``[out, in]`` (safetensors dtype codes).

    :param weight_dtypes: dtypes ``weight`` may have.
    :param pack: weight elements per stored element along ``in`` (E2M1: two per byte).
    :param block: elements per block scale along ``in`` (NVFP4: 16), ``None``: no block scale.
    :param block_scale_dtype: the block scale ``weight_scale [out, in/block]``'s dtype.
    :param scalars: per-tensor float32 scales the weight needs (``weight_scale``...).
    :param input_scale: activations are quantized: ``input_scale`` is required (True) or
        must be absent (False); ``None``: not a quantized format.
    """

    weight_dtypes: tuple[str, ...]
    pack: int = 1
    block: int | None = None
    block_scale_dtype: str | None = None
    scalars: tuple[str, ...] = ()
    input_scale: bool | None = None

    def expected(self, module: str, out: int, inp: int) -> list[tuple[str, tuple, Any]]:
        """``(tensor, dtypes, shape)`` of a module; shape ``"scalar"`` = one element, ``None`` =
        must be absent."""
        rows = [(f"{module}.weight", self.weight_dtypes, (out, inp // self.pack))]
        if self.block:
            rows.append((f"{module}.weight_scale", (self.block_scale_dtype,),
                         (out, inp // self.block)))
        rows += [(f"{module}.{s}", ("F32",), "scalar") for s in self.scalars]
        if self.input_scale is not None:
            rows.append((f"{module}.input_scale", ("F32",),
                         "scalar" if self.input_scale else None))
        return rows


_UNQUANTIZED = TensorLayout(("BF16", "F16", "F32"))
_NVFP4 = dict(weight_dtypes=("U8",), pack=2, block=16, block_scale_dtype="F8_E4M3",
              scalars=("weight_scale_2",))
LAYOUTS: dict[str, TensorLayout] = {
    formats.BF16: _UNQUANTIZED,
    formats.FP16: _UNQUANTIZED,
    formats.FP8_W8A8: TensorLayout(("F8_E4M3",), scalars=("weight_scale",), input_scale=True),
    formats.NVFP4_W4A4: TensorLayout(**_NVFP4, input_scale=True),
    formats.NVFP4_W4A16: TensorLayout(**_NVFP4, input_scale=False),
}


@attrs.frozen
class Finding:
    """One thing wrong with a checkpoint: what, where (file, tensor or layer), what is accepted."""

    rule: str
    where: str
    problem: str
    accepted: str = ""

    @property
    def paragraph(self) -> str:
        text = f"{self.where}: {self.problem}" if self.where else self.problem
        return f"{text}; accepted: {self.accepted}" if self.accepted else text

    def to_json(self) -> dict:
        return {"rule": self.rule, "where": self.where, "problem": self.problem,
                "accepted": self.accepted, "message": self.paragraph}


@attrs.frozen
class CheckReport:
    """The findings of one check, and what it measured."""

    path: Path
    findings: tuple[Finding, ...] = attrs.field(converter=tuple)
    tensors: int = 0
    scale_tensors: int = 0
    scale_bytes: int = 0
    scale_seconds: float = 0.0
    memory: MemoryEstimate | None = None
    machine: MachineMemory | None = None
    seconds: float = 0.0
    config_only: bool = False  # no weight files (accepted when not required): tensors unchecked
    # what the estimate was made from (config, MoE layers, its keyword arguments): with_plan's input
    estimate_inputs: tuple | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def ok(self) -> bool:
        return not self.findings

    def with_plan(self, plan) -> CheckReport:
        """This report with the memory estimated for ``plan`` (each MoE layer's experts at its
        planned backend's bytes per weight after ``prepare``) and compared again with the same
        machine: the memory finding is replaced by the planned one, or dropped when it fits."""
        if self.estimate_inputs is None:
            return self
        config, layers, kwargs = self.estimate_inputs
        estimate = estimate_memory(config, layers, **kwargs, plan=plan)
        findings = [f for f in self.findings if f.rule != "memory"]
        finding = _memory_finding(self.path, estimate, self.machine)
        return attrs.evolve(self, findings=findings + ([finding] if finding else []),
                            memory=estimate)

    def rules(self) -> set[str]:
        return {f.rule for f in self.findings}

    @property
    def summary(self) -> str:
        """One line for people about a check that passed (or how many findings it had)."""
        if any(f.rule != "memory" for f in self.findings):
            return f"{len(self.findings)} problem(s) found in {self.path}"
        memory = ""
        if self.memory is not None:
            memory = f"; serving needs about {human(self.memory.total)}"
            if self.machine is not None:
                memory += f" ({self.machine.described})"
        if self.config_only:
            return ("config files only (no weight files): the configs were checked, the tensors "
                    f"and scales were not{memory}")
        return (f"checked {self.tensors} tensors in {self.seconds:.2f} s: {self.scale_tensors} "
                f"scale tensors ({human(self.scale_bytes)}) finite and positive, scanned in "
                f"{self.scale_seconds * 1000:.0f} ms{memory}")

    def to_json(self) -> dict:
        return {
            "path": str(self.path), "ok": self.ok,
            "findings": [f.to_json() for f in self.findings],
            "tensors": self.tensors, "scale_tensors": self.scale_tensors,
            "scale_bytes": self.scale_bytes, "scale_scan_seconds": round(self.scale_seconds, 4),
            "seconds": round(self.seconds, 4), "config_only": self.config_only,
            "memory": self.memory.to_json() if self.memory else None,
            "machine": attrs.asdict(self.machine) if self.machine else None,
        }


class CheckpointRefused(CheckpointError):
    """A checkpoint failed :func:`check_checkpoint`; the message has one paragraph per finding."""

    def __init__(self, report: CheckReport) -> None:
        self.report = report
        super().__init__("\n".join(f.paragraph for f in report.findings))


# ---------------------------------------------------------------------------------- the check

_PROBE = "probe"


def check_checkpoint(path: str | Path, *, device: str = "cpu", machine: Any = _PROBE,
                     batch_size: int = 1, context_tokens: int | None = None,
                     ep_size: int = 1, weights_required: bool = True,
                     plan: Any = None) -> CheckReport:
    """Check the checkpoint folder ``path``; never raises for what is wrong with the folder.

    :param device: where the model would be loaded (``"cpu"``, ``"cuda:0"``): whose memory the
        estimate is compared with.
    :param machine: a :class:`MachineMemory` to compare with, ``None`` for no comparison
        (the estimate is still made), or the default: probe ``device`` once.
    :param batch_size: sequences the server holds at once; ``context_tokens``: tokens per
        sequence (default: the config's ``max_position_embeddings``); ``ep_size``: expert-parallel
        ranks (the memory is one rank's).
    :param weights_required: ``False`` accepts a folder of config files alone (planning a
        published config before its weights are downloaded): the tensor rules are then skipped
        and the report says so.
    :param plan: the :class:`~moe_runtime.planner.Plan` that will serve: the memory estimate
        counts each MoE layer's experts as its planned backend holds them (a plan made after
        the check: :meth:`CheckReport.with_plan`).
    """
    start = time.perf_counter()
    c = _Check(Path(path), weights_required=weights_required)
    c.run(batch_size=batch_size, context_tokens=context_tokens, ep_size=ep_size, plan=plan)
    if machine == _PROBE:
        machine = MachineMemory.probe(device) if c.estimate is not None else None
    finding = _memory_finding(c.folder, c.estimate, machine)
    if finding is not None:
        c.findings.append(finding)
    return CheckReport(c.folder, c.findings, len(c.tensors), c.scale_count, c.scale_bytes,
                       c.scale_seconds, c.estimate, machine, time.perf_counter() - start,
                       c.config_only, c.estimate_inputs)


def _memory_finding(folder: Path, estimate: MemoryEstimate | None,
                    machine: MachineMemory | None) -> Finding | None:
    if estimate is None or machine is None:
        return None
    problem = memory_problem(estimate, machine)
    return Finding("memory", str(folder), problem, memory_remedies(estimate)) if problem else None


_CLEAN: dict[tuple, CheckReport] = {}


def _folder_state(folder: Path) -> tuple:
    try:
        return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                            for p in folder.iterdir() if p.is_file()))
    except OSError:
        return ()


def require_sound_checkpoint(path: str | Path, *, device: str = "cpu", batch_size: int = 1,
                             context_tokens: int | None = None, ep_size: int = 1) -> CheckReport:
    """:func:`check_checkpoint`, raising :class:`CheckpointRefused` when anything was found.

    A folder that passed is not checked again while its files stay as they were.
    """
    folder = Path(path).resolve() if Path(path).exists() else Path(path)
    key = (str(folder), device, batch_size, context_tokens, ep_size, _folder_state(folder))
    report = _CLEAN.get(key)
    if report is None:
        report = check_checkpoint(path, device=device, batch_size=batch_size,
                                  context_tokens=context_tokens, ep_size=ep_size)
        if not report.ok:
            raise CheckpointRefused(report)
        if len(_CLEAN) > 16:
            _CLEAN.clear()
        _CLEAN[key] = report
    return report


def require_memory_for_plan(report: CheckReport, plan) -> CheckReport:
    """``report.with_plan(plan)`` (:meth:`CheckReport.with_plan`), raising
    :class:`CheckpointRefused` when the experts as the plan's backends hold them do not fit."""
    planned = report.with_plan(plan)
    if not planned.ok:
        raise CheckpointRefused(planned)
    return planned


class _Check:
    """The state of one check: the findings so far and what the earlier rules read."""

    def __init__(self, folder: Path, *, weights_required: bool = True) -> None:
        self.folder = folder
        self.weights_required = weights_required
        self.config_only = False
        self.findings: list[Finding] = []
        self.config: dict | None = None
        self.generation_config: dict | None = None
        self.tokenizer_files: dict[str, dict] = {}  # tokenizer.json, tokenizer_config.json
        self.tensors: dict[str, TensorMeta] = {}
        self.ranges: dict[str, tuple[str, int, int]] = {}  # tensor -> (file, start, end) in file
        self.duplicates: list[tuple[str, str, str]] = []  # (tensor, first file, second file)
        self.unreadable: list[str] = []  # weight files whose header could not be read (OSError)
        # tensors whose header entry is itself wrong (reported so): not also "missing"
        self.bad_entries: set[str] = set()
        self.scale_count = self.scale_bytes = 0
        self.scale_seconds = 0.0
        self.estimate: MemoryEstimate | None = None
        self.estimate_inputs: tuple | None = None
        self._stored_experts: dict[str, set[int]] | None = None
        self._expert_tensors: dict[str, list[str]] | None = None

    def add(self, rule: str, where: str, problem: str, accepted: str = "") -> None:
        said = f"{where}: {problem};" if where else f"{problem};"
        # the reader's error said it already (head_dim is '16'; expected ...): this one, which
        # says what is accepted, replaces it
        self.findings[:] = [f for f in self.findings
                            if f.where or not f.paragraph.startswith(said)]
        self.findings.append(Finding(rule, where, problem, accepted))

    def add_error(self, rule: str, exc: CheckpointError) -> None:
        finding = Finding(rule, "", str(exc))
        if finding in self.findings:  # one config error hit by each module it resolves
            return
        if any(finding.problem.startswith(f"{f.where}: {f.problem};") for f in self.findings
               if f.where):
            return  # a rule of the check said it already, with what is accepted
        self.findings.append(finding)

    def run(self, *, batch_size: int, context_tokens: int | None, ep_size: int,
            plan: Any = None) -> None:
        if not self.check_folder():
            return
        self.check_json()
        structure = self.check_config()
        spec = self.check_quantization()
        tensors_ok = self.check_safetensors()
        layers: list[MoELayerInfo] = []
        if structure is not None and spec is not None:
            layers = self.check_tensors(*structure, spec, tensors_ok)
        if tensors_ok:
            self.check_scales()
            self.check_shared_scales(layers)
            self.check_scale_range()
        if self.config is not None and structure is not None and (
                spec is not None or not layers):
            kwargs = {"batch_size": batch_size, "context_tokens": context_tokens,
                      "ep_size": ep_size,
                      "kv_cache_quant_algo": spec.kv_cache_quant_algo if spec else None}
            self.estimate_inputs = (self.config, list(layers or []), kwargs)
            self.estimate = estimate_memory(self.config, layers or [], **kwargs, plan=plan)

    # ------------------------------------------------------------------ 1. folder and files

    def check_folder(self) -> bool:
        folder = self.folder
        if not folder.exists():
            self.add("folder", str(folder), "no such directory",
                     "a checkpoint folder holding config.json and *.safetensors files")
            return False
        if not folder.is_dir():
            self.add("folder", str(folder), "is a file, not a checkpoint folder",
                     "a folder holding config.json and *.safetensors files")
            return False
        try:
            entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
        except OSError as exc:
            self.add("folder", str(folder), f"cannot be listed ({exc.strerror})")
            return False
        if not entries:
            self.add("folder", str(folder), "the folder is empty",
                     "a checkpoint folder holding config.json and *.safetensors files")
            return False
        for p in entries:
            if p.is_dir():
                if p.suffix in (".json", ".safetensors"):
                    self.add("folder", str(p), "is a directory, not a file",
                             f"a {p.suffix[1:]} file of that name, or none")
                continue
            try:
                with p.open("rb") as fh:
                    fh.read(1)
            except OSError as exc:
                why = exc.strerror or type(exc).__name__
                if exc.errno == errno.ELOOP:  # exists() is False for a loop as for a dangling link
                    why = (f"a symbolic link to {p.readlink()} that loops: following the links "
                           "never reaches a file")
                elif p.is_symlink() and not p.exists():
                    why = f"a link to {p.readlink()}, which does not exist"
                self.add("folder", str(p), f"cannot be read ({why})",
                         "a readable file, or no file of that name")
        if not (folder / CONFIG).exists() and not (folder / CONFIG).is_symlink():
            # (a link that leads nowhere is reported above, as what it is)
            self.add("folder", str(folder), "has no config.json",
                     "a Hugging Face checkpoint folder (config.json beside the weights)")
        return True

    # ------------------------------------------------------------------------ 2. JSON files

    def check_json(self) -> None:
        for p in sorted(self.folder.glob("*.json")):
            try:
                data, problem = read_json_file(p)
            except OSError:
                continue  # reported by check_folder
            if problem:
                self.add("json", str(p), *problem)
                continue
            if not isinstance(data, dict):
                self.add("json", str(p), f"holds a JSON {type(data).__name__}, not an object",
                         "a JSON object")
                continue
            if p.name == CONFIG:
                self.config = data
            elif p.name == GENERATION_CONFIG:
                self.generation_config = data
            elif p.name in _TOKENIZER_FILES:
                self.tokenizer_files[p.name] = data

    # ------------------------------------------------------------------ 3. config and routing

    def check_config(self) -> tuple[Architecture, list[MoEStructure]] | None:
        if self.config is None:
            return None
        file = str(self.folder / CONFIG)
        try:
            arch = architecture_of(self.config, file)
            structures = arch.structure(self.config, file)
        except CheckpointError as exc:
            self.add_error("config", exc)
            return None
        if not structures:
            self.add("config", file, "declares no MoE layer",
                     "a MoE model (at least one layer with routed experts)")
        self._model_type(arch, file)
        cache = None
        try:  # the attention's fields, which the KV cache and the attention tensors follow
            cache = arch.attention_cache(self.config, file)
            arch.attention_tensors(self.config, file)
        except CheckpointError as exc:
            self.add_error("config", exc)
        fields = self._model_fields()
        self._sizes(fields, file)
        self._constants(fields, file)
        self._token_ids(fields, file)
        self._tokenizer_ids(fields, file)
        self._sliding_window(fields, file, cache)
        experts_key = next((k for k in ("num_experts", "num_local_experts", "n_routed_experts")
                            if fields.get(k) is not None), "num_experts")
        for s in structures[:1]:  # every MoE layer of a config shares these fields
            e, k, r = s.num_experts, s.top_k, s.router
            if k > e:
                self.add("routing", file,
                         f"num_experts_per_tok is {k} but {experts_key} is {e}: a token cannot "
                         f"be routed to more experts than the layer has",
                         f"num_experts_per_tok between 1 and {e}")
            if r.n_group > 1 or r.topk_group > 1:
                if e % r.n_group:
                    self.add("routing", file,
                             f"n_group {r.n_group} does not divide the {e} experts "
                             f"({experts_key})", f"an n_group that divides {e}")
                elif r.topk_group > r.n_group:
                    self.add("routing", file,
                             f"topk_group {r.topk_group} is larger than n_group {r.n_group}",
                             f"topk_group between 1 and {r.n_group}")
                elif k > r.topk_group * (e // r.n_group):
                    self.add("routing", file,
                             f"num_experts_per_tok {k} exceeds the {r.topk_group * (e // r.n_group)}"
                             f" experts in the topk_group={r.topk_group} kept groups of "
                             f"{e // r.n_group}", "topk_group x experts per group >= "
                             "num_experts_per_tok")
        return arch, structures

    def _model_type(self, arch: Architecture, file: str) -> None:
        """transformers picks the config class by ``model_type``: it must be the class's."""
        if not arch.model_types:
            return
        value = (self.config or {}).get("model_type")
        accepted = (f"model_type {' or '.join(repr(t) for t in arch.model_types)} (what "
                    f"transformers maps {arch.name} to)")
        if value is None:
            self.add("config", file, "has no model_type, by which transformers picks the "
                     "config class it builds the model from", accepted)
        elif value not in arch.model_types:
            self.add("config", file, f"model_type is {value!r}, but architectures names "
                     f"{arch.name}: transformers would read the file with the config class of "
                     f"{value!r}, not {arch.name}'s", accepted)

    def _sizes(self, fields: dict, file: str) -> None:
        """The sizes the model is built from are positive integers, and attention heads group."""
        where = "text_config." if fields is not self.config else ""
        for key in _SIZE_FIELDS:
            value = fields.get(key)
            if value is None and key in fields and key in _NOT_NULL_FIELDS:
                self.add("config", file, f"{where}{key} is null; transformers' config class "
                         "refuses a null here", f"a positive integer, or no {key!r} key")
                continue
            if value is None:  # transformers' config class then gives its default
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                self.add("config", file, f"{where}{key} is {value!r}", "a positive integer")
        heads, kv = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
        if (isinstance(heads, int) and isinstance(kv, int) and not isinstance(kv, bool)
                and heads > 0 and kv > 0 and heads % kv):
            self.add("config", file, f"num_attention_heads {heads} is not a multiple of "
                     f"num_key_value_heads {kv}", "query heads that split evenly over the "
                     "key/value heads")

    def _constants(self, fields: dict, file: str) -> None:
        """The norms' epsilon and RoPE's base are numbers in their range: transformers takes a
        negative ``rms_norm_eps`` or ``rope_theta`` as given, and the model then computes NaN
        (the square root of a negative variance, a negative base's fractional powers) for every
        token, which the server would serve as text."""
        where = "text_config." if fields is not self.config else ""
        rope = fields.get("rope_parameters") or fields.get("rope_scaling")
        checks = [("rms_norm_eps", fields, "rms_norm_eps", 0, "a number of 0 or more (1e-06 "
                   "is usual)")]
        checks.append(("rope_theta", fields, "rope_theta", None, "a positive number (10000.0 "
                       "is usual)"))
        if isinstance(rope, dict):
            key = "rope_parameters" if isinstance(fields.get("rope_parameters"), dict) else (
                "rope_scaling")
            checks.append((f"{key}.rope_theta", rope, "rope_theta", None,
                           "a positive number (10000.0 is usual)"))
            self._rope_type(rope, key, where, file)
        for label, holder, key, low, accepted in checks:
            value = holder.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                # transformers' config class refuses some at serve's start, and takes a nested
                # rope_parameters' string, which the model then raises a bare TypeError on
                self.add("config", file, f"{where}{label} is {str(value)[:60]!r}, a "
                         f"{type(value).__name__}, not a number", accepted)
                continue
            if not math.isfinite(value) or (value < low if low is not None else value <= 0):
                self.add("config", file, f"{where}{label} is {value!r}", accepted)

    def _token_ids(self, fields: dict, file: str) -> None:
        """The special token ids are token ids: transformers' config class refuses a string or a
        float but takes a bool, an empty list or an id outside the vocabulary with at most a
        warning, and the server then stops on no token, or on one the model never produces (a
        ``pad_token_id`` outside the vocabulary fails building the embeddings)."""
        vocab = fields.get("vocab_size")
        vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 \
            else None
        where = "text_config." if fields is not self.config else ""
        holders = [(file, "", self.config or {})]
        if where:
            holders.append((file, where, fields))
        if self.generation_config is not None:
            holders.append((str(self.folder / GENERATION_CONFIG), "", self.generation_config))
        for holder_file, prefix, holder in holders:
            for key in _TOKEN_IDS:
                found = token_id_problem(key, holder.get(key), vocab)
                if found:
                    problem, accepted = found
                    self.add("config", holder_file, f"{prefix}{key} is "
                             f"{_short(holder.get(key))}{problem}", accepted)

    def _tokenizer_ids(self, fields: dict, file: str) -> None:
        """The tokenizer's token ids are rows of the embeddings: a tokenizer with more tokens
        than ``vocab_size`` (one of another model, or a vocabulary grown after the export) passed
        the check, and serve then failed at start-up with "index out of range in self" in
        ``embed_tokens``, naming neither the tokenizer nor ``vocab_size``. A model's vocabulary
        may be larger than its tokenizer's (padded), never smaller."""
        vocab = fields.get("vocab_size")
        if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
            return  # reported by _sizes, or transformers' default applies
        where = "text_config." if fields is not self.config else ""
        for name, ids in (("tokenizer.json", _tokenizer_json_ids),
                          ("tokenizer_config.json", _added_tokens_decoder_ids)):
            data = self.tokenizer_files.get(name)
            if data is None:
                continue
            outside = sorted(((i, t) for i, t in ids(data) if i >= vocab), reverse=True)
            if not outside:
                continue
            top, token = outside[0]
            self.add("config", str(self.folder / name),
                     f"holds token id {top} ({_short(token)}), but {Path(file).name}'s "
                     f"{where}vocab_size is {vocab}" + _more(len(outside) - 1, "token id")
                     + ": the embeddings have no row for it, so a prompt or an answer with "
                     "that token fails (index out of range)",
                     f"a tokenizer whose token ids are all below vocab_size {vocab} (the "
                     "tokenizer of this model), or the vocab_size the embeddings were trained "
                     "with")

    def _sliding_window(self, fields: dict, file: str, cache: AttentionCache | None) -> None:
        """``sliding_window`` is null or a number of tokens: transformers' config class takes a
        negative one (and 0) as given, and where the window applies its attention mask then fails
        to build at the first request (0: every query would attend to no token at all). A 0
        where no layer attends over a window is what Qwen2-MoE's config class itself writes."""
        value = fields.get("sliding_window")
        if value is None:
            return
        where = "text_config." if fields is not self.config else ""
        accepted = ("a positive integer (the tokens each query attends back over), or null "
                    "(no window)")
        if isinstance(value, bool) or not isinstance(value, int):
            self.add("config", file, f"{where}sliding_window is {_short(value)}, not a number "
                     "of tokens", accepted)
        elif value < 0:
            self.add("config", file, f"{where}sliding_window is {value}: a window cannot hold "
                     "a negative number of tokens", accepted)
        elif value == 0 and cache is not None and cache.sliding_window:
            self.add("config", file, f"{where}sliding_window is 0, and the model attends over "
                     f"a sliding window ({cache.describe()}): a window of 0 tokens leaves each "
                     "query no token to attend to, and transformers' attention mask fails to "
                     "build", accepted + ", or use_sliding_window false")

    _ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")

    def _rope_type(self, rope: dict, key: str, where: str, file: str) -> None:
        """transformers looks the RoPE type up in its table when it builds the model, so an
        unknown one failed at serve's start as a bare ``KeyError``."""
        name = "rope_type" if "rope_type" in rope else "type"
        value = rope.get(name)
        if value is None or value in self._ROPE_TYPES:
            return
        try:  # only for a type outside the usual ones: the table of the installed transformers
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            known = ["default", *ROPE_INIT_FUNCTIONS]
        except Exception:  # noqa: BLE001 - no transformers: judge by the usual types
            known = list(self._ROPE_TYPES)
        if value not in known:
            self.add("config", file, f"{where}{key}.{name} is {value!r}, a RoPE type "
                     "transformers does not know", ", ".join(repr(k) for k in known))

    def _model_fields(self) -> dict:
        c = self.config or {}
        return c["text_config"] if isinstance(c.get("text_config"), dict) else c

    # ------------------------------------------------------------------- 4. quantization

    def check_quantization(self) -> QuantizationSpec | None:
        if self.config is None:
            return None
        try:
            sources = quantization_sources(self.folder, self.config)
        except CheckpointError as exc:
            if not self._json_reported(exc):
                self.add_error("quantization", exc)
            return None
        self._agreement(sources)
        self._group_sizes(sources)
        try:  # disagreements are reported above; the tensors are checked against the first
            return read_quantization(self.folder, self.config, strict=False)
        except CheckpointError as exc:
            self.add_error("quantization", exc)
            return None

    def _json_reported(self, exc: CheckpointError) -> bool:
        return any(f.rule in ("json", "folder") and str(exc).startswith(f.where)
                   for f in self.findings if f.where)

    def _agreement(self, sources) -> None:
        own = [(file, s) for file, s, is_own in sources if is_own]
        if len(own) < 2:
            if len(sources) == 2:  # a foreign config.json block: only ModelOpt's keys it has
                (fa, a, _), (fb, b, _) = sources
                for key in ("moe_quant_algo", "kv_cache_quant_algo"):
                    self._compare(fa, fb, key, a.get(key), b.get(key))
            return
        (fa, a), (fb, b) = own
        for key in ("quant_algo", "moe_quant_algo", "kv_cache_quant_algo", "group_size",
                    "producer"):
            self._compare(fa, fb, key, a.get(key), b.get(key))
        ea, eb = a.get("exclude_modules"), b.get("exclude_modules")
        if ea is not None and eb is not None and set(ea) != set(eb):
            only_a, only_b = sorted(set(ea) - set(eb)), sorted(set(eb) - set(ea))
            self.add("agreement", f"{fa} and {fb}",
                     f"disagree on exclude_modules (config.json calls it 'ignore'): "
                     f"{_few(only_a)} only in {Path(fa).name}, {_few(only_b)} only in "
                     f"{Path(fb).name}", "the same list in both files")
        la, lb = a.get("quantized_layers"), b.get("quantized_layers")
        if la is None or lb is None:
            return
        ma = {canonical_name(e.key): e for e in la}
        mb = {canonical_name(e.key): e for e in lb}
        for name in sorted(set(ma) | set(mb)):
            x, y = ma.get(name), mb.get(name)
            if x is None or y is None:
                present, file, other = (x, fa, fb) if y is None else (y, fb, fa)
                self.add("agreement", f"{fa} and {fb}",
                         f"quantized_layers[{present.key!r}] is {present.quant_algo!r} in "
                         f"{Path(file).name} but {Path(other).name} does not list the module "
                         "(so it would be unquantized)", "the same quantized_layers in both")
                continue
            for attr in ("quant_algo", "group_size"):
                va, vb = getattr(x, attr), getattr(y, attr)
                if va is not None and vb is not None and va != vb:
                    self.add("agreement", f"{fa} and {fb}",
                             f"disagree on quantized_layers[{x.key!r}].{attr}: {va!r} in "
                             f"{Path(fa).name}, {vb!r} in {Path(fb).name}",
                             "one value, stated the same in both files")

    def _compare(self, fa: str, fb: str, key: str, va, vb) -> None:
        if va is not None and vb is not None and va != vb:
            self.add("agreement", f"{fa} and {fb}",
                     f"disagree on {key}: {va!r} in {Path(fa).name}, {vb!r} in {Path(fb).name}",
                     "one value, stated the same in both files")

    def _group_sizes(self, sources) -> None:
        for file, s, _own in sources:
            stated = []
            for key in ("quant_algo", "moe_quant_algo"):
                if s.get(key) in ALGO_FORMATS and s.get("group_size") is not None:
                    stated.append((f"group_size (with {key} {s[key]!r})", s[key],
                                   s["group_size"]))
            for entry in s.get("quantized_layers") or ():
                if entry.group_size is not None:
                    stated.append((f"quantized_layers[{entry.key!r}].group_size",
                                   entry.quant_algo, entry.group_size))
            for key, algo, size in stated:
                layout = LAYOUTS.get(ALGO_FORMATS.get(algo or ""))
                if layout is not None and layout.block is not None and size != layout.block:
                    self.add("group_size", file,
                             f"{key} is {size}, but {ALGO_FORMATS[algo]} block scales cover "
                             f"exactly {layout.block} elements", f"group_size {layout.block}")

    # --------------------------------------------------------------------- 5. safetensors

    def check_safetensors(self) -> bool:
        index = self.folder / INDEX_FILE
        mapped: dict[str, str] | None = None
        if index.exists():
            try:
                data, problem = read_json_file(index)
            except OSError:
                return False  # reported by check_folder
            if problem:
                return False  # reported by check_json
            try:
                weight_map = weight_map_of(data, index)
            except HeaderError as exc:
                self.add("index", str(index), exc.problem, exc.expected)
                return False
            outside = sorted({v for v in weight_map.values()
                              if Path(v).name != v or v in ("", ".", "..")})
            if outside:  # the loader joins the folder and the name: a path leaves the folder
                n = sum(1 for v in weight_map.values() if v in outside)
                self.add("index", str(index),
                         f"maps {n} tensor(s) to {outside[0]!r}"
                         + _more(len(outside) - 1, "shard name")
                         + ", which is a path, not the name of a file in the checkpoint folder "
                         "(the weights would be read from wherever it leads)",
                         "shard file names alone (model-00001-of-00002.safetensors...), each "
                         "file beside the index")
                return False
            mapped = weight_map
            files = sorted(set(weight_map.values()))
            paths = []
            for name in files:
                path = self.folder / name
                if not path.is_file():
                    n = sum(1 for v in weight_map.values() if v == name)
                    self.add("index", str(index),
                             f"maps {n} tensor(s) to {name}, which is missing from the folder",
                             "an index whose every shard is in the folder")
                else:
                    paths.append(path)
        else:
            paths = sorted(p for p in self.folder.glob("*.safetensors") if p.is_file())
        if not paths and mapped is None:
            if not self.weights_required:
                self.config_only = True
                return False
            self.add("safetensors", str(self.folder), "holds no *.safetensors weight files",
                     "model.safetensors, or shards listed by model.safetensors.index.json")
            return False
        before = len(self.findings)
        for path in paths:
            self._read_header(path)
        if self.duplicates:  # which copy loads depends on the loader's order: refuse, not guess
            t, first, second = self.duplicates[0]
            self.add("safetensors", str(self.folder),
                     f"tensor {t!r} is stored in both {first} and {second}"
                     + _more(len(self.duplicates) - 1, "tensor")
                     + ": which copy would be loaded depends on the order the files are read in",
                     "each tensor in one .safetensors file (remove the stray copy, or the file "
                     "that repeats the others)")
        if mapped is not None:
            missing = [(t, f) for t, f in mapped.items() if (self.folder / f).is_file()
                       and f not in self.unreadable and self.tensors.get(t, None) is None]
            if missing:
                t, f = missing[0]
                self.add("index", str(index),
                         f"maps tensor {t!r} to {f}, which does not hold it"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                         "an index that matches its shards' headers")
            elsewhere = [(t, f) for t, f in mapped.items() if t in self.tensors
                         and self.tensors[t].file != f and (self.folder / f).is_file()
                         and not any(d[0] == t for d in self.duplicates)]
            if elsewhere:  # tools that follow the index (transformers) look in the wrong file
                t, f = elsewhere[0]
                self.add("index", str(index),
                         f"maps tensor {t!r} to {f}, but {self.tensors[t].file} holds it"
                         + _more(len(elsewhere) - 1, "tensor"),
                         "an index that matches its shards' headers (each tensor mapped to "
                         "the shard that stores it)")
            unlisted = sorted(t for t in self.tensors if t not in mapped)
            if unlisted:
                self.add("index", str(index),
                         f"does not list tensor {unlisted[0]!r} of "
                         f"{self.tensors[unlisted[0]].file}"
                         + (f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""),
                         "an index that lists every tensor of its shards")
        return len(self.findings) == before and not self.unreadable

    def _read_header(self, path: Path) -> None:
        where = str(path)
        try:
            header = read_header(path)
        except HeaderError as exc:
            if not isinstance(exc.__cause__, OSError):  # an unreadable file: check_folder says so
                self.add("safetensors", where, exc.problem, exc.expected)
            else:  # its tensors are unknown, not missing
                self.unreadable.append(path.name)
            return
        data_size = header.data_size
        bad: list[str] = []
        for name, meta in header.entries.items():
            problem = header_entry_problem(meta, data_size)
            if problem:
                bad.append(f"tensor {name!r} {problem}")
                self.bad_entries.add(name)
                continue
            if name in self.tensors and self.tensors[name].file != path.name:
                self.duplicates.append((name, self.tensors[name].file, path.name))
            self.tensors[name] = TensorMeta(meta["dtype"], meta["shape"], path.name)
            self.ranges[name] = (path.name, *header.data_range(name))
        if bad:
            self.add("safetensors", where, bad[0] + _more(len(bad) - 1),
                     f"header entries {{dtype, shape, data_offsets}} with a known dtype, whose "
                     f"bytes lie within the file's {data_size} data bytes")
            return
        problem = layout_problem(header)
        if problem:
            self.add("safetensors", where, problem + " (the safetensors library refuses such a "
                     "file when it opens it)", "tensors whose data_offsets follow one another "
                     "from 0 to the end of the file, none overlapping, no bytes left over")

    # ------------------------------------------------------------------------- 6. tensors

    def check_tensors(self, arch: Architecture, structures: list[MoEStructure],
                      spec: QuantizationSpec, tensors_ok: bool) -> list[MoELayerInfo]:
        from moe_runtime.checkpoint.reader import _linears, _tensor_prefix

        tensors = self.tensors
        prefix = _tensor_prefix(arch, structures[0], tensors) if structures else arch.prefix
        layers: list[MoELayerInfo] = []
        for s in structures:
            name = arch.experts_name(prefix, s.index)
            stored = self._expert_bound(name, s.num_experts)
            members = [f"{e}.{p}" for e in range(stored) for p in arch.expert_names]
            try:
                quant = resolve_module(spec, name, members=members, moe=True)
            except CheckpointError as exc:
                self.add_error("quantization", exc)
                continue
            layers.append(MoELayerInfo(
                name=name, index=s.index, num_experts=s.num_experts, top_k=s.top_k,
                hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                activation=s.activation, router=s.router,
                shared_expert_intermediate_size=s.shared_expert_intermediate_size,
                expert_names=arch.expert_names, quant=quant))
        if (not tensors_ok and not tensors) or self.unreadable:
            return layers  # a file's tensors are unknown: none is to be called missing
        self._named_modules_exist(spec)
        self._layers_declared()
        if tensors_ok:  # names of an unreadable shard are reported as such, not as missing
            self._dense_present(prefix)
        # served families have one decoder-layer kind per MoE-ness (no hybrid attention)
        if tensors_ok and arch.served:
            self._layers_alike(prefix, {s.index for s in structures}, arch.block,
                               arch.expert_names)
        for layer in layers:
            self._experts(layer)
        self._embeddings()
        self._dense_dtypes()
        try:
            linears = _linears(spec, tensors, layers)
        except CheckpointError as exc:
            self.add_error("quantization", exc)
            return layers  # formats unknown: the stored shapes cannot be judged (packed or not)
        self._linears(linears)
        self._attention_shapes(arch, prefix, linears)
        self._shared_expert_shapes(layers, linears)
        if tensors_ok and arch.served:
            self._tied_lm_head()
            self._unread_dense_tensors(arch, prefix, layers)
        return layers

    def _shared_expert_shapes(self, layers: list[MoELayerInfo], linears) -> None:
        """A layer's shared expert has the intermediate size config.json gives it (DeepSeek-V3:
        ``moe_intermediate_size x n_shared_experts``; Qwen2-MoE:
        ``shared_expert_intermediate_size``); a wrong one passed the check and loading refused
        the tensor."""
        formats_of = {module: quant.format for module, quant in linears}
        wrong = []
        for layer in layers:
            size = layer.shared_expert_intermediate_size
            block = layer.name.rsplit(".experts", 1)[0]
            gate, up, down = layer.expert_names
            for container in (f"{block}.shared_experts", f"{block}.shared_expert"):
                if f"{container}.{gate}.weight" not in self.tensors:
                    continue
                h = layer.hidden_size
                for proj, shape in ((gate, (size, h)), (up, (size, h)), (down, (h, size))):
                    name = f"{container}.{proj}.weight"
                    meta = self.tensors.get(name)
                    if meta is None or len(meta.shape) != 2 or size is None:
                        continue  # missing: the layer rules; no size: nothing declared
                    layout = LAYOUTS.get(formats_of.get(f"{container}.{proj}", ""))
                    if layout is not None and meta.dtype not in layout.weight_dtypes:
                        continue  # stored in another format than resolved: _linears says so
                    elements = (meta.shape[0], meta.shape[1] * (layout.pack if layout else 1))
                    if elements != shape:
                        wrong.append((name, elements, shape))
        if not wrong:
            return
        name, elements, shape = wrong[0]
        f = self._model_fields()
        said = ", ".join(f"{k} {f[k]}" for k in ("moe_intermediate_size", "n_shared_experts",
                                                   "shared_expert_intermediate_size") if k in f)
        self.add("tensors", str(self.folder / CONFIG),
                 f"the shared expert tensor {name!r} holds {list(elements)} ([out, in] "
                 f"elements), but config.json ({said}) gives it {list(shape)}"
                 + _more(len(wrong) - 1, "tensor") + "; loading would refuse the tensor",
                 f"the shared expert's intermediate size the tensors hold "
                 f"({elements[0] if elements[1] == shape[1] else elements[1]})")

    # leaves loading reads beside a module's weight (the dense linears' scales), or that the
    # served model needs not (KV-cache scales: the cache is kept in the model's dtype; RoPE's
    # inverse frequencies: recomputed from config.json)
    _READ_BESIDE_WEIGHT = ("weight_scale", "weight_scale_2", "input_scale", "k_scale", "v_scale")
    _RECOMPUTED = ("inv_freq",)

    def _unread_dense_tensors(self, arch: Architecture, prefix: str,
                              layers: list[MoELayerInfo]) -> None:
        """Every tensor outside the experts is one that loading reads: the model is built from
        config.json (on the meta device: no memory) as loading builds it, and a tensor of no
        parameter of it (a bias the config gives the module none for, a stray weight) would be
        dropped without a word, the model computing other numbers than the checkpoint's.

        Only where a tensor is not a plain weight (or a scale) of the model's naming: building
        the model imports transformers' modelling code (seconds), which the usual checkpoint,
        with no bias and no stray name, does not need."""
        if any(f.rule in ("folder", "json", "config", "routing", "quantization")
               for f in self.findings):
            return  # the config is wrong already: building the model from it says no more
        containers = tuple(layer.name + "." for layer in layers)
        usual = ("weight", "e_score_correction_bias", *self._READ_BESIDE_WEIGHT,
                 *self._RECOMPUTED)

        declared_layers = self._model_fields().get("num_hidden_layers")
        layer_number = re.compile(rf"^{re.escape(prefix)}layers\.(\d+)\.")

        def usual_name(name: str) -> bool:  # a plain weight (or scale) of a module of the
            module, _, leaf = name.rpartition(".")  # usual naming: the fast path may skip it
            m = layer_number.match(name)
            if m and isinstance(declared_layers, int) and int(m.group(1)) >= declared_layers:
                return True  # a layer past the declared ones (DeepSeek's MTP): skipped below
            if leaf not in usual:
                return False
            if module == "lm_head":
                return True
            return module.startswith(prefix) and bool(_USUAL_MODULE.match(module[len(prefix):]))

        if all(name.startswith(containers) or usual_name(name) for name in self.tensors):
            return
        try:
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()
            try:
                config = AutoConfig.from_pretrained(str(self.folder))
                if hasattr(config, "quantization_config"):
                    delattr(config, "quantization_config")  # as loading does: weights are ours
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(config)
                keys = list(model.state_dict(keep_vars=True))
            finally:
                hf_logging.set_verbosity(verbosity)
        except Exception:  # noqa: BLE001 - a config transformers refuses: serve names it
            return
        read: set[str] = set()
        for key in keys:  # the names loading looks each parameter up by, in its order
            for cand in (key, key.replace(".mlp.gate.", ".block_sparse_moe.gate."),
                         key.replace(".mlp.", ".block_sparse_moe.")):
                if cand in self.tensors:
                    read.add(cand)
                    break
        declared = self._model_fields().get("num_hidden_layers")
        layer_of = re.compile(r"(?:^|\.)layers\.(\d+)\.")
        unread = []
        for name in self.tensors:
            if name in read or name.startswith(containers):
                continue
            module, _, leaf = name.rpartition(".")
            if leaf in self._RECOMPUTED or (leaf in self._READ_BESIDE_WEIGHT
                                            and f"{module}.weight" in read):
                continue
            m = layer_of.search(name)
            if m and isinstance(declared, int) and int(m.group(1)) >= declared:
                continue  # a layer past the declared ones: _layers_declared (or MTP layers)
            unread.append(name)
        if not unread:
            return
        self.add("tensors", str(self.folder),
                 f"tensor {unread[0]!r} is stored, but the {arch.name} model that config.json "
                 "builds has no parameter it would be loaded into"
                 + _more(len(unread) - 1, "tensor")
                 + ": it would be ignored, and the model would compute other numbers than the "
                 "checkpoint's",
                 "tensors of the model's parameters only (a bias where config.json gives the "
                 "module one, e.g. attention_bias true), or the config of the model the tensors "
                 "are of")

    def _tied_lm_head(self) -> None:
        """With ``tie_word_embeddings`` the output layer is the embeddings: a stored
        ``lm_head.weight`` that differs is loaded into the one tensor both share, and the model
        serves that matrix as its embeddings too."""
        f = self._model_fields()
        tied = self.config.get("tie_word_embeddings", f.get("tie_word_embeddings", False))
        embed = next((n for n in self.tensors if n.endswith("embed_tokens.weight")), None)
        if tied is not True or "lm_head.weight" not in self.tensors or embed is None:
            return
        a, b = self.tensors["lm_head.weight"], self.tensors[embed]
        same = (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)) and self._same_bytes(
            "lm_head.weight", embed)
        if same:
            return
        self.add("tensors", str(self.folder / CONFIG),
                 f"tie_word_embeddings is true, but 'lm_head.weight' is stored and is not "
                 f"{embed!r} ({a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"
                 + (", other values" if (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape))
                    else "") + "): the tied model holds one matrix for both, so one of them "
                 "would be served in place of the other",
                 "tie_word_embeddings false (the checkpoint has its own lm_head), or no "
                 "lm_head.weight (the embeddings serve as the output layer)")

    def _same_bytes(self, x: str, y: str, sample: int = 1 << 20) -> bool:
        """Whether the two tensors' bytes agree at their start, middle and end (``sample`` bytes
        each: the check reads no whole weight)."""
        (fx, sx, ex), (fy, sy, ey) = self.ranges[x], self.ranges[y]
        size = ex - sx
        if size != ey - sy:
            return False
        try:
            with (self.folder / fx).open("rb") as hx, (self.folder / fy).open("rb") as hy:
                for at in sorted({0, max(0, size // 2 - sample // 2), max(0, size - sample)}):
                    n = min(sample, size - at)
                    hx.seek(sx + at)
                    hy.seek(sy + at)
                    if hx.read(n) != hy.read(n):
                        return False
        except OSError:
            return True  # unreadable: reported as such elsewhere
        return True

    def _attention_shapes(self, arch: Architecture, prefix: str, linears) -> None:
        """Each decoder layer's attention tensors have the shapes transformers' attention builds
        from config.json (:meth:`Architecture.attention_tensors`: the head size derived as its
        attention derives it); otherwise loading refuses the first such tensor after the check
        passed."""
        file = str(self.folder / CONFIG)
        try:
            expected = arch.attention_tensors(self.config, file)
        except CheckpointError:
            return  # reported by check_config
        declared = self._model_fields().get("num_hidden_layers")
        if not isinstance(declared, int) or isinstance(declared, bool) or declared < 1:
            return
        formats_of = {module: quant.format for module, quant in linears}
        stored: dict[str, tuple[int, ...]] = {}  # tensor -> its shape in elements
        wrong: list[tuple[str, tuple[int, ...], tuple[int, ...], str]] = []
        layers = range(min(declared, MAX_LAYERS))
        # a tensor the attention needs that no layer stores (one some layers lack is reported
        # by _layers_alike): e.g. DeepSeek's q_proj when config.json's q_lora_rank is null
        absent = [(leaf, how) for leaf, _shape, how in expected.shapes
                  if leaf.endswith(("_proj.weight", "_mqa.weight"))  # norms, biases: optional
                  and not any(f"{prefix}layers.{i}.self_attn.{leaf}" in self.tensors
                             for i in layers)]
        if absent and any(f"{prefix}layers.{i}.self_attn." in t for t in self.tensors
                          for i in layers[:1]):
            held = sorted({t.split(".self_attn.", 1)[1] for t in self.tensors
                           if t.startswith(f"{prefix}layers.0.self_attn.")
                           and t.endswith(".weight")} - {leaf for leaf, _s, _h in expected.shapes})
            leaf, how = absent[0]
            self.add("tensors", file,
                     f"the attention config.json describes needs 'self_attn.{leaf}' ({how}) in "
                     f"every decoder layer, but no layer stores it"
                     + _more(len(absent) - 1, "tensor")
                     + (f"; the layers store {', '.join(repr(h) for h in held[:4])} instead"
                        if held else "") + "; loading would refuse the checkpoint",
                     f"the config of the attention the tensors are of ({arch.name}: e.g. "
                     "q_lora_rank null means one q_proj, a number q_a_proj and q_b_proj)"
                     if arch.name.startswith("Deepseek") else
                     "the config of the attention the tensors are of")
        for i in layers:
            for leaf, shape, how in expected.shapes:
                name = f"{prefix}layers.{i}.self_attn.{leaf}"
                meta = self.tensors.get(name)
                if meta is None:
                    continue  # a missing tensor is reported by the rules above
                elements = tuple(meta.shape)
                if leaf.endswith(".weight") and len(elements) == 2 and len(shape) == 2:
                    layout = LAYOUTS.get(formats_of.get(name[: -len(".weight")], ""))
                    if layout is not None and meta.dtype not in layout.weight_dtypes:
                        continue  # stored in another format than resolved: _linears says so
                    elements = (elements[0], elements[1] * (layout.pack if layout else 1))
                stored[name] = elements
                if elements != tuple(shape):
                    wrong.append((name, elements, tuple(shape), how))
        if not wrong:
            return
        name, elements, shape, how = wrong[0]
        meta = self.tensors[name]
        packed = (f" (stored {list(meta.shape)}, {meta.dtype} packed)"
                  if list(meta.shape) != list(elements) else "")
        size = (f", the head size from {expected.head_dim[1]}" if expected.head_dim else "")
        self.add("tensors", file,
                 f"tensor {name!r} of {meta.file} holds {list(elements)}"
                 + (" ([out, in] elements)" if len(elements) == 2 else "") +
                 f"{packed}, but transformers builds it as {list(shape)} = {how}{size}"
                 + _more(len(wrong) - 1, "tensor") + "; loading would refuse the tensor",
                 self._attention_remedy(arch, expected, stored))

    def _attention_remedy(self, arch: Architecture, expected, stored: dict) -> str:
        """What to change: the head_dim the stored tensors hold, where one value fits them all."""
        fallback = ("config.json attention sizes (num_attention_heads, num_key_value_heads, "
                    "head_dim, hidden_size) that give the stored tensors' shapes")
        if expected.head_dim is None or not expected.heads:
            return fallback
        o_in = [shape[1] for name, shape in stored.items() if name.endswith(".o_proj.weight")]
        if not o_in or o_in[0] % expected.heads:
            return fallback
        candidate = o_in[0] // expected.heads
        config = dict(self.config or {})
        nested = arch.text_config and isinstance(config.get("text_config"), dict)
        if nested:
            config["text_config"] = {**config["text_config"], "head_dim": candidate}
        else:
            config["head_dim"] = candidate
        try:
            fitted = {leaf: tuple(shape) for leaf, shape, _ in
                      arch.attention_tensors(config, "config.json").shapes}
        except CheckpointError:
            return fallback
        if all(fitted.get(name.split(".self_attn.", 1)[1]) == shape
               for name, shape in stored.items()):
            where = "text_config." if nested else ""
            return f"{where}head_dim {candidate} (what the stored attention tensors hold)"
        return fallback

    def _named_modules_exist(self, spec: QuantizationSpec) -> None:
        if not spec.quantized_layers:
            return
        modules = sorted({canonical_name(n).rsplit(".", 1)[0] + "." for n in self.tensors})

        def exists(key: str) -> bool:  # a module whose name is key, or starts with "key."
            prefix = canonical_name(key) + "."
            i = bisect.bisect_left(modules, prefix)
            return i < len(modules) and modules[i].startswith(prefix)

        absent = [e.key for e in spec.quantized_layers if not exists(e.key)]
        if absent:
            self.add("modules", spec.file_of("quantized_layers"),
                     f"quantized_layers names module {absent[0]!r}, which no tensor of the "
                     f"checkpoint belongs to{_more(len(absent) - 1, 'module')}",
                     "quantized_layers keys naming modules whose tensors are in the "
                     "safetensors files")

    def stored_experts(self) -> dict[str, set[int]]:
        """Expert indices the tensors hold, per experts container (one pass over the names)."""
        if self._stored_experts is None:
            found: dict[str, set[int]] = defaultdict(set)
            pattern = re.compile(r"^(.*\.experts)\.(\d+)\.")
            for name in self.tensors:
                m = pattern.match(name)
                if m:
                    found[m.group(1)].add(int(m.group(2)))
            self._stored_experts = found
        return self._stored_experts

    def _layers_declared(self) -> None:
        """Every decoder layer the tensors hold is one the config declares (else the model would
        be built without it, and serve other numbers than the checkpoint's)."""
        f = self._model_fields()
        declared = f.get("num_hidden_layers")
        if not isinstance(declared, int):
            return
        extra = f.get("num_nextn_predict_layers")  # DeepSeek stores its MTP layers after them
        limit = declared + (extra if isinstance(extra, int) and extra > 0 else 0)
        pattern = re.compile(r"(?:^|\.)layers\.(\d+)\.")
        beyond = sorted({int(m.group(1)) for t in self.tensors if (m := pattern.search(t))
                         and int(m.group(1)) >= limit})
        if beyond:
            self.add("tensors", str(self.folder / CONFIG),
                     f"num_hidden_layers is {declared}, but the tensors hold decoder layer "
                     f"{beyond[-1]}" + _more(len(beyond) - 1, "layer"),
                     f"num_hidden_layers {beyond[-1] + 1 - (limit - declared)} (the layers the "
                     "tensors hold), or tensors of the declared layers only")

    # tensors every served decoder family (Qwen2/3-MoE, Mixtral, DeepSeek-V3) stores: the loader
    # refuses the model without them, so the check says so first
    DENSE_PER_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight")
    DENSE_MODEL = ("embed_tokens.weight", "norm.weight")

    def _dense_present(self, prefix: str) -> None:
        """The embeddings, the final norm, each declared layer's two norms and, unless the
        embeddings are tied, ``lm_head.weight``: what loading reads besides the MoE layers."""
        f = self._model_fields()
        declared = f.get("num_hidden_layers")
        if not isinstance(declared, int) or declared < 1 or not self.tensors:
            return
        # a prefix the tensors do not use at all (a foreign naming) is reported elsewhere
        if not any(name.startswith(prefix) for name in self.tensors):
            return
        wanted = [prefix + n for n in self.DENSE_MODEL]
        tied = self.config.get("tie_word_embeddings", f.get("tie_word_embeddings", False))
        if tied is not True:
            wanted.append("lm_head.weight")
        for i in range(min(declared, MAX_LAYERS)):
            wanted += [f"{prefix}layers.{i}.{n}" for n in self.DENSE_PER_LAYER]
        hidden = f.get("hidden_size")
        if isinstance(hidden, int) and not isinstance(hidden, bool):  # RMSNorms of [hidden]
            norms = [n for n in wanted if n.endswith("norm.weight") and n in self.tensors
                     and tuple(self.tensors[n].shape) != (hidden,)]
            if norms:
                self.add("tensors", str(self.folder / self.tensors[norms[0]].file),
                         f"tensor {norms[0]!r} has shape {list(self.tensors[norms[0]].shape)}, "
                         f"but config.json's hidden_size is {hidden}"
                         + _more(len(norms) - 1, "tensor") + " (the model's norms hold one "
                         "weight per hidden feature); loading would refuse the tensor",
                         f"[{hidden}], or the hidden_size the tensors hold")
        missing = [n for n in wanted if n not in self.tensors]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:4]) + (
                f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            self.add("tensors", str(self.folder),
                     f"{len(missing)} tensor(s) the model needs are missing: {shown} (the model "
                     "cannot be loaded without them)",
                     "the embeddings, the final norm, both norms of each of the "
                     f"{declared} declared decoder layers" + ("" if tied is True else
                                                              ", and lm_head.weight (the "
                                                              "embeddings are not tied)"))

    def _layers_alike(self, prefix: str, moe_layers: set[int], block: str,
                      mlp_names: tuple[str, str, str]) -> None:
        """Decoder layers store the same module weights and biases: outside the MLP block
        (``block``: attention and the rest) every layer holds what the others hold; inside it,
        the layers of its kind (MoE, or dense) do, and a dense layer holds at least its
        ``block.{gate, up, down}.weight`` (``mlp_names``), so that a kind of one layer (DeepSeek-V3's
        first dense layer) is checked too. Expert tensors are checked expert by expert; scales
        differ legitimately between layers of a mixed-precision export, so only weights and
        biases are compared."""
        declared = self._model_fields().get("num_hidden_layers")
        if not isinstance(declared, int) or declared < 1:
            return
        pattern = re.compile(rf"^{re.escape(prefix)}layers\.(\d+)\.(.+\.(?:weight|bias))$")
        expert = re.compile(r"(?:^|\.)experts\.\d+\.")
        held: dict[int, set[str]] = defaultdict(set)
        for name in self.tensors:
            m = pattern.match(name)
            if (m and int(m.group(1)) < declared and not expert.search(m.group(2))
                    and m.group(2) not in self.DENSE_PER_LAYER):  # those: _dense_present
                held[int(m.group(1))].add(m.group(2))
        inside = block + "."
        layers = list(range(min(declared, MAX_LAYERS)))
        dense_mlp = {f"{inside}{n}.weight" for n in mlp_names}
        missing: list[str] = []
        kinds = []
        for kind, group, part, needed in (
                ("decoder layers", layers, lambda t: not t.startswith(inside), set()),
                ("MoE decoder layers", [i for i in layers if i in moe_layers],
                 lambda t: t.startswith(inside), set()),
                ("dense decoder layers", [i for i in layers if i not in moe_layers],
                 lambda t: t.startswith(inside), dense_mlp)):
            if not group or (len(group) < 2 and not needed):
                continue
            union = {t for i in group for t in held[i] if part(t)} | needed
            found = [f"{prefix}layers.{i}.{t}" for i in group for t in sorted(union - held[i])]
            if found:
                missing += found
                kinds.append(f"the other {kind}" if not needed or len(group) > 1 else
                             f"a dense decoder layer's MLP ({inside}{{{', '.join(mlp_names)}}}"
                             ".weight)")
        if missing:
            shown = ", ".join(repr(n) for n in missing[:4]) + (
                f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            self.add("tensors", str(self.folder),
                     f"{len(missing)} tensor(s) that {' and '.join(kinds)} store are missing: "
                     f"{shown} (the model cannot be loaded without them)",
                     "every decoder layer storing the module weights and biases of its kind")

    def _expert_bound(self, container: str, declared: int) -> int:
        """The experts of ``container`` worth checking one by one: the declared count, but never
        more than one past the highest the tensors hold (a config declaring 10**30 experts is
        one finding, not 10**30 tensor names)."""
        stored = self.stored_experts().get(container)
        return min(declared, (max(stored) if stored else 0) + 1)

    def _experts(self, layer: MoELayerInfo) -> None:
        fmt = layer.quant.format
        layout = LAYOUTS.get(fmt)
        h, i = layer.hidden_size, layer.intermediate_size
        where = f"MoE layer {layer.name} ({fmt}, {layer.quant.source})"
        if layout is None:
            self.add("tensors", where, f"no tensor layout is known for format {fmt!r}",
                     ", ".join(sorted(LAYOUTS)))
            return
        for dim, value in (("hidden_size", h), ("intermediate size", i)):
            unit = layout.block or layout.pack
            if value % unit:
                self.add("tensors", where, f"{dim} {value} is not a multiple of {unit}, which "
                         f"{fmt} stores whole blocks of", f"a multiple of {unit}")
                return
        gate, up, down = layer.expert_names
        problems: dict[tuple[str, str], list[str]] = defaultdict(list)
        bound = self._expert_bound(layer.name, layer.num_experts)
        if bound < layer.num_experts and bound > 1:  # bound 1: no expert stored, reported below
            self.add("tensors", where,
                     f"the config declares {layer.num_experts} experts, but the tensors hold "
                     f"none past expert {bound - 1}: tensor "
                     f"'{layer.expert_module(bound, gate)}.weight' is missing, and so are those of "
                     f"every expert up to {layer.num_experts - 1}",
                     f"a config whose expert count matches the tensors ({bound})")
        for e in range(bound):
            for proj, out, inp in ((gate, i, h), (up, i, h), (down, h, i)):
                module = layer.expert_module(e, proj)
                for tensor, dtypes, shape in layout.expected(module, out, inp):
                    problem = _tensor_problem(self.tensors.get(tensor), dtypes, shape)
                    if problem and tensor not in self.bad_entries:
                        problems[problem].append(tensor)
        for (problem, accepted), names in problems.items():
            meta = self.tensors.get(names[0])  # stored (a wrong shape or dtype): its file too
            self.add("tensors", where, f"tensor {names[0]!r}"
                     + (f" (in {meta.file})" if meta is not None else "") + f" {problem}"
                     + _more(len(names) - 1, "tensor"), accepted)
        self._unread_expert_tensors(layer, layout, bound, where)
        # no expert beyond the config's count, and the router scores exactly the experts
        beyond = sorted(e for e in self.stored_experts().get(layer.name, ())
                        if e >= layer.num_experts)
        if beyond:
            self.add("tensors", where,
                     f"the tensors hold expert {beyond[-1]} but the config declares "
                     f"{layer.num_experts} experts", f"experts 0..{layer.num_experts - 1} only, "
                     "or a config whose expert count matches the tensors")
        block = layer.name.rsplit(".experts", 1)[0]
        router = self.tensors.get(f"{block}.gate.weight")
        if router is None:
            self.add("tensors", where, f"the router tensor '{block}.gate.weight' is missing",
                     f"a router weight [{layer.num_experts}, {h}]")
        elif tuple(router.shape) != (layer.num_experts, h):
            self.add("tensors", where, f"the router '{block}.gate.weight' has shape "
                     f"{list(router.shape)}, but the config declares {layer.num_experts} experts "
                     f"of hidden size {h}", f"a router weight [{layer.num_experts}, {h}]")
        if layer.router.has_correction_bias:
            bias = self.tensors.get(f"{block}.gate.e_score_correction_bias")
            if bias is None or tuple(bias.shape) != (layer.num_experts,):
                self.add("tensors", where, f"'{block}.gate.e_score_correction_bias' is "
                         + ("missing" if bias is None else f"of shape {list(bias.shape)}"),
                         f"a float bias [{layer.num_experts}] (the router's topk_method "
                         "'noaux_tc' selects with it)")

    def expert_tensors(self) -> dict[str, list[str]]:
        """The tensor names under each experts container's numbered experts (one pass)."""
        if self._expert_tensors is None:
            found: dict[str, list[str]] = defaultdict(list)
            pattern = re.compile(r"^(.*\.experts)\.\d+\.")
            for name in self.tensors:
                m = pattern.match(name)
                if m:
                    found[m.group(1)].append(name)
            self._expert_tensors = found
        return self._expert_tensors

    def _unread_expert_tensors(self, layer: MoELayerInfo, layout: TensorLayout, bound: int,
                               where: str) -> None:
        """An expert's tensors are its format's and no others: the experts backends read the
        format's tensors alone, so a stored bias (or any other tensor) would be dropped without a
        word and the layer would serve other numbers than the checkpoint's."""
        gate, up, down = layer.expert_names
        known: set[str] = set()
        for e in range(bound):
            for proj in (gate, up, down):
                known.update(t for t, _d, _s in layout.expected(layer.expert_module(e, proj),
                                                                  1, layout.block or 1))
        projections = "|".join(re.escape(p) for p in (gate, up, down))
        own = re.compile(rf"^{re.escape(layer.name)}\.(\d+)\.(?:{projections})\.[^.]+$")
        extra = []
        for name in self.expert_tensors().get(layer.name, ()):
            if name in known:
                continue
            m = own.match(name)
            if m and int(m.group(1)) >= layer.num_experts:
                continue  # an expert past the config's count: reported as such
            extra.append(name)
        if not extra:
            return
        leaves = sorted({n.rsplit(".", 1)[-1] for n in known})
        self.add("tensors", where,
                 f"tensor {extra[0]!r} is stored, but no {layer.quant.format} expert reads it"
                 + _more(len(extra) - 1, "tensor")
                 + ": the experts backends take only the format's tensors, so it would be "
                 "ignored and the layer would compute other numbers than the checkpoint's",
                 f"per expert projection ({gate}, {up}, {down}) only "
                 + ", ".join(leaves) + f" (what {layer.quant.format} stores)")

    def _embeddings(self) -> None:
        f = self._model_fields()
        vocab, hidden = f.get("vocab_size"), f.get("hidden_size")
        where = "text_config." if f is not self.config else ""
        for name, meta in self.tensors.items():
            if not (name.endswith("embed_tokens.weight") or name == "lm_head.weight"):
                continue
            if "vocab_size" not in f and len(meta.shape) == 2:
                self.add("tensors", str(self.folder / CONFIG),
                         f"has no {where}vocab_size, so transformers would build the embeddings "
                         f"at its config class's default size, but tensor {name!r} holds "
                         f"{meta.shape[0]} rows", f"{where}vocab_size {meta.shape[0]}")
                return
            if isinstance(vocab, int) and isinstance(hidden, int) and tuple(meta.shape) != (
                    vocab, hidden):
                self.add("tensors", f"{self.folder / meta.file}: tensor {name!r}",
                         f"has shape {list(meta.shape)}, but config.json declares vocab_size "
                         f"{vocab} and hidden_size {hidden}", f"[{vocab}, {hidden}]")

    # tensors no quantization config covers (norms, embeddings, biases; lm_head is a linear,
    # checked with the others): transformers casts what it loads to the model's dtype, so an
    # integer or boolean one would load without a word and serve garbage (an int8 embedding
    # rounds every value; a bool norm is all ones)
    _DENSE = re.compile(r"(?:^|\.)(?:[a-z_]*norm|embed_tokens)\.weight$|\.bias$")
    FLOAT_DTYPES = ("BF16", "F16", "F32")

    def _dense_dtypes(self) -> None:
        wrong: dict[str, list[str]] = defaultdict(list)
        for name, meta in self.tensors.items():
            if self._DENSE.search(name) and meta.dtype not in self.FLOAT_DTYPES:
                wrong[meta.dtype].append(name)
        for dtype, names in wrong.items():
            meta = self.tensors[names[0]]
            self.add("tensors", str(self.folder / meta.file),
                     f"tensor {names[0]!r} is {dtype}, but it is no quantized weight (a norm, an "
                     "embedding or a bias): transformers would cast it to the model's "
                     "float dtype and serve the rounded values" + _more(len(names) - 1, "tensor"),
                     " or ".join(self.FLOAT_DTYPES))

    def _linears(self, linears) -> None:
        problems: dict[tuple[str, str], list[str]] = defaultdict(list)
        for module, quant in linears:
            layout = LAYOUTS.get(quant.format)
            weight = self.tensors.get(f"{module}.weight")
            if layout is None or weight is None or len(weight.shape) != 2:
                continue
            if weight.dtype not in layout.weight_dtypes:
                problems[(f"is stored as {weight.dtype}, but the quantization config resolves "
                          f"it to {quant.format} ({quant.source})",
                          f"{' or '.join(layout.weight_dtypes)}, or a quantization config that "
                          "lists the module with its stored format")].append(f"{module}.weight")
                continue
            if not layout.scalars and f"{module}.weight_scale" in self.tensors:
                # loading dequantizes a weight with a weight_scale, and refuses an unquantized one
                problems[(f"is stored beside the {weight.dtype} weight '{module}.weight': "
                          "loading dequantizes a weight that has a weight_scale, and refuses "
                          "one that is not F8_E4M3 or U8 (NVFP4)",
                          "no weight_scale for an unquantized module, or its weight in the "
                          "quantized format the scale belongs to")].append(
                    f"{module}.weight_scale")
                continue
            out, stored_in = weight.shape
            for tensor, dtypes, shape in layout.expected(module, out, stored_in * layout.pack):
                if tensor.endswith((".weight", ".input_scale")):
                    continue  # the weight was checked; activation scales vary for linears
                problem = _tensor_problem(self.tensors.get(tensor), dtypes, shape)
                if problem and tensor not in self.bad_entries:
                    problems[problem].append(tensor)
        for (problem, accepted), names in problems.items():
            meta = self.tensors.get(names[0])
            where = str(self.folder / meta.file) if meta else str(self.folder)
            self.add("tensors", where, f"tensor {names[0]!r} {problem}"
                     + _more(len(names) - 1, "tensor"), accepted)

    # -------------------------------------------------------------------------- 7. scales

    def _scan(self, np, mm, dtype: str, names: list[str], bad: dict[str, list[str]]) -> None:
        """One vectorized test of the scales ``names`` (of one file and dtype); only when one
        fails are the values decoded, again in one pass, to say what is wrong with each."""
        names = [n for n in names if self.ranges[n][2] > self.ranges[n][1]]  # empty: nothing
        if not names:
            return
        chunks = [mm[self.ranges[n][1]:self.ranges[n][2]] for n in names]
        raw = np.concatenate(chunks)
        self.scale_count += len(names)
        self.scale_bytes += raw.size
        ok = _POSITIVE[dtype](np, raw)
        if ok.all():
            return
        counts = np.array([c.size // DTYPE_SIZES[dtype] for c in chunks])
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        failed = np.flatnonzero(~np.logical_and.reduceat(ok, starts))
        values = _values(np, dtype, raw)
        kinds = [(label, np.logical_or.reduceat(test(np, values), starts))
                 for label, test in _SCALE_KINDS]
        for j in failed:
            said = [label for label, per_tensor in kinds if per_tensor[j]]
            bad[" and ".join(said) or "values that are not finite and positive"].append(
                names[int(j)])

    def check_scales(self) -> None:
        """Every scale tensor finite and positive: one vectorized pass per file and dtype, in
        batches of at most 16 MiB."""
        import numpy as np

        start = time.perf_counter()
        by_file: dict[str, list[str]] = defaultdict(list)
        wrong_dtype = []
        for name, meta in self.tensors.items():
            if _SCALE_LEAF.search(name.rsplit(".", 1)[-1]):
                if meta.dtype not in _POSITIVE:
                    wrong_dtype.append(name)
                else:
                    by_file[meta.file].append(name)
        if wrong_dtype:
            meta = self.tensors[wrong_dtype[0]]
            self.add("scales", str(self.folder / meta.file),
                     f"scale tensor {wrong_dtype[0]!r} is {meta.dtype}"
                     + _more(len(wrong_dtype) - 1, "tensor"), "float32 or float8_e4m3fn scales")
        bad: dict[str, list[str]] = defaultdict(list)
        for file, names in by_file.items():
            try:
                mm = np.memmap(self.folder / file, dtype=np.uint8, mode="r")
            except (OSError, ValueError):
                continue
            groups: dict[str, list[str]] = defaultdict(list)
            for name in names:
                groups[self.tensors[name].dtype].append(name)
            for dtype, group in groups.items():
                for batch in _batches(group, lambda n: self.ranges[n][2] - self.ranges[n][1]):
                    self._scan(np, mm, dtype, batch, bad)
            del mm
        self.scale_seconds = time.perf_counter() - start
        for kind, names in bad.items():
            meta = self.tensors[names[0]]
            self.add("scales", str(self.folder / meta.file),
                     f"scale tensor {names[0]!r} holds {kind}" + _more(len(names) - 1, "tensor"),
                     "finite, positive scales (a scale multiplies every weight or activation it "
                     "covers: NaN, infinite, zero or negative ones give wrong outputs)")

    def _scalar(self, name: str, maps: dict) -> float | None:
        """The value of a one-element float32 tensor, read from its file (``maps``: the files
        memory-mapped so far), or None where it is missing, misshapen or unreadable (the tensor
        rules report those)."""
        import numpy as np

        meta, where = self.tensors.get(name), self.ranges.get(name)
        if meta is None or where is None or meta.dtype != "F32" or where[2] - where[1] != 4:
            return None
        file, start, end = where
        if file not in maps:
            try:
                maps[file] = np.memmap(self.folder / file, dtype=np.uint8, mode="r")
            except (OSError, ValueError):
                maps[file] = None
        if maps[file] is None:
            return None
        return float(np.frombuffer(maps[file][start:end].tobytes(), dtype="<f4")[0])

    def check_shared_scales(self, layers: list[MoELayerInfo]) -> None:
        """The scalars loading takes as one (:mod:`moe_runtime.methods`): an NVFP4 expert's gate
        and up ``weight_scale_2`` (its fused gate/up GEMM has one global scale), and the layer's
        gate/up and down ``input_scale`` (activations are quantized once, for every expert). A
        difference passed the check and stopped serve's load, after the memory was taken."""

        maps: dict[str, Any] = {}

        def value(name: str) -> float | None:
            v = self._scalar(name, maps)
            return None if v is None or math.isnan(v) else v  # NaN: reported by check_scales

        for layer in layers:
            fmt = layer.quant.format
            layout = LAYOUTS.get(fmt)
            if layout is None or layout.input_scale is None:
                continue  # unquantized: no scales
            gate, up, down = layer.expert_names
            where = f"MoE layer {layer.name} ({fmt}, {layer.quant.source})"
            bound = self._expert_bound(layer.name, layer.num_experts)
            if "weight_scale_2" in layout.scalars:
                differ = []
                for e in range(bound):
                    g, u = (f"{layer.expert_module(e, p)}.weight_scale_2" for p in (gate, up))
                    vg, vu = value(g), value(u)
                    if vg is not None and vu is not None and vg != vu:
                        differ.append((g, vg, u, vu))
                if differ:
                    g, vg, u, vu = differ[0]
                    self.add("scales", where,
                             f"{u!r} is {vu:.6g} but {g!r} is {vg:.6g}"
                             + _more(len(differ) - 1, "expert")
                             + f": an expert's {gate} and {up} run as one fused GEMM with one "
                             "global scale, so loading refuses scales that differ",
                             f"{gate} and {up} of each expert with the same weight_scale_2 "
                             "(as ModelOpt exports them)")
            if not layout.input_scale:
                continue
            for label, projs in ((f"{gate}/{up}", (gate, up)), (down, (down,))):
                names = [f"{layer.expert_module(e, p)}.input_scale" for e in range(bound)
                         for p in projs]
                seen = [(n, v) for n in names if (v := value(n)) is not None]
                if not seen:
                    continue
                first, v0 = seen[0]
                other = [(n, v) for n, v in seen if v != v0]
                if other:
                    n, v = other[0]
                    self.add("scales", where,
                             f"the {label} input_scale differs between experts: {n!r} is "
                             f"{v:.6g} but {first!r} is {v0:.6g}"
                             + _more(len(other) - 1, "tensor")
                             + ": the layer's activations are quantized once, for every expert, "
                             "so loading refuses input scales that differ",
                             f"one {label} input_scale shared by every expert of the layer (as "
                             "ModelOpt exports it: the largest over the experts)")


    def check_scale_range(self) -> None:
        """Every per-tensor (one float32 value) scale small enough that what it scales stays
        finite in float32, where kernels accumulate: ``weight_scale_2`` times the largest value
        an NVFP4 block reaches before it (E2M1's 6 times E4M3's 448), ``weight_scale`` and
        ``input_scale`` times E4M3's 448. A scale past that passed the finite-and-positive rule
        and served NaN (found by an audit, 2026-12-07: ``weight_scale_2`` of 1e38 on one
        expert)."""

        maps: dict[str, Any] = {}
        over: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for name in self.tensors:
            leaf = name.rsplit(".", 1)[-1]
            reach = _SCALE_REACH.get(leaf)
            v = self._scalar(name, maps) if reach is not None else None
            if v is not None and math.isfinite(v) and v > 0 and v * reach[0] > _F32_MAX:
                over[leaf].append((name, v))
        for leaf, found in over.items():
            name, v = found[0]
            reach, what = _SCALE_REACH[leaf]
            self.add("scales", str(self.folder / self.tensors[name].file),
                     f"scale tensor {name!r} is {v:.6g}" + _more(len(found) - 1, "tensor")
                     + f": {what} times it reaches {v * reach:.3g}, beyond float32's "
                     f"{_F32_MAX:.4g}, so the layer's outputs are infinite or NaN",
                     f"a {leaf} of at most {_F32_MAX / reach:.3g} (ModelOpt exports the tensor's "
                     f"largest magnitude divided by {reach:g}: weights and activations of real "
                     "models give scales far below 1)")


# modules (under the model's prefix) of the served families' usual naming: a tensor of any other
# module makes the check build the model (on the meta device) to see whether loading reads it
_USUAL_MODULE = re.compile(
    r"^(?:embed_tokens|norm|layers\.\d+\.(?:input_layernorm|post_attention_layernorm|"
    r"self_attn\.(?:q_proj|k_proj|v_proj|o_proj|q_norm|k_norm|q_a_proj|q_a_layernorm|q_b_proj|"
    r"kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj)|(?:mlp|block_sparse_moe)\.(?:gate|gate_proj|"
    r"up_proj|down_proj|shared_expert_gate|shared_experts?\.(?:gate_proj|up_proj|down_proj))))$")

# largest magnitude a per-tensor scale multiplies (code x block scale), and its description
_SCALE_REACH = {
    "weight_scale_2": (6.0 * 448.0, "the largest NVFP4 value before it (E2M1's 6 x E4M3's 448)"),
    "weight_scale": (448.0, "the largest FP8 (E4M3) value, 448,"),
    "input_scale": (448.0, "the largest FP8 (E4M3) value, 448,"),
}
_F32_MAX = 3.4028234663852886e38

# ----------------------------------------------------------------------------- small helpers


_BATCH_BYTES = 16 << 20  # scales tested at once: bounds the check's memory on large checkpoints


def _batches(names: list[str], size_of) -> list[list[str]]:
    out, batch, total = [], [], 0
    for name in names:
        size = size_of(name)
        if batch and total + size > _BATCH_BYTES:
            out.append(batch)
            batch, total = [], 0
        batch.append(name)
        total += size
    return out + ([batch] if batch else [])


def _more(n: int, what: str = "") -> str:
    if n <= 0:
        return ""
    return f" (and {n} more {what + ('s' if n > 1 else '')} like it)" if what else (
        f" (and {n} more)")


def _few(items: list[str]) -> str:
    if not items:
        return "nothing"
    shown = ", ".join(repr(x) for x in items[:_LISTED])
    return shown + (f" and {len(items) - _LISTED} more" if len(items) > _LISTED else "")


def token_id_problem(key: str, value: Any, vocab_size: int | None) -> tuple[str, str] | None:
    """``(what is wrong, accepted)`` for a special token id (``eos_token_id``...) of config.json
    or generation_config.json, or ``None``: null or absent, or an integer in ``[0, vocab_size)``
    (``eos_token_id`` also a non-empty list of them; an unknown ``vocab_size``: any integer
    >= 0). ``what is wrong`` follows the value in a sentence."""
    if value is None:
        return None
    several = key == "eos_token_id"
    bound = (f"an integer from 0 to {vocab_size - 1} (the vocabulary's {vocab_size} tokens)"
             if vocab_size else "an integer >= 0")
    accepted = (f"{bound}, a non-empty list of such integers, or null" if several
                else f"{bound}, or null")
    if several and isinstance(value, list):
        if not value:
            return ": an empty list names no token to stop on", accepted
        ids = value
    else:
        ids = [value]
    for v in ids:
        which = f": its {_short(v)} is" if ids is value else ","
        if isinstance(v, bool) or not isinstance(v, int):
            return f"{which} no token id ({type(v).__name__}, not an integer)", accepted
        if v < 0 or (vocab_size is not None and v >= vocab_size):
            vocabulary = f" of {vocab_size} tokens (vocab_size)" if vocab_size else ""
            return f"{which} outside the vocabulary{vocabulary}", accepted
    return None


def _tokenizer_json_ids(data: dict) -> list[tuple[int, str]]:
    """``(id, token)`` of a tokenizer.json's vocabulary and added tokens (what it can produce)."""
    found: list[tuple[int, str]] = []
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        found += [(i, t) for t, i in vocab.items()
                  if isinstance(i, int) and not isinstance(i, bool)]
    elif isinstance(vocab, list) and vocab:  # Unigram: [[piece, score], ...], ids by position
        last = vocab[-1]
        found.append((len(vocab) - 1, last[0] if isinstance(last, list) and last else "?"))
    for entry in data.get("added_tokens") or ():
        if isinstance(entry, dict) and isinstance(entry.get("id"), int) \
                and not isinstance(entry.get("id"), bool):
            found.append((entry["id"], str(entry.get("content", "?"))))
    return found


def _added_tokens_decoder_ids(data: dict) -> list[tuple[int, str]]:
    """``(id, token)`` of tokenizer_config.json's ``added_tokens_decoder`` (ids as keys)."""
    decoder = data.get("added_tokens_decoder")
    if not isinstance(decoder, dict):
        return []
    return [(int(k), str(v.get("content", "?")) if isinstance(v, dict) else "?")
            for k, v in decoder.items() if isinstance(k, str) and k.isdigit()]


def _tensor_problem(meta: TensorMeta | None, dtypes: tuple, shape) -> tuple[str, str] | None:
    """``(problem, accepted)`` for one expected tensor, or ``None``."""
    if shape is None:
        if meta is not None:
            return ("is present, but the format quantizes no activations (no input scale)",
                    "no input_scale tensors, or a quantization config naming a format with "
                    "activation scales")
        return None
    want = "a scalar" if shape == "scalar" else str(list(shape))
    if meta is None:
        return "is missing", f"{' or '.join(dtypes)} {want}"
    if meta.dtype not in dtypes:
        return (f"is {meta.dtype}, but the format stores {' or '.join(dtypes)}",
                f"{' or '.join(dtypes)} {want}")
    if shape == "scalar":
        if math.prod(meta.shape) != 1:
            return f"has shape {list(meta.shape)}, not one element", f"{meta.dtype} scalar"
    elif tuple(meta.shape) != tuple(shape):
        return f"has shape {list(meta.shape)}", f"{meta.dtype} {want}"
    return None


def _f32_ok(np, raw):
    v = raw.view("<f4")
    return np.isfinite(v) & (v > 0)


def _f16_ok(np, raw):
    v = raw.view("<f2")
    return np.isfinite(v) & (v > 0)


def _f64_ok(np, raw):
    v = raw.view("<f8")
    return np.isfinite(v) & (v > 0)


def _bf16_ok(np, raw):
    v = (raw.view("<u2").astype(np.uint32) << 16).view("<f4")
    return np.isfinite(v) & (v > 0)


def _e4m3_ok(np, raw):
    # float8_e4m3fn: sign bit clear, not zero (0x00), not NaN (0x7f); no infinities.
    return (raw >= 0x01) & (raw <= 0x7E)


def _e5m2_ok(np, raw):
    return (raw >= 0x01) & (raw <= 0x7B)  # 0x7c is +inf, above it NaN


_POSITIVE = {"F32": _f32_ok, "F16": _f16_ok, "F64": _f64_ok, "BF16": _bf16_ok,
             "F8_E4M3": _e4m3_ok, "F8_E5M2": _e5m2_ok}


def _values(np, dtype: str, raw):
    """The scale bytes ``raw`` decoded as float32 (e4m3: only NaN, zero and the sign matter)."""
    if dtype == "F8_E4M3":
        out = np.where(raw & 0x80, np.float32(-1), np.float32(1))
        out[(raw & 0x7F) == 0] = 0
        out[(raw & 0x7F) == 0x7F] = np.nan
        return out
    if dtype == "F8_E5M2":
        return (raw.astype(np.uint16) << 8).view("<f2").astype(np.float32)
    if dtype == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view("<f4")
    return raw.view({"F32": "<f4", "F16": "<f2", "F64": "<f8"}[dtype])


_SCALE_KINDS = (
    ("NaN", lambda np, v: np.isnan(v)),
    ("infinite values", lambda np, v: np.isinf(v)),
    ("zeros", lambda np, v: v == 0),
    ("negative values", lambda np, v: v < 0),
)
