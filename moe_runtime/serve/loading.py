"""The boundary between the server and model loading: a folder in, a ready model out.

:func:`load_for_serving` is the one function the server calls: it checks the folder, plans every
MoE layer once, and hands that :class:`~moe_runtime.planner.Plan` to moe-runtime's loader
(:func:`moe_runtime.integration.transformers.load_model`), which builds the transformers model and
runs each MoE layer through the plan's backends (registered as transformers' ``"moe_runtime"``
experts implementation). The server only reads the :class:`LoadedModel` it returns.
"""

from __future__ import annotations

from pathlib import Path

from moe_runtime.dtypes import MODEL_DTYPES, model_dtype_name

# generation_config.json fields used as sampling defaults (as vLLM reads them), and their names
# in a request
SAMPLING_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                     "max_new_tokens": "max_tokens", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "tokenizer_config.json")


# what each of them may be, as the refusal of a value that is no number says
_DEFAULT_ACCEPTED = {"temperature": "a number >= 0 (0: greedy)",
                     "top_p": "a number in (0, 1]", "top_k": "an integer >= 0 (0 or -1: no top-k)",
                     "max_new_tokens": "an integer >= 1", "min_p": "a number in [0, 1]",
                     "repetition_penalty": "a number > 0 (1: none)"}


class LoadError(RuntimeError):
    """The checkpoint folder cannot be served; the message says why and names the file."""


def __getattr__(name: str):
    # LoadedModel is the transformers integration's (one class); imported lazily, as it needs torch
    if name == "LoadedModel":
        from moe_runtime.integration.transformers import LoadedModel

        return LoadedModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_for_serving(
    model_dir: str | Path,
    *,
    device: str = "cpu",
    moe_runner_backend: str | None = None,
    moe_a2a_backend: str | None = None,
    progress: bool = True,
    dtype: str | None = None,
    transformers_experts: bool = False,
    tokenizer: str | Path | None = None,
    chat_template: str | None = None,
    generation_config: str | Path | None = "auto",
    plugin_options=None,
    deployment=None,
    max_tokens_per_forward: int | None = None,
    tuning_cache: str | None = None,
    token_ranges: bool = False,
    chat_template_origin: str | None = None,
    kv_sequences: tuple[int, int | None] = (1, None),
):
    """Load ``model_dir`` (a local Hugging Face-format folder) for serving on ``device``.

    Returns a :class:`~moe_runtime.integration.transformers.LoadedModel` with its tokenizer, name
    and sampling defaults set. Every MoE layer runs through moe-runtime's plan, made once here for
    ``device`` and ``deployment`` (a :class:`~moe_runtime.planner.Deployment`: the planning
    options of ``moe-runtime plan``; ``moe_runner_backend`` / ``moe_a2a_backend`` pin its
    backends too) and passed to the loader; a pin that cannot run a layer is refused
    (``LoadError`` with the planner's reasons) before any weight is read. Quantized non-MoE
    linears are dequantized to the model dtype at load. ``transformers_experts=True`` instead
    runs transformers' own experts on dequantized weights (the baseline of benchmarks; no plan).
    ``dtype`` overrides the checkpoint's dtype (``None`` or ``"auto"``: the one in config.json).
    ``tokenizer`` is a folder to take the tokenizer from (default: ``model_dir``),
    ``chat_template`` a Jinja template that replaces the tokenizer's (``chat_template_origin``:
    where it came from, as its refusal names it); a tokenizer that turns text into no tokens, has
    token ids past ``vocab_size``, or whose chat template does not compile is refused before any
    weight is read. ``generation_config``: ``"auto"`` (the
    model folder's generation_config.json), a folder holding one, or ``None`` (no sampling
    defaults). ``plugin_options`` (a :class:`~moe_runtime.plugin.manager.PluginOptions`, the
    command line's): how plugins load, for the plan and the model alike (default: the
    environment variables). ``max_tokens_per_forward``: the engine's bound on the tokens of one
    forward (see ``load_model``). ``tuning_cache``: ``plan``'s ``--tuning-cache`` (a path,
    ``"none"``, or ``None``: the default location when it exists); ``token_ranges``: its
    ``--token-ranges`` (an experts backend per measured batch size, docs/tuning.md).
    ``kv_sequences``: ``(sequences, tokens each)`` the KV cache will hold (``None``: the model's
    context), for the memory check made before any weight is read (``moe-runtime check
    --max-batch-size N --max-model-len T``'s estimate): a server whose weights and cache cannot
    fit is refused in seconds, not after loading.
    """
    import attrs

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        from moe_runtime.serve.model_source import config_link_problem

        problem = config_link_problem(path / "config.json") or "it has no config.json"
        raise LoadError(f"{path} is not a model folder: {problem}")
    if dtype not in (None, "auto") and model_dtype_name(dtype, default=None) is None:
        raise LoadError(f"unknown dtype {dtype!r}; choose one of auto, "
                        f"{', '.join(MODEL_DTYPES)}, half (float16) or float (float32)")
    from moe_runtime.planner import Deployment

    deployment = deployment or Deployment()
    pins = {k: v for k, v in (("experts_backend", moe_runner_backend),
                              ("comm_backend", moe_a2a_backend)) if v}
    deployment = attrs.evolve(deployment, **pins)
    if transformers_experts and (deployment.experts_backend or deployment.comm_backend):
        raise LoadError("transformers' own experts take no moe-runtime backend pins")

    from moe_runtime.checkpoint import CheckpointError
    from moe_runtime.checkpoint.check import require_memory_for_plan, require_sound_checkpoint
    from moe_runtime.checkpoint.tensors import WeightError
    from moe_runtime.planner import PlanError
    from moe_runtime.plugin.registry import Registry

    registry = Registry.load(options=plugin_options)
    try:
        _require_served_architecture(path)
        # Check the folder, then plan (no transformers import, no weights): in seconds, so a
        # refused pin fails before the model is built.
        report = require_sound_checkpoint(path, device=device, ep_size=deployment.ep_size,
                                          batch_size=kv_sequences[0],
                                          context_tokens=kv_sequences[1])
        plan = None if transformers_experts else plan_for_serving(
            path, device, deployment, registry, tuning_cache=tuning_cache,
            token_ranges=token_ranges)
        if plan is not None:  # the experts as the planned backends hold them (a float32 copy)
            require_memory_for_plan(report, plan)
        # the sampling defaults are read before the weights, so a bad file fails in seconds
        defaults = {}
        if generation_config is not None:
            defaults = generation_defaults(path if generation_config == "auto"
                                           else Path(generation_config))
        from tqdm.auto import tqdm
        from transformers import AutoTokenizer, GenerationConfig

        from moe_runtime.integration.transformers import load_model

        _require_transformers_config(path)
        tok_dir = Path(tokenizer) if tokenizer is not None else path
        tokenizer = _load_tokenizer(AutoTokenizer, tok_dir, given=tokenizer is not None)
        _require_tokenizer_fits(tokenizer, tok_dir, path)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        _require_compilable_chat_template(
            tokenizer, tok_dir,
            None if chat_template is None else (chat_template_origin or "--chat-template"))
        bar = (lambda total, desc: tqdm(total=total, desc=f"Loading {path.name}", unit="tensor",
                                        disable=not progress))
        loaded = load_model(path, plan=plan, device=device,
                            dtype=None if dtype in (None, "auto") else model_dtype_name(dtype),
                            dequantize_experts=transformers_experts, progress=bar,
                            registry=registry, max_tokens_per_forward=max_tokens_per_forward)
    except (CheckpointError, WeightError, PlanError) as exc:
        raise LoadError(str(exc)) from exc
    model = loaded.model
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return attrs.evolve(loaded, tokenizer=tokenizer, name=path.name,
                        generation_defaults=defaults)


