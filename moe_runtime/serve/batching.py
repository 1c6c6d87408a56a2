"""The two batching paths of ``moe-runtime serve``, and the choice between them from the model's config.

- ``continuous``: transformers' ``ContinuousBatchingManager`` (paged KV cache). Its cache
  (transformers 5.14) allocates one page shape for keys *and* values, ``[num_key_value_heads,
  head_dim]``, with ``head_dim`` read from ``config.head_dim`` (else ``hidden_size //
  num_attention_heads``), and groups layers only as full or sliding attention.
- ``dynamic``: :class:`CacheBatcher`, below: one left-padded ``DynamicCache`` shared by the running
  requests, which holds keys and values of any head sizes. A request joins between decode steps (its
  prompt prefilled alone, its cache padded and stacked onto the batch's) and leaves by row selection.

:func:`choose_batching` takes ``continuous`` when the paged cache can hold what the attention writes
(the architecture table's :class:`~moe_runtime.checkpoint.architectures.AttentionCache`), else
``dynamic``. DeepSeek-V3's multi-head latent attention writes keys of ``qk_nope_head_dim +
qk_rope_head_dim`` and values of ``v_head_dim`` per head, while its config's ``head_dim`` is
``qk_rope_head_dim``: the paged cache cannot hold them (the ``index_copy_`` shape error).

:func:`choose_cuda_graphs` decides whether continuous batching replays CUDA graphs, and
:func:`plan_token_bound` reads the most tokens one forward may carry from the plan.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from moe_runtime.serve.graph_shapes import ASYNC_ENV, async_batching_requested
from moe_runtime.serve.sampling import GREEDY, SLOT_KWARG, BatchSampler

log = logging.getLogger("moe_runtime.serve.batching")

CONTINUOUS = "continuous"
DYNAMIC = "dynamic"
CHOICES = ("auto", CONTINUOUS, DYNAMIC)


class BatchingError(RuntimeError):
    """No batching path can serve this model (or not the one asked for); the message says why."""


@attrs.frozen
class BatchingChoice:
    """The batching path chosen for a model, and a sentence saying why (shown at start-up)."""

    path: str
    reason: str
    graphs: GraphChoice | None = None  # set by the engine once it knows the device and plan
    overlap: OverlapChoice | None = None  # likewise

    def describe(self) -> str:
        what = ("continuous batching (transformers' paged KV cache)" if self.path == CONTINUOUS
                else "dynamic-cache batching (a padded transformers DynamicCache)")
        tail = "".join(f"; {part.describe()}" for part in (self.graphs, self.overlap)
                       if part is not None)
        return f"{what}: {self.reason}{tail}"


@attrs.frozen
class OverlapChoice:
    """Whether the host prepares step N+1 while the device runs step N (transformers'
    asynchronous batching), and why."""

    on: bool
    reason: str

    def describe(self) -> str:
        return f"host/device overlap {'on' if self.on else 'off'}: {self.reason}"


def choose_overlap(device: Any, path: str, requested: bool | None = None) -> OverlapChoice:
    """Asynchronous batching, for continuous batching on a CUDA device: opt-in (``requested``
    True, or ``MOE_RUNTIME_ASYNC_BATCHING=1``). Measured on an H200 (benchmarks/RESULTS.md,
    2026-12-05): tokens equal to one step at a time, output tok/s +7% at 16 clients and -5% at 64
    (against a run of the day before, one repetition each), so not made the default yet.

    Synchronously, each step's host work (scheduling, the next step's inputs, delivering tokens)
    waits for the step's outputs and leaves the device idle meanwhile: 10.8 of the 27.2 ms of a
    graph-replayed 16-client step of a 48-layer Qwen3-30B-A3B-shaped model on an H200
    (benchmarks/RESULTS.md). Overlapped, transformers keeps two sets of input buffers (and of
    CUDA graphs) and launches step N+1 before step N's tokens reach the host; a request that
    finished in step N is computed once more in step N+1 and that token dropped.
    """
    import torch

    wanted = async_batching_requested(requested)
    kind = torch.device(device).type
    if kind != "cuda":
        return OverlapChoice(False, f"the model runs on {kind}; overlapping the host's work with "
                                    "the device's needs CUDA streams")
    if path != CONTINUOUS:
        return OverlapChoice(False, "the dynamic-cache batcher runs its steps one after another")
    if wanted is None:
        return OverlapChoice(False, f"opt-in ({ASYNC_ENV}=1 or the engine's async_batching=True "
                                    "prepares the next step while the current one runs; on an "
                                    "H200 +7% tok/s at 16 clients, -5% at 64); each step waits "
                                    "for the one before")
    if wanted is False:
        how = (f"{ASYNC_ENV}=0" if requested is None else "the engine's async_batching=False")
        return OverlapChoice(False, f"turned off by {how}; each step waits for the one before")
    return OverlapChoice(True, "the next step is scheduled and launched while the current one "
                               "runs (two sets of input buffers and of graphs)")


@attrs.frozen
class GraphChoice:
    """Whether the decode steps (and, by default, the prefill steps) replay CUDA graphs, and why.

    :param max_tokens: the largest decode forward a graph captures (one token per request,
        padded; at most this).
    :param prefill: whether steps carrying prefill tokens replay graphs too
        (the default with graphs on; ``MOE_RUNTIME_GRAPH_PREFILL=0`` or the engine's
        ``graph_prefill=False`` turns it off, or a failed capture at warm-up).
    :param max_graphs: the most varlen graphs prefill graphing may capture (see
        :func:`~moe_runtime.serve.graph_shapes.prefill_graph_bound`), when ``prefill``.
    """

    on: bool
    reason: str
    max_tokens: int | None = None
    prefill: bool = False
    max_graphs: int | None = None

    def describe(self) -> str:
        return f"CUDA graphs {'on' if self.on else 'off'}: {self.reason}"


def plan_token_bound(plan: Any) -> tuple[int | None, str]:
    """The most tokens one forward may carry under ``plan`` (a Plan, or its JSON), and where
    that bound comes from; ``(None, ...)`` when the plan bounds nothing (or there is no plan).

    The bound is the smallest of the deployment's ``max_tokens_per_rank`` (what the plan was made
    for) and, per layer, the largest bound of its communication modes when every mode is bounded.
    """
    if plan is None:
        return None, "no plan"
    data = plan.to_json() if hasattr(plan, "to_json") else plan
    bounds: list[tuple[int, str]] = []
    deployment = data.get("deployment") or {}
    if deployment.get("max_tokens_per_rank"):
        bounds.append((int(deployment["max_tokens_per_rank"]),
                       "the plan's deployment max_tokens_per_rank"))
    for layer in data.get("layers", []):
        modes = [m.get("max_tokens_per_rank") for m in layer.get("modes") or []]
        if modes and all(b is not None for b in modes):
            bounds.append((max(modes), f"layer {layer.get('layer')}'s "
                                       f"{layer.get('communication')} modes"))
    if not bounds:
        return None, "the plan bounds no forward"
    return min(bounds)


def choose_cuda_graphs(device: Any, path: str, max_tokens: int, bound_from: str,
                       requested: bool | None = None, prefill: dict | None = None,
                       prefill_eager_because: str = "turned off by MOE_RUNTIME_GRAPH_PREFILL=0 "
                                                    "or the engine's graph_prefill=False",
                       blockers: tuple[str, ...] = (), failed: str = "") -> GraphChoice:
    """CUDA graphs for decode: on for continuous batching on a CUDA device unless ``requested``
    is False; ``max_tokens`` (the decode batch, already capped by the plan) bounds the captures.

    ``prefill`` (a :func:`~moe_runtime.serve.graph_shapes.prefill_graph_bound`, given when prefill
    graphing is on: the default, unless ``MOE_RUNTIME_GRAPH_PREFILL=0`` or the engine's
    ``graph_prefill=False``) makes steps with prefill tokens replay graphs too, within its bound;
    without it, ``prefill_eager_because`` says why they run eagerly (by default: turned off; the
    engine passes the capture failure when warm-up sent them back to eager). ``blockers``: experts
    backends of the plan that do not declare ``cuda_graphs=True``; any turns graphs off.
    ``failed``: the error of a decode step's capture at warm-up; graphs are off then.
    """
    import torch

    kind = torch.device(device).type
    if kind != "cuda":
        return GraphChoice(False, f"the model runs on {kind}; CUDA graphs need a CUDA device")
    if path != CONTINUOUS:
        return GraphChoice(False, "the dynamic cache changes shape every step, so no captured "
                                  "graph can replay a decode step")
    if requested is False:
        return GraphChoice(False, "turned off by the engine's cuda_graphs=False")
    if blockers:
        return GraphChoice(False, f"experts backend {', '.join(blockers)} of the plan does not "
                                  f"declare cuda_graphs=True (a forward that synchronizes with "
                                  f"the host cannot be captured), so decode runs eagerly")
    if failed:
        return GraphChoice(False, f"capturing a decode step failed at warm-up ({failed}), so "
                                  f"every step runs eagerly")
    decode = (f"decode batches replayed from graphs captured per padded size (powers of two on "
              f"flash attention's decode path, else multiples of 8), at most {max_tokens} tokens "
              f"({bound_from})")
    if not prefill:
        return GraphChoice(True, f"{decode}; prefill eager ({prefill_eager_because})",
                           max_tokens)
    q, kv, keys = prefill["query"], prefill["kv"], prefill["seqlen_k"]
    return GraphChoice(True, f"{decode}; prefill and mixed steps graphed too "
                             f"(MOE_RUNTIME_GRAPH_PREFILL=0 makes them eager): query tokens padded "
                             f"to multiples of "
                             f"8 up to {max_tokens}, then powers of two up to {q[-1]}, at most "
                             f"{prefill['graphs']} varlen graphs ({len(q)} query x {len(kv)} KV-read "
                             f"x {len(keys)} key-length sizes)",
                       max_tokens, prefill=True, max_graphs=prefill["graphs"])


def choose_batching(config: Any, requested: str = "auto") -> BatchingChoice:
    """The batching path for a transformers model ``config``; ``requested`` may pin one.

    A pinned ``continuous`` is honoured even where the paged cache cannot hold the model (the
    start-up probe then shows the failure); ``dynamic`` needs every layer's cache to be plain
    full-attention keys and values.
    """
    import transformers

    from moe_runtime.checkpoint.architectures import architecture_of

    if requested not in CHOICES:
        raise BatchingError(f"batching {requested!r} is unknown; accepted: {', '.join(CHOICES)}")
    data = config.to_dict()
    arch = architecture_of(data, "config.json")
    cache = arch.attention_cache(data, "config.json")
    name = f"{arch.name} ({arch.family})"
    if cache.recurrent_layers:
        raise BatchingError(
            f"{name} cannot be served: {cache.describe()}; neither batching path holds such a "
            f"state (transformers {transformers.__version__}'s paged cache groups only full and "
            "sliding attention layers, and the padded dynamic cache cannot pad a recurrent state)")
    paged_heads, paged_size = _paged_page(arch.text_config and data.get("text_config") or data)
    fits = (cache.kv_heads == paged_heads and cache.key_head_size == paged_size
            and cache.value_head_size == paged_size)
    version = transformers.__version__
    paged = (f"transformers {version}'s paged cache stores keys and values in pages of "
             f"{paged_heads} heads x {paged_size} (config head_dim or hidden_size / heads)")
    if requested == CONTINUOUS or (requested == "auto" and fits):
        reason = (f"{paged}, and {name} writes {cache.describe()}" if fits else
                  f"pinned by --batching continuous, although {paged} and {name} writes "
                  f"{cache.describe()}")
        return BatchingChoice(CONTINUOUS, reason)
    if cache.sliding_window:
        raise BatchingError(
            f"{name} uses sliding-window attention, which the padded dynamic cache does not hold; "
            "serve it with --batching continuous")
    if requested == DYNAMIC:
        return BatchingChoice(DYNAMIC, f"pinned by --batching dynamic; {name} writes "
                                       f"{cache.describe()}")
    return BatchingChoice(DYNAMIC, f"{paged}, but {name} writes {cache.describe()}")


def _paged_page(fields: dict[str, Any]) -> tuple[int, int]:
    """The page shape (heads, head size) that transformers' paged cache allocates for a config.

    transformers reads it as ``num_key_value_heads`` (else ``num_attention_heads``) by
    ``head_dim`` (else ``hidden_size // num_attention_heads``); the same rule is written here from
    the config's fields, since the helpers that hold it are private and renamed across releases.
    """
    heads = fields.get("num_attention_heads")
    kv_heads = fields.get("num_key_value_heads") or heads
    size = fields.get("head_dim")
    if size is None and heads and fields.get("hidden_size"):
        size = fields["hidden_size"] // heads
    if not kv_heads or not size:
        raise BatchingError("config.json names neither num_key_value_heads nor "
                            "num_attention_heads, or neither head_dim nor hidden_size: the "
                            "attention's cache shape is unknown")
    return int(kv_heads), int(size)


# ------------------------------------------------------------------------------ dynamic batching


@attrs.define
class _Output:
    """One result of a request, shaped like transformers' ``GenerationOutput`` where the engine
    reads it."""

    request_id: str
    generated_tokens: list[int]
    finished: bool = False
    error: str | None = None
    # a scoring request's answer: per prompt position after the first, (token, logprob, top)
    prompt_logprobs: list | None = None

    def is_finished(self) -> bool:
        return self.finished


@attrs.frozen
class _Scoring:
    """A prompt whose tokens' log-probabilities are asked for (no generation)."""

    request_id: str
    prompt: tuple[int, ...]
    top: int


@attrs.define
class _Request:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    eos: frozenset[int]
    slot: int
    generated: list[int] = attrs.field(factory=list)
    length: int = 0  # tokens of this row held in the cache (prompt + generated, minus the last)


class CacheBatcher:
    """Batches requests over one left-padded ``DynamicCache``, on a background thread.

    It answers the calls that :class:`~moe_runtime.serve.engine.Engine` makes of transformers'
    ``ContinuousBatchingManager`` (``register_result_handler``, ``add_request``,
    ``cancel_request``, ``start``, ``stop``, ``is_running``, ``fatal_error``), so the engine drives
    either. Each step it admits waiting requests up to ``max_batch_size`` (their prompts prefilled
    together, left-padded, then stacked onto the running batch), runs one decode step for every
    running request, and drops the rows that finished. Sampling is :class:`BatchSampler`'s.
    With ``max_cache_tokens``, a waiting request joins only while the running rows' prompts and
    ``max_new_tokens`` (the most each can hold) fit in that many tokens; the first always joins.
    With ``max_forward_tokens`` (at least ``max_batch_size``), no forward carries more tokens:
    prompts are prefilled (and scored) in chunks of columns.
    """

    def __init__(self, model, sampler: BatchSampler, *, max_batch_size: int,
                 pad_token_id: int, max_cache_tokens: int | None = None,
                 max_forward_tokens: int | None = None) -> None:
        self.model = model
        self.sampler = sampler
        self.max_batch_size = max_batch_size
        self.max_forward_tokens = max_forward_tokens
        # a request is admitted while the running rows' prompts and max_new_tokens fit in this
        self.max_cache_tokens = max_cache_tokens
        self.pad_token_id = pad_token_id
        self.fatal_error: BaseException | None = None
        self._device = next(model.parameters()).device
        # transformers renamed forward's ``past_key_values`` to ``cache`` (5.2x; the old name is
        # deprecated): pass the cache under the name this model's forward takes
        import inspect

        params = inspect.signature(type(model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._incoming: queue.Queue[_Request] = queue.Queue()
        self._deferred: _Request | None = None  # waiting for room in the cache
        self._scorings: queue.Queue[_Scoring] = queue.Queue()
        self._cancelled: set[str] = set()
        self._live: set[str] = set()  # queued or running requests
        self._handlers: dict[str, tuple[Callable, asyncio.AbstractEventLoop]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # the running batch: its rows, their cache, and the mask of real (non-padding) positions
        self._rows: list[_Request] = []
        self._cache = None
        self._mask: torch.Tensor | None = None
        # per row, on the device: its stop token ids (padded with -1) and tokens it may still make
        self._stops = torch.full((0, 1), -1, dtype=torch.long, device=self._device)
        self._left = torch.zeros(0, dtype=torch.long, device=self._device)

    # --- the manager-like interface (called from the event loop's thread)

    def register_result_handler(self, request_id: str, callback: Callable) -> None:
        with self._lock:
            self._handlers[request_id] = (callback, asyncio.get_running_loop())

    def add_request(self, input_ids: Sequence[int], request_id: str, max_new_tokens: int,
                    streaming: bool = True, eos_token_id: int | Sequence[int] = -1,
                    **logit_processor_kwargs) -> str | None:
        if not self.is_running():
            return None
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        with self._lock:
            self._live.add(request_id)
        self._incoming.put(_Request(request_id, list(input_ids), max(1, int(max_new_tokens)),
                                    frozenset(eos), logit_processor_kwargs.get(SLOT_KWARG, GREEDY)))
        return request_id

    def add_scoring(self, input_ids: Sequence[int], request_id: str, top: int) -> str | None:
        """Ask for the log-probability of every prompt token after the first (and ``top``
        alternatives): one forward over the prompt between two decode steps. The result handler
        gets one finished output with ``prompt_logprobs``."""
        if not self.is_running():
            return None
        self._scorings.put(_Scoring(request_id, tuple(input_ids), top))
        return request_id

    def cancel_request(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._live:
                self._cancelled.add(request_id)
            self._handlers.pop(request_id, None)

    @property
    def pending(self) -> dict[str, int]:
        """What the batcher still holds: running rows, queued requests, handlers, cancellations."""
        with self._lock:
            queued = self._incoming.qsize() + (self._deferred is not None)
            return {"running": len(self._rows), "queued": queued,
                    "handlers": len(self._handlers), "cancelled": len(self._cancelled),
                    "live": len(self._live)}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="moe-runtime-batcher", daemon=True)
        self._thread.start()

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        self._stop.set()
        if block and self._thread is not None:
            self._thread.join(timeout)

    def destroy(self) -> None:
        self._drop_all()

    def _drop_all(self) -> None:
        self._rows, self._cache, self._mask = [], None, None
        self._stops, self._left = self._stops[:0], self._left[:0]

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    # --- the batching thread

    def _deliver(self, req: _Request, *, finished: bool, error: str | None = None) -> None:
        with self._lock:
            entry = self._handlers.get(req.request_id)
            if finished or error is not None:
                self._handlers.pop(req.request_id, None)
                self._live.discard(req.request_id)
        if entry is not None:
            callback, loop = entry
            out = _Output(req.request_id, list(req.generated), finished or error is not None,
                          error)
            loop.call_soon_threadsafe(callback, out)

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    self._drop_cancelled()
                    self._score_waiting()
                    new = self._admit()
                    if not new and not self._rows:
                        continue
                    try:
                        if new:
                            self._prefill(new)
                        if self._rows:
                            self._decode()
                    except Exception as exc:  # a failed forward fails its requests, not the thread
                        log.error("generation step failed: %s", exc, exc_info=True)
                        for req in [*self._rows, *new]:
                            self._deliver(req, finished=True, error=f"{type(exc).__name__}: {exc}")
                        self._drop_all()
        except BaseException as exc:  # pragma: no cover - the thread itself failed
            self.fatal_error = exc
            raise

    def _score_waiting(self) -> None:
        while True:
            try:
                item = self._scorings.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                entry = self._handlers.pop(item.request_id, None)
            if entry is None:  # cancelled meanwhile
                continue
            out = _Output(item.request_id, [], finished=True)
            try:
                ids = torch.tensor([item.prompt], device=self._device)
                logits = self._score_logits(ids)[0, :-1].float()
                logp = torch.log_softmax(logits, dim=-1)
                targets = ids[0, 1:]
                chosen = logp.gather(-1, targets[:, None])[:, 0].tolist()
                tops = ([list(zip(i.tolist(), v.tolist())) for v, i in
                         zip(*torch.topk(logp, min(item.top, logp.shape[-1]), dim=-1))]
                        if item.top > 0 else [[] for _ in chosen])
                out.prompt_logprobs = list(zip(targets.tolist(), chosen, tops))
            except Exception as exc:
                log.error("scoring a prompt failed: %s", exc, exc_info=True)
                out.error = f"{type(exc).__name__}: {exc}"
            callback, loop = entry
            loop.call_soon_threadsafe(callback, out)

    def _admit(self) -> list[_Request]:
        room = self.max_batch_size - len(self._rows)
        new: list[_Request] = []
        block = not self._rows
        reserved = sum(len(r.prompt) + r.max_new_tokens for r in self._rows)
        while len(new) < room:
            if self._deferred is not None:
                req, self._deferred = self._deferred, None
            else:
                try:
                    req = self._incoming.get(timeout=0.05) if block and not new else \
                        self._incoming.get_nowait()
                except queue.Empty:
                    break
            need = len(req.prompt) + req.max_new_tokens
            if (self.max_cache_tokens is not None and (self._rows or new)
                    and reserved + need > self.max_cache_tokens):
                self._deferred = req  # first in line: it joins when rows leave
                break
            reserved += need
            with self._lock:
                cancelled = req.request_id in self._cancelled
                self._cancelled.discard(req.request_id)
                if cancelled:
                    self._live.discard(req.request_id)
            if not cancelled:
                new.append(req)
        return new

    def _drop_cancelled(self) -> None:
        with self._lock:
            gone = {r.request_id for r in self._rows} & self._cancelled
            self._cancelled -= gone
            self._live -= gone
        if gone:
            self._keep([i for i, r in enumerate(self._rows) if r.request_id not in gone])

    def _chunk(self, rows: int, width: int) -> int:
        """Columns of a ``rows``-row prefill that one forward may carry."""
        if not self.max_forward_tokens:
            return width
        return max(1, self.max_forward_tokens // rows)

    def _score_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits at every position of ``ids`` (one row), in forwards within the bound."""
        chunk = self._chunk(1, ids.shape[1])
        if chunk >= ids.shape[1]:
            return self.model(input_ids=ids, use_cache=False).logits
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        parts = [self.model(input_ids=ids[:, start:start + chunk], use_cache=True,
                            **{self._cache_kwarg: cache}).logits
                 for start in range(0, ids.shape[1], chunk)]
        return torch.cat(parts, dim=1)

    def _forward(self, input_ids, mask, positions, cache):
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache})
        return out.logits[:, -1, :].float()

    def _prefill(self, new: list[_Request]) -> None:
        from transformers import DynamicCache

        longest = max(len(r.prompt) for r in new)
        ids = torch.full((len(new), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(new), longest), dtype=torch.long)
        for i, r in enumerate(new):
            ids[i, longest - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, longest - len(r.prompt):] = 1
            r.length = len(r.prompt)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, positions = (t.to(self._device) for t in (ids, mask, positions))
        cache = DynamicCache(config=self.model.config)
        chunk = self._chunk(len(new), longest)
        for start in range(0, longest, chunk):  # within the token bound, columns at a time
            end = min(start + chunk, longest)
            logits = self._forward(ids[:, start:end], mask[:, :end], positions[:, start:end],
                                   cache)
        self._join(new, cache, mask)
        self._step_tokens(new, logits)

    def _join(self, new: list[_Request], cache, mask: torch.Tensor) -> None:
        """Stack the new rows' cache onto the running batch's, left-padding the shorter one."""
        width = max([len(r.eos) for r in new] + [self._stops.shape[1], 1])
        stops = torch.full((len(new), width), -1, dtype=torch.long)
        for i, r in enumerate(new):
            stops[i, :len(r.eos)] = torch.tensor(sorted(r.eos), dtype=torch.long)
        grown = torch.full((self._stops.shape[0], width), -1, dtype=torch.long,
                           device=self._device)
        grown[:, :self._stops.shape[1]] = self._stops
        self._stops = torch.cat([grown, stops.to(self._device)])
        self._left = torch.cat([self._left, torch.tensor([r.max_new_tokens for r in new],
                                                         device=self._device)])
        if self._cache is None:
            self._rows, self._cache, self._mask = list(new), cache, mask
            return
        t_old, t_new = self._mask.shape[1], mask.shape[1]
        width = max(t_old, t_new)
        for old_layer, new_layer in zip(self._cache.layers, cache.layers, strict=True):
            for attr in ("keys", "values"):
                a, b = getattr(old_layer, attr), getattr(new_layer, attr)
                setattr(old_layer, attr, torch.cat([_left_pad(a, width, -2),
                                                    _left_pad(b, width, -2)], dim=0))
        self._mask = torch.cat([_left_pad(self._mask, width, -1), _left_pad(mask, width, -1)])
        self._rows.extend(new)

    def _decode(self) -> None:
        last = torch.tensor([[r.generated[-1]] for r in self._rows], device=self._device)
        positions = torch.tensor([[r.length] for r in self._rows], device=self._device)
        ones = torch.ones((len(self._rows), 1), dtype=self._mask.dtype, device=self._device)
        self._mask = torch.cat([self._mask, ones], dim=-1)
        logits = self._forward(last, self._mask, positions, self._cache)
        for r in self._rows:
            r.length += 1
        self._step_tokens(list(self._rows), logits)

    def _step_tokens(self, rows: list[_Request], logits: torch.Tensor) -> None:
        """Pick each row's next token, deliver it, and drop the rows that finished.

        ``rows`` are the last rows of the batch (the new ones after a prefill, all after a
        decode step). Stops are found on the device: a stop token, or no tokens left.
        """
        tokens = self.sampler.sample(logits, self.sampler.rows_for([r.slot for r in rows]))
        tail = slice(len(self._rows) - len(rows), None)
        self._left[tail] -= 1
        stopped = (tokens[:, None] == self._stops[tail]).any(dim=-1) | (self._left[tail] <= 0)
        tokens, stopped = torch.stack([tokens, stopped.long()]).tolist()  # the step's one sync
        self.sampler.collect()
        done = set()
        for r, token, finished in zip(rows, tokens, stopped, strict=True):
            r.generated.append(int(token))
            if finished:
                self.sampler.release(r.slot)
                done.add(r.request_id)
            self._deliver(r, finished=bool(finished))
        if done:
            self._keep([i for i, r in enumerate(self._rows) if r.request_id not in done])

    def _keep(self, indices: list[int]) -> None:
        """Keep only the rows at ``indices``, and drop the padding columns no row needs."""
        if len(indices) == len(self._rows):
            return
        if not indices:
            self._drop_all()
            return
        index = torch.tensor(indices, device=self._device)
        self._cache.batch_select_indices(index)
        self._mask = self._mask[index]
        self._stops, self._left = self._stops[index], self._left[index]
        self._rows = [self._rows[i] for i in indices]
        lead = int((self._mask.cumsum(-1) == 0).sum(-1).min())
        if lead:
            self._mask = self._mask[:, lead:]
            for layer in self._cache.layers:
                layer.keys = layer.keys[..., lead:, :]
                layer.values = layer.values[..., lead:, :]


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