def plan_for_serving(path: Path, device: str, deployment, registry, *,
                     tuning_cache: str | None = None, token_ranges: bool = False):
    """The one plan of ``path`` for ``device`` (probed) and ``deployment``, with the tuning
    cache ``plan`` would read, or the planner's :class:`~moe_runtime.planner.PlanError`."""
    import argparse

    from moe_runtime.checkpoint import read_checkpoint
    from moe_runtime.checkpoint.problems import problems_from_checkpoint
    from moe_runtime.environment import Environment
    from moe_runtime.planner import plan_model
    from moe_runtime.tuning.command import tuning_for

    env = Environment.probe(device=device, modules=registry.required_modules())
    tuning = tuning_for(argparse.Namespace(tuning_cache=tuning_cache, token_ranges=token_ranges),
                        env, registry)
    return plan_model(problems_from_checkpoint(read_checkpoint(path)), registry=registry,
                      environment=env, deployment=deployment, tuning=tuning)


def _load_tokenizer(auto, folder: Path, *, given: bool):
    """The tokenizer of ``folder``; one that is missing, or encodes text to nothing, is refused."""
    how = ("pass --tokenizer with a folder (or cached hub id) that has them" if not given else
           "give --tokenizer a folder that holds tokenizer files")
    present = [f for f in TOKENIZER_FILES if (folder / f).is_file()]
    if not present:
        raise LoadError(f"{folder} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}), "
                        f"so no prompt could be encoded: {how}")
    vocabularies = [f for f in present if f != "tokenizer_config.json"]
    if not vocabularies and not any(folder.glob("*.tiktoken")) and not any(
            folder.glob("merges.txt")):
        # transformers then says to install sentencepiece or tiktoken: the file is what is missing
        raise LoadError(f"{folder} has tokenizer_config.json but no vocabulary for it (none of "
                        f"{', '.join(f for f in TOKENIZER_FILES if f != 'tokenizer_config.json')}"
                        f"): copy the model's tokenizer.json (or its tokenizer.model) beside it, "
                        f"or {how}")
    try:
        tokenizer = auto.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # transformers raises several types for a missing tokenizer
        raise LoadError(f"{folder} has no loadable tokenizer: {exc}") from exc
    if not tokenizer("Hello, world", add_special_tokens=False)["input_ids"]:
        raise LoadError(f"the tokenizer of {folder} ({type(tokenizer).__name__}, from "
                        f"{', '.join(present)}) encodes text to no tokens, so every prompt would "
                        f"be empty: {how}")
    return tokenizer


def _require_tokenizer_fits(tokenizer, tok_dir: Path, model_dir: Path) -> None:
    """Refuse a tokenizer with a token id past config.json's ``vocab_size`` (its size: the largest
    id + 1, added tokens included), before any weight is read: ``--tokenizer`` of another model
    started, then the first token failed in ``embed_tokens`` with "index out of range in self".
    The ids are read as ``moe-runtime check`` reads the model folder's own tokenizer files (its
    ``_tokenizer_json_ids`` / ``_added_tokens_decoder_ids``), and from the loaded tokenizer's
    vocabulary for a tokenizer without those files (a SentencePiece model)."""
    from moe_runtime.checkpoint.check import _added_tokens_decoder_ids, _tokenizer_json_ids
    from moe_runtime.checkpoint.quant_config import read_json_file

    file = model_dir / "config.json"
    data, _ = read_json_file(file)
    fields = data if isinstance(data, dict) else {}
    where = ""
    if isinstance(fields.get("text_config"), dict):  # as the check reads a wrapped config
        fields, where = fields["text_config"], "text_config."
    vocab = fields.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        return  # the checkpoint check reports it, or transformers' default applies
    found: list[tuple[int, str, Path]] = []
    for name, ids in (("tokenizer.json", _tokenizer_json_ids),
                      ("tokenizer_config.json", _added_tokens_decoder_ids)):
        try:
            data, problem = read_json_file(tok_dir / name)
        except OSError:
            continue  # absent (or unreadable: the tokenizer loaded without it)
        if problem is None and isinstance(data, dict):
            found += [(i, t, tok_dir / name) for i, t in ids(data)]
    try:
        found += [(i, t, tok_dir) for t, i in tokenizer.get_vocab().items()
                  if isinstance(i, int)]
    except Exception:  # noqa: BLE001 - a tokenizer class without get_vocab: the files decide
        pass
    if not found:
        return
    top, token, source = max(found, key=lambda f: f[0])
    if top < vocab:
        return
    shown = token if len(token) <= 40 else token[:37] + "..."
    raise LoadError(
        f"the tokenizer {source} has {top + 1} tokens (its largest token id is {top}, "
        f"{shown!r}, added tokens included), but {file}'s {where}vocab_size is {vocab}: the "
        f"embeddings have no row for ids {vocab} to {top}, so a prompt or an answer with one "
        f"fails (index out of range); accepted: a tokenizer of at most {vocab} tokens (ids "
        f"below vocab_size {vocab}; this model's own, or pass --tokenizer with the tokenizer "
        "this model was trained with)")


def _require_compilable_chat_template(tokenizer, tok_dir: Path, origin: str | None) -> None:
    """Compile the chat template(s) as ``apply_chat_template`` does (transformers' own Jinja
    environment); one that does not compile is refused at start, naming its file, the Jinja error
    and its line. It used to pass start-up, and every chat request then got a 400 blaming the
    client's messages. ``origin``: where a ``--chat-template`` came from (``None``: the
    tokenizer's own, from ``tok_dir``)."""
    templates = tokenizer.chat_template
    if templates is None or (isinstance(templates, (str, dict)) and not templates):
        return  # none: a chat request is told so (use /v1/completions, or --chat-template)
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_
    except ImportError:  # pragma: no cover - an older transformers: a sandbox of the same kind
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])

        def compile_(text):
            return env.from_string(text)
    named = templates.items() if isinstance(templates, dict) else [(None, templates)]
    for name, text in named:
        if not isinstance(text, str) and name not in (None, "default"):
            continue  # a named one is used only by the requests that select it
        if not isinstance(text, str):
            # transformers stores whatever tokenizer_config.json says; jinja then fails on every
            # chat request ("Can't compile non template nodes")
            where = origin or _chat_template_file(tok_dir, name)
            raise LoadError(
                f"the chat template{f' {name!r}' if name else ''} of {where} is "
                f"{type(text).__name__} {str(text)[:60]!r}, not a string; every chat request "
                "would fail on it. Accepted: a Jinja template (a string, or a list of "
                "{\"name\": ..., \"template\": ...} objects); fix it, or start with "
                "--chat-template FILE to replace it (/v1/completions does not use it)")
        try:
            compile_(text)
        except jinja2.TemplateError as exc:
            where = origin or _chat_template_file(tok_dir, name)
            line = getattr(exc, "lineno", None)
            at = f" at line {line} of the template" if line else ""
            detail = " ".join(str(getattr(exc, "message", None) or exc).split()).rstrip(".")
            raise LoadError(
                f"the chat template{f' {name!r}' if name else ''} of {where} does not compile: "
                f"{type(exc).__name__}{at}: {detail}; every chat request would fail on it. "
                "Accepted: a Jinja template that compiles; fix it, or start with --chat-template "
                "FILE to replace it (/v1/completions does not use it)") from None


def _chat_template_file(tok_dir: Path, name: str | None) -> str:
    """The file a tokenizer's chat template ``name`` is read from, as transformers reads them:
    ``chat_template.jinja`` (or ``additional_chat_templates/NAME.jinja``) before
    tokenizer_config.json's ``chat_template``."""
    if name not in (None, "default") and (tok_dir / "additional_chat_templates"
                                          / f"{name}.jinja").is_file():
        return str(tok_dir / "additional_chat_templates" / f"{name}.jinja")
    if name in (None, "default") and (tok_dir / "chat_template.jinja").is_file():
        return str(tok_dir / "chat_template.jinja")
    return f"{tok_dir / 'tokenizer_config.json'} (its chat_template)"


def generation_defaults(folder: Path) -> dict:
    """Sampling defaults set by ``folder/generation_config.json`` (request field names)."""
    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    from moe_runtime.checkpoint import CheckpointError
    from moe_runtime.checkpoint.quant_config import load_json

    try:
        data = load_json(file)
    except CheckpointError as exc:
        raise LoadError(f"{exc} (fix the file, or serve with --generation-config vllm to "
                        "ignore it)") from exc
    out = {}
    for key, field in SAMPLING_DEFAULTS.items():
        value = data.get(key) if isinstance(data, dict) else None
        if value is None:  # absent or null: no default
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # a string ("hot", "0.7"), a bool, a list: every request would inherit it unread
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise LoadError(f"{file}: {key} is {shown}, not a number; accepted: "
                            f"{_DEFAULT_ACCEPTED[key]}, or no {key} (fix the file, or serve with "
                            "--generation-config vllm to ignore it)")
        out[field] = int(value) if key in ("top_k", "max_new_tokens") else float(value)
    _check_sampling_defaults(file, out)
    return out


def _check_sampling_defaults(file: Path, defaults: dict) -> None:
    """Refuse at start a generation config whose defaults every request would inherit and fail on."""
    from moe_runtime.serve.sampling import SamplingError, SamplingParams

    fields = {k: v for k, v in defaults.items() if k != "max_tokens"}
    if "top_k" in fields and fields["top_k"] == -1:
        fields["top_k"] = 0  # -1: no top-k, as vLLM reads it
    try:
        SamplingParams(**fields)
    except SamplingError as exc:
        raise LoadError(f"{file}: its sampling defaults are not usable: {exc} (fix the file, or "
                        "serve with --generation-config vllm to ignore it)") from exc
    if "max_tokens" in defaults and defaults["max_tokens"] < 1:
        raise LoadError(f"{file}: max_new_tokens is {defaults['max_tokens']}; a default must be "
                        "at least 1 (or serve with --generation-config vllm to ignore it)")


def _require_transformers_config(path: Path) -> None:
    """config.json as transformers' config class reads it: its own validation (a field of the
    wrong type, a null where it needs a number) is refused here, naming the file, rather than
    surfacing from whichever loader reads the config first (the tokenizer's, whose error would
    blame the tokenizer)."""
    from transformers import AutoConfig

    file = path / "config.json"
    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises ValueError, TypeError, its own dataclass errors
        detail = " ".join(str(exc).split())
        raise LoadError(f"{file}: transformers' config class refuses it: {detail}") from exc


def _require_served_architecture(path: Path) -> None:
    """Refuse an architecture that the table marks as not served, naming those that are."""
    from moe_runtime.checkpoint import CheckpointError
    from moe_runtime.checkpoint.architectures import architecture_of, served_families
    from moe_runtime.checkpoint.quant_config import load_json

    file = path / "config.json"
    try:
        arch = architecture_of(load_json(file), str(file))
    except CheckpointError:
        return  # the checkpoint check, which runs next, reports it with everything else found
    if not arch.served:
        served = "; ".join(f"{family} ({', '.join(names)})"
                           for family, names in served_families().items())
        raise LoadError(f"{file}: architecture {arch.name} ({arch.family}) plans, but moe-runtime "
                        f"serve cannot serve it: {arch.serve_refusal}. Served families: {served}")
