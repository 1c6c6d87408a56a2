"""The generation engine: a batching path driven from asyncio, and the start-up probe.

Concurrent requests are batched by one of the two paths of :mod:`moe_runtime.serve.batching`,
chosen from the model's config: transformers' ``ContinuousBatchingManager`` (paged KV cache, FIFO
scheduler, chunked prefill, one background thread that runs the model) where its cache holds the
model's keys and values, else :class:`~moe_runtime.serve.batching.CacheBatcher` (a padded
``DynamicCache``). This module only submits requests, turns their token outputs into text deltas,
and cancels requests that end early (a stop string, a client gone). Sampling runs inside the batch
through :class:`~moe_runtime.serve.sampling.BatchSampler` (tensor operations over the batch), which
lets continuous batching replay CUDA graphs for decode on a CUDA device
(:func:`~moe_runtime.serve.batching.choose_cuda_graphs`), and prepare the next step while the
device runs the current one (:func:`~moe_runtime.serve.batching.choose_overlap`); every forward
stays within the plan's token bound (:func:`~moe_runtime.serve.batching.plan_token_bound`).

The engine is *ready* only after :meth:`Engine.probe` generated one token through the same path
that requests take; a probe that fails raises :class:`ReadinessError`, naming the architecture, the
batching path and the module whose forward failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import queue
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import attrs

from moe_runtime.serve import fused_norm, paged_attention
from moe_runtime.serve import fused_rope as rope_kernel
from moe_runtime.serve.batching import (
    CONTINUOUS,
    CacheBatcher,
    choose_batching,
    choose_cuda_graphs,
    choose_overlap,
    plan_token_bound,
)
from moe_runtime.serve.detokenize import IncrementalDetokenizer
from moe_runtime.serve.graph_shapes import (
    PREFILL_ENV,
    bucket_kv_reads,
    bucket_prefill_queries,
    graph_this_step,
    prefer_replanning_free_attention,
    prefill_graph_bound,
    prefill_graphs_requested,
)
from moe_runtime.serve.loading import LoadedModel
from moe_runtime.serve.paged_attention import choose_gqa_attention
from moe_runtime.serve.sampling import (
    GREEDY,
    MAX_STOP_TOKEN_IDS,
    SLOT_KWARG,
    BatchSampler,
    SamplingParams,
    TokenLogprob,
    processor_list,
    vocab_size_of,
)

log = logging.getLogger("moe_runtime.serve")


class EngineError(RuntimeError):
    """A request failed inside the engine (the others keep running)."""


class PromptRejected(EngineError):
    """A prompt the batching path cannot take (not a flat list of token ids of the vocabulary):
    refused before it is submitted; the client's request is at fault."""


class EngineUnavailable(EngineError):
    """The batching thread is not running: no request can be served."""


class ReadinessError(RuntimeError):
    """The start-up generation of one token failed; the message is one paragraph for people."""


class _Abort:
    """Put in a request's output queue by :meth:`Engine.abort_all`."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


@attrs.frozen
class Delta:
    """One step of a response: new text, and the reason it ended on the last one.

    :param text: text to append (may be empty).
    :param token_ids: all tokens generated so far.
    :param finish_reason: ``"stop"`` (EOS or a stop string), ``"length"`` (max_tokens) or None.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    first_token_s: float | None = None  # seconds from submission to the first token, once known
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of token_ids, when asked for
    # vLLM's stop_reason, on the last delta: the stop string or stop token id that ended the
    # request (None: EOS, max_tokens, or not ended)
    stop_reason: int | str | None = None


def context_length_of(loaded: LoadedModel, max_model_len: int | None = None) -> int:
    """Prompt + completion tokens a request may hold: the model's context, capped by
    ``max_model_len``."""
    model_len = getattr(loaded.model.config, "max_position_embeddings", None) or getattr(
        loaded.tokenizer, "model_max_length", None) or 2048
    return int(min(model_len, max_model_len) if max_model_len else model_len)


class Engine:
    """Serves one :class:`LoadedModel` through continuous batching.

    :param max_batch_size: most requests decoded together in one forward.
    :param max_model_len: cap on prompt + generated tokens (default: the model's context length);
        the paged KV cache holds ``max_batch_size`` sequences of this length.
    :param batching: ``"auto"`` (from the model's config, see
        :func:`~moe_runtime.serve.batching.choose_batching`), ``"continuous"`` or ``"dynamic"``;
        a model no path can hold raises :class:`~moe_runtime.serve.batching.BatchingError`.
    :param debug: log the traceback of a failed probe (else the probe's message is all).
    :param kv_cache_tokens: tokens the KV cache holds in all (default: ``max_batch_size``
        sequences of the full context); the paged cache gets that many tokens of blocks, the
        dynamic cache admits a request only while the running ones' prompts and ``max_tokens``
        fit.
    :param seed: seeds the draws of requests that send no seed of their own, so a server
        started with the same seed answers the same unseeded requests alike (default: fresh
        randomness for each).
    :param cuda_graphs: ``None`` (default): continuous batching replays CUDA graphs for decode
        on a CUDA device; ``False`` turns them off. The choice and its reason are in
        ``engine.batching.describe()`` and the start-up log.
    :param graph_prefill: with CUDA graphs on, let steps carrying prefill tokens replay graphs
        too, their query tokens padded to geometric buckets
        (:func:`~moe_runtime.serve.graph_shapes.query_bucket`); ``None`` (default) reads
        ``MOE_RUNTIME_GRAPH_PREFILL`` (on when unset or ``1``; ``0`` off); ``False`` turns it off,
        and prefill steps run eagerly. On by default because it was measured faster (an H200,
        48-layer Qwen3-30B-A3B-shaped NVFP4 checkpoint, benchmarks/bench_serve.py in-process:
        527.7 / 729.1 output tok/s at 16 / 64 clients against 492.6 / 685.2 eager, TTFT p50 96.5
        against 116.6 ms at 16).
    :param async_batching: ``True``: continuous batching on a CUDA device prepares step N+1 (scheduling,
        inputs, their copy to the device) while the device runs step N, and delivers step N's
        tokens after launching step N+1 (transformers' asynchronous batching); ``False`` runs
        one step at a time; ``None`` (default) reads ``MOE_RUNTIME_ASYNC_BATCHING`` (``1`` on;
        off when unset: opt-in, its gain on an H200 was mixed). Tokens, seeded draws and
        log-probabilities are the same either way (CPU-tested in transformers' call order, and
        on an H200 by tests/serve/test_engine_cuda_graphs.py, 2026-12-05).
    :param gqa_attention: ``True``: continuous batching's decode and small mixed steps attend
        with :func:`~moe_runtime.serve.paged_attention.gqa_paged_attention` (no keys repeated
        per query head, two batched products per layer) instead of transformers' ``paged|sdpa``;
        ``False`` keeps transformers'; ``None`` (default) reads ``MOE_RUNTIME_GQA_ATTENTION``
        (``1`` on, ``0`` off; unset: on for a model on CUDA, measured faster there).
    :param fused_norms: ``True``: the model's RMSNorm modules run as one kernel each
        (:func:`~moe_runtime.serve.fused_norm.rms_norm`, CUDA with Triton; modules whose forward
        a probe does not prove to be that formula keep theirs); ``None`` (default) reads
        ``MOE_RUNTIME_FUSED_NORMS`` (``1`` on, ``0`` off; unset: on for a model on CUDA).
    :param fused_rope: ``True``: the model's rotary embedding runs as one kernel for the queries
        and one for the keys (:func:`~moe_runtime.serve.fused_rope.rotary`, bit-identical; CUDA
        with Triton; a function a probe does not prove to be that formula keeps its place);
        ``None`` (default) reads ``MOE_RUNTIME_FUSED_ROPE`` (``1`` on, ``0`` off; unset: on for
        a model on CUDA).
    :param max_tokens_per_forward: the bound the model was loaded with
        (``load_for_serving(..., max_tokens_per_forward=)``), if any.

    A forward never carries more tokens than the plan's bound
    (:func:`~moe_runtime.serve.batching.plan_token_bound`) nor ``max_tokens_per_forward``:
    ``max_batch_size`` and the prefill chunk are capped at them.
    """

    def __init__(self, loaded: LoadedModel, *, max_batch_size: int = 8,
                 max_model_len: int | None = None, block_size: int = 32,
                 batching: str = "auto", debug: bool = False,
                 kv_cache_tokens: int | None = None, seed: int | None = None,
                 cuda_graphs: bool | None = None,
                 max_tokens_per_forward: int | None = None,
                 graph_prefill: bool | None = None,
                 async_batching: bool | None = None,
                 gqa_attention: bool | None = None,
                 fused_norms: bool | None = None,
                 fused_rope: bool | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        config = loaded.model.config
        self.context_length = context_length_of(loaded, max_model_len)
        self.max_batch_size = max_batch_size
        self.kv_cache_tokens = int(kv_cache_tokens or max_batch_size * self.context_length)
        if self.kv_cache_tokens < self.context_length:
            raise ValueError(f"a KV cache of {self.kv_cache_tokens} tokens cannot hold one "
                             f"sequence of the context, {self.context_length} tokens")
        self._seeds = random.Random(seed) if seed is not None else None
        # requests submitted and not finished: tokens each holds in the cache (prompt +
        # generated), and whether it has had its first token (running) or not (waiting)
        self._held: dict[str, int] = {}
        self._started: set[str] = set()
        # each unfinished request's sampler key (continuous batching releases its row when the
        # batching thread delivers its last token)
        self._slots: dict[str, int] = {}
        # called with (seconds since the request's previous tokens, None for its first; the
        # number of new tokens) as each request's tokens arrive
        self.on_tokens = None
        self.block_size = block_size
        self.eos_token_ids = self._eos_ids()
        bound, bound_from = plan_token_bound(loaded.plan)
        if max_tokens_per_forward is not None and (bound is None or max_tokens_per_forward < bound):
            bound, bound_from = max_tokens_per_forward, "the model's max_tokens_per_forward"
        self.token_bound = bound
        # requests decoded together, and the tokens of one prefill forward, within the plan
        self.batch_cap = min(max_batch_size, bound) if bound else max_batch_size
        # several prompts per prefill forward (chunked beyond): eager (graph prefill off), each
        # prefill or mixed step saved is a whole eager forward (on the H200's 48-layer bench,
        # 256 tokens a step made 8 such steps of 16 clients' 128-token prompts)
        self.max_batch_tokens = PREFILL_TOKENS
        if bound:
            self.max_batch_tokens = min(self.max_batch_tokens, bound)
        if self.batch_cap < max_batch_size:
            log.warning("max_batch_size %d is capped at %d: %s", max_batch_size, bound,
                        bound_from)
        device = next(loaded.model.parameters()).device
        batching_choice = choose_batching(config, batching)
        self.num_blocks = max(math.ceil(self.context_length / self.block_size),
                              math.ceil(self.kv_cache_tokens / self.block_size))
        prefill = None
        if prefill_graphs_requested(graph_prefill):
            prefill = prefill_graph_bound(self.max_batch_tokens, self.batch_cap,
                                          self.num_blocks * self.block_size, self.context_length)
        # what the graph choice is made from, kept to describe it again should prefill graphing
        # fall back to eager at start-up
        self._graph_args = (device, batching_choice.path, self.batch_cap,
                            bound_from if bound and bound < max_batch_size else "max_batch_size",
                            cuda_graphs)
        graphs = choose_cuda_graphs(*self._graph_args, prefill=prefill,
                                    blockers=loaded.graph_blockers)
        self.batching = attrs.evolve(batching_choice, graphs=graphs, overlap=choose_overlap(
            device, batching_choice.path, async_batching))
        self.sampler = BatchSampler(vocab_size_of(loaded.model), max_slots=2 * self.batch_cap + 16,
                                    max_batch=self.batch_cap,
                                    max_bans=len(self.eos_token_ids) + MAX_STOP_TOKEN_IDS,
                                    device=device, static=graphs.on)
        # requests waiting for a sampler row (every one may be taken): woken as rows come back
        self._room_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._room_lock = threading.Lock()
        self.sampler.on_room = self._wake_room
        # the prompts and choices of one HTTP request (generate's ``group``) submitted at once:
        # a batch running and a batch queued (a sequence that ends is replaced without waiting
        # for this loop), so one request of many prompts holds that much of the queue and a later
        # request is not behind all of it ([semaphore, users] per group)
        self.group_limit = 2 * self.batch_cap
        self._groups: dict[str, list] = {}
        # each generate's output queue and its loop, for abort_all (a shutdown ending them)
        self._live: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.debug = debug
        # continuous batching's small steps attend without repeating keys (paged_attention.py)
        # on a CUDA device all three are on unless turned off (measured: RESULTS.md)
        self.gqa_attention = (choose_gqa_attention(gqa_attention, device)
                              and batching_choice.path == CONTINUOUS)
        self.fused_norms = fused_norm.choose_fused_norms(fused_norms, device)
        self.fused_rope = rope_kernel.choose_fused_rope(fused_rope, device)
        # a kernel asked for (argument or variable) that cannot run is a warning; one on by
        # default that cannot run (no Triton, a probe refusing every module) is said at info
        self._kernels_requested = {
            "gqa": choose_gqa_attention(gqa_attention, device=None),
            "norms": fused_norm.choose_fused_norms(fused_norms, device=None),
            "rope": rope_kernel.choose_fused_rope(fused_rope, device=None)}
        self._manager = None
        self._graph_policy: _GraphPolicy | None = None
        self._ready = False

    @property
    def graph_captures(self) -> dict:
        """CUDA graphs captured at warm-up and while serving, and the seconds their captures
        took: ``{"warmup": n, "serving": n, "warmup_s": s, "serving_s": s}`` (zeros where no
        step replays graphs). A capture while serving is a step shape warm-up did not reach: its
        batch waits for it once (docs/serve.md, "CUDA graphs")."""
        p = self._graph_policy
        if p is None:
            return {"warmup": 0, "serving": 0, "warmup_s": 0.0, "serving_s": 0.0}
        return {**p.captures, **{f"{k}_s": v for k, v in p.capture_seconds.items()}}

    def _eos_ids(self) -> list[int]:
        ids: set[int] = set()
        model = self.loaded.model
        for source in (getattr(model, "generation_config", None), model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return sorted(ids)

    # ------------------------------------------------------------------------------ lifecycle

    def start(self, probe: bool = True) -> None:
        """Start the batching thread, then (``probe``) generate one token: ready when it returns."""
        if self._manager is None:
            if self.fused_norms:  # before any graph is captured: the probe compiles the kernel
                self._enable_fused_norms()
            if self.fused_rope:
                self._enable_fused_rope()
            note = prefer_replanning_free_attention(next(self.loaded.model.parameters()).device)
            if note:
                log.info(note)
            self._manager = (self._continuous_manager() if self.batching.path == CONTINUOUS
                             else self._cache_batcher())
        if probe:
            self.probe()
        if self._graph_policy is not None:  # from now on a capture is a shape served traffic met
            self._graph_policy.serving = True

    def _enable_fused_norms(self) -> None:
        why = fused_norm.unavailable(next(self.loaded.model.parameters()).device)
        count = fused_norm.enable(self.loaded.model) if why is None else 0
        if count:
            log.info("norms: %d RMSNorm modules run as one kernel each (%s=0 turns it off)",
                     count, fused_norm.FUSED_NORMS_ENV)
        else:
            self.fused_norms = False
            (log.warning if self._kernels_requested["norms"] else log.info)(
                "norms: the model's own (%s)", why or "no module passed the fused kernel's probe")

    def _enable_fused_rope(self) -> None:
        why = fused_norm.unavailable(next(self.loaded.model.parameters()).device)
        count = rope_kernel.enable(self.loaded.model) if why is None else 0
        if count:
            log.info("rotary embedding: one kernel for the queries and one for the keys (%s=0 "
                     "turns it off)", rope_kernel.FUSED_ROPE_ENV)
        else:
            self.fused_rope = False
            (log.warning if self._kernels_requested["rope"] else log.info)(
                "rotary embedding: the model's own (%s)",
                why or "no apply_rotary_pos_emb passed the fused kernel's probe")

    def _cache_batcher(self) -> CacheBatcher:
        batcher = CacheBatcher(self.loaded.model, self.sampler,
                               max_batch_size=self.batch_cap, pad_token_id=self._pad_id(),
                               max_cache_tokens=self.kv_cache_tokens,
                               max_forward_tokens=self.token_bound)
        batcher.start()
        return batcher

    def _continuous_manager(self):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        logging.getLogger("ContinuousBatchingLogger").setLevel(
            logging.DEBUG if log.isEnabledFor(logging.DEBUG) else logging.ERROR)
        # Greedy and processor-free: the BatchSampler does every request's sampling.
        gen = GenerationConfig(do_sample=False, eos_token_id=self.eos_token_ids or -1,
                               pad_token_id=self._pad_id(), max_new_tokens=self.context_length)
        cb = ContinuousBatchingConfig(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_batch_tokens=self.max_batch_tokens,
            max_requests_per_batch=self.batch_cap,
            allow_block_sharing=False,
            use_cuda_graph=self.batching.graphs.on,
            # without flash attention's decode path decode runs the varlen path, padded to this
            # many query tokens (transformers' default, 64, pads one request to 64 tokens)
            q_padding_interval_size=DECODE_PADDING if self.batching.graphs.on else 0,
            # the sampler keeps a second log-probability buffer for the step launched before the
            # one before it is delivered
            use_async_batching=self.batching.overlap.on,
        )
        if self.gqa_attention:
            layers = paged_attention.enable(self.loaded.model)
            if layers:
                log.info("attention: grouped-query, without repeated keys, for steps of up to "
                         "%d query tokens on %d layers (%s=0 turns it off)",
                         paged_attention.MAX_QUERIES, layers, paged_attention.GQA_ENV)
            else:
                self.gqa_attention = False
                (log.warning if self._kernels_requested["gqa"] else log.info)(
                    "attention: this transformers has no paged|sdpa to wrap; its own attention "
                    "runs")
        manager = self.loaded.model.init_continuous_batching(
            generation_config=gen, continuous_batching_config=cb)
        manager.logit_processor = processor_list(self.sampler)
        # a finished request's sampler row goes back as its last token is delivered
        router = manager.output_router
        deliver_batch = router.deliver_batch

        def deliver_and_release(outputs):
            for out in outputs:
                if out.is_finished():
                    self.sampler.release(self._slots.get(out.request_id, GREEDY))
            deliver_batch(outputs)

        router.deliver_batch = deliver_and_release
        # transformers 5.14-5.17 build the batch processor on the batching thread unless it
        # exists; made here, its outputs feed the sampler's log-probabilities and (graphs on) its
        # runner replays graphs for decode batches (and, by default, for prefill and mixed ones)
        manager.batch_processor = processor = manager._create_batch_processor()
        io = processor.inputs_and_outputs
        self.sampler.pipeline(2 if self.batching.overlap.on else 1,
                              stream=getattr(io, "compute_stream", None))
        _collect_with_outputs(io, self.sampler, self.batching.overlap.on)
        if self.batching.graphs.on:
            policy = _GraphPolicy.install(processor, prefill=self.batching.graphs.prefill)
            eager_because = ""  # why prefill steps stay eager though graphing them was asked for
            # without the policy transformers graphs every step: its queries are bucketed too
            if (policy is None or policy.prefill) and not bucket_prefill_queries(
                    processor, cap=self.max_batch_tokens, dense_up_to=self.batch_cap,
                    step=DECODE_PADDING):
                if policy is not None:  # transformers' padding would make a graph per 8 tokens
                    policy.prefill = False
                    eager_because = "this transformers has no maybe_pad_inputs to bucket queries"
            bucket_kv_reads(processor)  # not the whole cache each step
            start = time.perf_counter()
            # captures the decode sizes of flash attention's decode path, and (prefill graphed)
            # the largest varlen step first, so the graph pool is sized once
            manager.warmup()
            # counted as warm-up until the probe's token is generated (start, probe)
            self._graph_policy = policy
            self.sampler.forget_steps()  # warm-up forwards are never delivered
            log.info("CUDA graphs: warm-up took %.1f s", time.perf_counter() - start)
            if policy is not None and policy.capture_failures:
                # transformers' warm-up logs and swallows a failed capture (the policy has sent
                # prefill steps, or every step, back to eager): the served steps would raise on it
                eager_because = f"its capture failed at warm-up: {policy.capture_failures[0]}"
            if policy is not None and policy.decode_failed:
                self.batching = attrs.evolve(self.batching, graphs=choose_cuda_graphs(
                    *self._graph_args, failed=policy.decode_failed,
                    blockers=self.loaded.graph_blockers))
                log.info("batching: %s", self.batching.describe())
            elif self.batching.graphs.prefill and policy is not None and not policy.prefill:
                self.batching = attrs.evolve(self.batching, graphs=choose_cuda_graphs(
                    *self._graph_args, prefill_eager_because=eager_because,
                    blockers=self.loaded.graph_blockers))
                log.info("batching: %s", self.batching.describe())
        manager.start()
        return manager

    def probe(self, timeout: float | None = None) -> float:
        """Generate one greedy token through the batching path; returns the seconds it took.

        Raises :class:`ReadinessError` when it fails: the architecture, the batching path, the
        innermost module whose forward raised, and the error, in one paragraph.
        """
        if self._manager is None:
            raise ReadinessError("the engine was not started")
        prompt = self.encode_prompt("Hello") or [self._pad_id()]
        result: dict = {}

        def run() -> None:  # on a thread of its own: the caller may be inside an event loop
            try:
                result["delta"] = asyncio.run(asyncio.wait_for(self.complete(
                    prompt, max_tokens=1, sampling=SamplingParams(temperature=0.0, logprobs=0),
                    request_id=f"readiness-probe-{uuid.uuid4().hex}", _probe=True), timeout))
            except asyncio.TimeoutError:
                result["failure"] = f"no token within {timeout} s"
            except Exception as exc:
                result["failure"] = str(exc) or type(exc).__name__

        start = time.perf_counter()
        with _ModuleTrace(self.loaded.model) as trace, _quiet_batchers(not self.debug):
            thread = threading.Thread(target=run, name="moe-runtime-probe", daemon=True)
            thread.start()
            thread.join()
        failure = result.get("failure")
        if failure is None and not result["delta"].token_ids:
            failure = "it returned no token"
        if failure is not None:
            raise ReadinessError(self._readiness_message(failure, trace.failing_module()))
        records = result["delta"].logprobs
        if records and not math.isfinite(records[0].logprob):
            raise ReadinessError(self._non_finite_message(records[0].logprob,
                                                          trace.first_non_finite()))
        self._ready = True
        return time.perf_counter() - start

    def _readiness_message(self, failure: str, module: str | None) -> str:
        config = self.loaded.model.config
        arch = (getattr(config, "architectures", None) or [type(self.loaded.model).__name__])[0]
        where = f"in {module}" if module else "outside any module's forward"
        return (f"{arch} cannot serve: the start-up generation of one token failed {where}, "
                f"batching with {self.batching.describe()}. The error: "
                f"{' '.join(failure.split()).rstrip('.')}. The server did not become ready; run "
                "with --debug for the traceback.")

    def _non_finite_message(self, logprob: float, module: str | None) -> str:
        config = self.loaded.model.config
        arch = (getattr(config, "architectures", None) or [type(self.loaded.model).__name__])[0]
        where = (f"; the first module whose output holds inf or NaN is {module}" if module else
                 "")
        return (f"{arch} cannot serve: the start-up generation of one token gave a "
                f"log-probability of {logprob} (the model's logits are not finite){where}. Its "
                "weights or scales overflow the activations or hold NaN: a per-tensor scale "
                "such as weight_scale_2 or weight_scale far beyond its export's range (ModelOpt's "
                "are below 1 for real weights; `moe-runtime check` refuses only scales that "
                "overflow float32 on their own), or NaN weights (`serve` scans the weights as it "
                "loads them). The server did not become ready.")

    def _pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)

    def shutdown(self) -> None:
        self._ready = False
        if self._manager is not None:
            self._manager.stop(block=True, timeout=10)
            self._manager.destroy()
            self._manager = None
        if self.gqa_attention:
            paged_attention.disable(self.loaded.model)
        if self.fused_norms:
            fused_norm.disable(self.loaded.model)
        if self.fused_rope:
            rope_kernel.disable(self.loaded.model)

    @property
    def healthy(self) -> bool:
        """Ready (the probe generated a token) and the batching thread is running."""
        return self._ready and self._running

    @property
    def _running(self) -> bool:
        m = self._manager
        return m is not None and m.is_running() and _fatal_error(m) is None

    # ------------------------------------------------------------------------------ load

    @property
    def num_running(self) -> int:
        """Requests that have had a first token and are not finished."""
        return len(self._started)

    @property
    def num_waiting(self) -> int:
        """Requests submitted that have had no token yet (queued or in prefill)."""
        return len(self._held) - len(self._started)

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of the KV cache's tokens that the unfinished requests hold (0 to 1)."""
        if self.batching.path == CONTINUOUS:  # whole blocks
            used = sum(math.ceil(n / self.block_size) * self.block_size
                       for n in list(self._held.values()))
        else:
            used = sum(list(self._held.values()))
        return min(1.0, used / self.kv_cache_tokens)

    # ------------------------------------------------------------------------------ prompts

    @functools.cached_property
    def _longest_token(self) -> int:
        """The most characters one token of the vocabulary spells (byte-level BPE spells a byte
        as one character, so this bounds the text one token covers)."""
        try:
            return max(1, max(len(t) for t in self.tokenizer.get_vocab()))
        except Exception:  # a tokenizer without a vocabulary to list: no floor
            return 0

    def token_floor(self, text: str) -> tuple[int, int]:
        """``(a floor on the tokens of text, the longest token's characters)``, from its length
        alone: each token covers at most the longest token's characters, and a quarter of that
        floor is taken to allow for a normalizer that drops characters. ``(0, 0)``: unknown."""
        longest = self._longest_token
        return (len(text) // (4 * longest) if longest else 0), longest

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # verbose=False: transformers' "sequence length is longer than the specified maximum"
        # warning would be logged for a prompt the server then refuses with its own error
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens,
                                   verbose=False)["input_ids"])

    def encode_chat(self, messages: Sequence[dict], template_kwargs: dict | None = None) -> list[int]:
        """Token ids of ``messages`` through the chat template; ``template_kwargs`` are the
        template's own variables (``enable_thinking``...). A template error is a ValueError."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions, "
                             "or start the server with --chat-template")
        kwargs = {"add_generation_prompt": True, **(template_kwargs or {})}
        try:
            ids = self.tokenizer.apply_chat_template(list(messages), tokenize=True,
                                                     return_dict=False,
                                                     tokenizer_kwargs={"verbose": False},
                                                     **kwargs)
        except Exception as exc:  # jinja2's TemplateError and its kin
            raise ValueError(f"the chat template failed on these messages: "
                             f"{type(exc).__name__}: {exc}") from None
        problem = prompt_ids_problem(ids, vocab_size_of(self.loaded.model))
        if problem:  # a template (or its variables) that returns something else
            raise ValueError(f"the chat template call returned {problem}")
        return list(ids)

    # ------------------------------------------------------------------------------ generation

    async def generate(self, prompt_ids: Sequence[int], *, max_tokens: int,
                       sampling: SamplingParams, stop: Sequence[str] = (),
                       request_id: str | None = None, stop_token_ids: Sequence[int] = (),
                       ignore_eos: bool = False, include_stop_str: bool = False,
                       skip_special_tokens: bool = True, group: str | None = None,
                       _probe: bool = False) -> AsyncIterator[Delta]:
        """Stream one request's deltas, one for each new token (its text empty while the
        detokenizer holds an incomplete character or a possible stop string back); the last one
        has a ``finish_reason``.

        The request ends at the model's EOS tokens (unless ``ignore_eos``), at any of
        ``stop_token_ids``, at a ``stop`` string (cut before it, or after it with
        ``include_stop_str``) or after ``max_tokens``. ``sampling.min_tokens`` holds off the
        stop tokens (they are never drawn before it) and the stop strings (searched only in
        the text of later tokens), as vLLM does. The stop tokens are checked where each batching
        path checks its EOS: on the device in the dynamic batcher's step, per token in
        transformers' continuous batching (CUDA-graph decode included).

        A request that needs a sampler row waits (in this coroutine, before it is submitted)
        while every row may be taken, so no burst can exhaust them. Requests of one ``group``
        (the prompts and choices of one HTTP request) are submitted at most
        :attr:`group_limit` (two batches) at a time, the rest waiting here: a request of a
        thousand prompts then holds two batches' share of the queue, and a request that comes
        after it starts within a batch's worth of its sequences ending, not after all of them.
        Closing the iterator early (the client went away) cancels the request in the batch.
        """
        manager = self._manager
        if manager is None or not (self._running if _probe else self.healthy):
            reason = _fatal_error(manager) if manager else "not started"
            raise EngineUnavailable(f"the generation engine is not running ({reason})")
        # the batching thread serves every request: one it cannot take would stop it for all
        problem = prompt_ids_problem(prompt_ids, vocab_size_of(self.loaded.model))
        if problem:
            raise PromptRejected(f"the prompt is {problem}; the request was not submitted")
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        outputs: asyncio.Queue = asyncio.Queue()
        self._live[request_id] = (asyncio.get_running_loop(), outputs)
        if sampling.seed is None and self._seeds is not None and not _probe:
            sampling = attrs.evolve(sampling, seed=self._seeds.getrandbits(63))
        stops = tuple(dict.fromkeys([*(() if ignore_eos else self.eos_token_ids),
                                     *stop_token_ids]))
        if sampling.min_tokens:
            sampling = attrs.evolve(sampling, stop_token_ids=stops)
        track = not _probe
        if track:
            self._held[request_id] = len(prompt_ids)
        slot = None
        finished = False
        submitted = False
        gate, held = None, False
        started = last_at = time.perf_counter()  # time to first token counts a wait for a row
        try:
            if group is not None:
                gate = self._groups.setdefault(group, [asyncio.Semaphore(self.group_limit), 0])
                gate[1] += 1
                await gate[0].acquire()
                held = True
            slot = await self._open_slot(sampling, prompt_ids)
            kwargs = {SLOT_KWARG: slot} if slot >= 0 else {}
            self._slots[request_id] = slot
            detok = IncrementalDetokenizer(self.tokenizer, tuple(stop), include_stop=include_stop_str,
                                           skip_special_tokens=skip_special_tokens)
            first_token_s = None
            seen = yielded = 0
            manager.register_result_handler(request_id, outputs.put_nowait)
            submitted = True
            added = manager.add_request(list(prompt_ids), request_id=request_id,
                                        max_new_tokens=max_tokens, streaming=True,
                                        eos_token_id=list(stops) or -1, **kwargs)
            if added is None:
                raise EngineUnavailable("the generation engine is stopping")
            while True:
                out = await outputs.get()
                if isinstance(out, _Abort):
                    raise EngineUnavailable(out.reason)
                if out.error is not None:
                    raise EngineError(out.error)
                tokens = tuple(out.generated_tokens)
                now = time.perf_counter()
                if first_token_s is None and tokens:
                    first_token_s = now - started
                if track and len(tokens) > seen:
                    if self.on_tokens is not None:  # the first tokens have no gap before them
                        self.on_tokens(now - last_at if seen else None, len(tokens) - seen)
                    seen, last_at = len(tokens), now
                    self._started.add(request_id)
                    self._held[request_id] = len(prompt_ids) + len(tokens)
                logprobs = (tuple(self.sampler.records(slot)[:len(tokens)])
                            if sampling.logprobs is not None else ())
                searched = len(tokens) > sampling.min_tokens  # stop strings: after min_tokens
                text = detok.step(list(tokens), check_stops=searched)
                if detok.stopped:
                    finished = out.is_finished()
                    yield Delta(text, tokens, "stop", first_token_s, logprobs,
                                detok.stop_string)
                    return
                if out.is_finished():
                    finished = True
                    text += detok.finish(check_stops=searched)
                    reason = "stop" if tokens and tokens[-1] in stops else "length"
                    by = tokens[-1] if reason == "stop" and tokens[-1] in stop_token_ids and (
                        ignore_eos or tokens[-1] not in self.eos_token_ids) else None
                    yield Delta(text, tokens, reason, first_token_s, logprobs, by)
                    return
                # a delta for every new token, its text empty while the detokenizer holds an
                # incomplete character or a possible stop string back (as vLLM streams): a
                # stream's first chunk is its first token, whatever the text
                if text or len(tokens) > yielded:
                    yielded = len(tokens)
                    yield Delta(text, tokens, None, first_token_s, logprobs)
        finally:
            self._live.pop(request_id, None)
            self._held.pop(request_id, None)
            self._started.discard(request_id)
            self._slots.pop(request_id, None)
            if slot is not None:
                self.sampler.close(slot)
            if submitted and not finished:
                manager.cancel_request(request_id)
                self._forget(request_id)
            if gate is not None:
                if held:
                    gate[0].release()
                gate[1] -= 1
                if not gate[1]:
                    self._groups.pop(group, None)

    def abort_all(self, reason: str) -> int:
        """End every running :meth:`generate` with :class:`EngineUnavailable` (``reason``), from
        any thread: a shutdown's deadline answers its requests (a 503, or a stream's error event)
        instead of leaving them to be cancelled mid-write. Returns how many were running."""
        live = list(self._live.values())
        for loop, outputs in live:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                loop.call_soon_threadsafe(outputs.put_nowait, _Abort(reason))
        return len(live)

    async def _open_slot(self, sampling: SamplingParams, prompt_ids: Sequence[int]) -> int:
        """The request's sampler key, waiting while ``max_slots`` requests may hold rows."""
        slot = self.sampler.open(sampling, prompt_ids)
        loop = asyncio.get_running_loop()
        while slot is None:
            waiter = (loop, loop.create_future())
            with self._room_lock:  # registered before trying again: a release in between wakes it
                self._room_waiters.append(waiter)
            try:
                slot = self.sampler.open(sampling, prompt_ids)
                if slot is None:
                    await waiter[1]
            finally:
                with self._room_lock:
                    with contextlib.suppress(ValueError):
                        self._room_waiters.remove(waiter)
        return slot

    def _wake_room(self) -> None:
        """A sampler slot gave its room back (on any thread): every waiter tries again."""
        with self._room_lock:
            waiters, self._room_waiters = self._room_waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve, future)

    def _forget(self, request_id: str) -> None:
        # The manager drops a result handler only when its request finishes; a cancelled request
        # never does, so drop it here (transformers 5.14 has no public call for it). An output
        # already in flight for it then lands in the manager's shared queue, which this engine
        # never reads: empty it, so cancelled requests leave nothing behind.
        router = getattr(self._manager, "output_router", None)
        if router is None:
            return
        with router._lock:
            router.result_handlers.pop(request_id, None)
        while True:
            try:
                router.output_queue.get_nowait()
            except queue.Empty:
                break

    @property
    def scores_prompts(self) -> bool:
        """Whether :meth:`prompt_logprobs` works: only the dynamic-cache batcher runs a plain
        forward between its steps (transformers' continuous batching switches the model's
        attention to its paged kernels, which a forward without the paged cache cannot use)."""
        return isinstance(self._manager, CacheBatcher)

    async def prompt_logprobs(self, prompt_ids: Sequence[int], top: int) -> list:
        """``None`` for the first prompt token, then each one's :class:`TokenLogprob` given the
        tokens before it (``top`` alternatives), from one forward over the prompt."""
        manager = self._manager
        if not self.healthy or not self.scores_prompts:
            raise EngineUnavailable("prompt log-probabilities need the dynamic-cache batcher")
        request_id = f"score-{uuid.uuid4().hex}"
        outputs: asyncio.Queue = asyncio.Queue()
        manager.register_result_handler(request_id, outputs.put_nowait)
        if manager.add_scoring(list(prompt_ids), request_id, top) is None:
            raise EngineUnavailable("the generation engine is stopping")
        self._live[request_id] = (asyncio.get_running_loop(), outputs)
        try:
            out = await outputs.get()
        finally:
            self._live.pop(request_id, None)  # each request's entry goes with it
            manager.cancel_request(request_id)
        if isinstance(out, _Abort):
            raise EngineUnavailable(out.reason)
        if out.error is not None:
            raise EngineError(out.error)
        return [None] + [TokenLogprob(t, lp, tuple(top_)) for t, lp, top_ in out.prompt_logprobs]

    async def complete(self, prompt_ids: Sequence[int], *, max_tokens: int,
                       sampling: SamplingParams, stop: Sequence[str] = (),
                       request_id: str | None = None, _probe: bool = False,
                       **stopping) -> Delta:
        """The whole response as one :class:`Delta` (its text is the full text); ``stopping``:
        :meth:`generate`'s ``stop_token_ids``, ``ignore_eos``, ``include_stop_str``,
        ``skip_special_tokens``."""
        parts = []
        last = None
        async for delta in self.generate(prompt_ids, max_tokens=max_tokens, sampling=sampling,
                                         stop=stop, request_id=request_id, _probe=_probe,
                                         **stopping):
            parts.append(delta.text)
            last = delta
        assert last is not None
        return attrs.evolve(last, text="".join(parts))


PREFILL_TOKENS = 2048  # tokens of one prefill forward, within the plan's bound
DECODE_PADDING = 8  # query tokens a graphed decode batch is padded to a multiple of


def _collect_with_outputs(io, sampler: BatchSampler, overlapped: bool) -> None:
    """Record a step's log-probabilities when its outputs reach the host: ``io``'s
    ``prepare_batch_update`` (every step's update calls it once, in step order, after the step's
    device-to-host copy; synchronous and asynchronous batching alike) collects from the sampler
    before the tokens are delivered. Rows whose token the update will drop (asynchronous
    batching: a request finished or offloaded while the step was in flight, the states
    transformers' ``update_batch`` skips) are collected as skipped. ``io.reset`` (a restarted
    batching loop) forgets the sampler's uncollected steps."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    dropped = (RequestStatus.FINISHED, RequestStatus.PENDING)
    prepare = io.prepare_batch_update

    def prepare_batch_update(*args, **kwargs):
        update = prepare(*args, **kwargs)
        skipped = ()
        if overlapped:  # one step at a time, transformers refuses such states (no Python loop)
            rows = [fs for fs in update[0] if fs.has_new_token]
            skipped = {i for i, fs in enumerate(rows) if fs.state.status in dropped}
        sampler.collect(skipped=skipped)
        return update

    io.prepare_batch_update = prepare_batch_update
    reset = getattr(io, "reset", None)
    if callable(reset):
        def reset_and_forget(*args, **kwargs):
            sampler.forget_steps()
            return reset(*args, **kwargs)

        io.reset = reset_and_forget


def _host_io(io):
    """The host-side inputs of the step being prepared or computed: ``io`` itself, or with
    asynchronous batching the current one of its two IO pairs."""
    pairs = getattr(io, "io_pairs", None)
    return pairs[io.current_pair].host_io if pairs else io


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class _GraphPolicy:
    """Which steps of transformers' runner replay CUDA graphs: decode steps (one query token per
    request) always; steps carrying prefill tokens only while ``prefill`` is set.

    Without flash attention's decode path, transformers runs decode steps on its varlen path and
    would capture a graph for every padded prefill shape too: each one a capture stall on first
    use and graph-pool memory. With ``prefill`` on (the default) their query tokens are padded
    to geometric buckets (:func:`~moe_runtime.serve.graph_shapes.bucket_prefill_queries`) so the
    graphs stay few; off (``MOE_RUNTIME_GRAPH_PREFILL=0`` or ``graph_prefill=False``, or a
    capture that failed at warm-up) prefill chunks run eagerly.
    """

    def __init__(self, runner, io, prefill: bool) -> None:
        self.prefill = prefill
        self.decode = True  # False once a decode step's capture failed: every step eager then
        self.capture_failures: list[str] = []
        self.decode_failed = ""
        # graphs captured, and the seconds their captures took (the step's eager run included),
        # at warm-up and while serving: a step shape first seen while serving stalls its batch
        self.captures = {"warmup": 0, "serving": 0}
        self.capture_seconds = {"warmup": 0.0, "serving": 0.0}
        self.serving = False  # set once the engine's warm-up is done
        self._io = io
        choose = runner._get_forward_fn

        def get_forward_fn(use_block_table):
            forward, graphed = choose(use_block_table)
            return forward, self.decode and graph_this_step(
                graphed, self.decode_only(use_block_table), self.prefill)

        runner._get_forward_fn = get_forward_fn
        capture = getattr(runner, "_capture_graph", None)
        if callable(capture):
            def capture_graph(forward_fn, *args, **kwargs):
                # transformers runs the step eagerly first (its outputs are computed there),
                # then captures it: count the eager runs that completed
                completed = []

                def tracked(*a, **k):
                    out = forward_fn(*a, **k)
                    completed.append(True)
                    return out
                # transformers' signature: (forward_fn, compute_stream, *step arguments)
                device = getattr(args[0], "device", None) if args else None
                stream = _current_stream(device)
                started = time.perf_counter()
                try:
                    result = capture(tracked, *args, **kwargs)
                except Exception as exc:
                    recover_from_failed_capture(stream, getattr(runner, "graph_pool_id", None),
                                                device)
                    decode = self.decode_only(getattr(io, "use_block_table", False))
                    failure = f"{type(exc).__name__}: {exc}"
                    self.capture_failures.append(failure)
                    self.prefill = False
                    if decode:
                        self.decode = False
                        self.decode_failed = failure
                    log.warning("CUDA graphs: capturing a %s step failed (%s); %s run eagerly "
                                "from now on", "decode" if decode else "prefill", failure,
                                "all steps" if decode else "prefill steps")
                    if not completed:
                        raise  # the step itself failed, not only its capture
                    # the eager run computed this step: it is served (transformers 5.17 stops
                    # the whole batching loop on an error raised here)
                    return None
                self._count_capture(time.perf_counter() - started,
                                    self.decode_only(getattr(io, "use_block_table", False)))
                return result

            runner._capture_graph = capture_graph

    def _count_capture(self, seconds: float, decode: bool) -> None:
        phase = "serving" if self.serving else "warmup"
        self.captures[phase] += 1
        self.capture_seconds[phase] += seconds
        if self.serving:
            io = _host_io(self._io)
            log.info("CUDA graphs: captured a %s step shape first seen while serving (%d query "
                     "tokens, %d requests) in %.0f ms; %d captured while serving, %.1f s in all",
                     "decode" if decode else "prefill", getattr(io, "total_seqlen_q", -1),
                     getattr(io, "num_request_in_batch", -1), seconds * 1e3,
                     self.captures["serving"], self.capture_seconds["serving"])

    def decode_only(self, use_block_table: bool) -> bool:
        io = _host_io(self._io)
        return bool(use_block_table) or io.total_seqlen_q == io.num_request_in_batch

    @classmethod
    def install(cls, processor, prefill: bool) -> _GraphPolicy | None:
        """Wrap ``processor``'s runner; None (graphs as transformers chooses them, prefill
        included) where this transformers lacks what the policy reads."""
        runner = getattr(processor, "model_runner", None)
        io = getattr(processor, "inputs_and_outputs", None)
        host = _host_io(io) if io is not None else None
        missing = [name for owner, name in ((runner, "_get_forward_fn"),
                                            (host, "total_seqlen_q"),
                                            (host, "num_request_in_batch"))
                   if not hasattr(owner, name)]
        if missing:
            log.warning("CUDA graphs: this transformers' batch processor has no %s; its runner "
                        "graphs steps as it chooses (%s ignored)", ", ".join(missing), PREFILL_ENV)
            return None
        return cls(runner, io, prefill)


def _current_stream(device=None):
    """The current CUDA stream of ``device`` (default: the current device), or None (no CUDA:
    a capture cannot have run)."""
    try:
        import torch

        return torch.cuda.current_stream(device)
    except Exception:
        return None


def recover_from_failed_capture(stream, pool, device=None) -> None:
    """Undo what a failed CUDA-graph capture leaves behind in this process, so that eager steps
    and later captures work (found on an H100, 2026-12-07: one invalidated capture made every
    later capture fail with "beginAllocateToPool: already recording to mempool_id" and every
    later CUDA random draw with "Offset increment outside graph capture encountered
    unexpectedly", in the next engine too).

    ``CUDAGraph.capture_end`` raises at ``cudaStreamEndCapture`` before it ends the allocator's
    recording to the graph's memory pool and before it takes the CUDA generators out of capture
    mode, and ``torch.cuda.graph`` then skips restoring the caller's stream. Here: the pool's
    recording is ended (nothing happens where capture_end got that far), the default generator
    of ``device`` (the capture's; default: the current device), if it refuses an eager draw,
    gets a fresh copy of its own state (same seed and eager offset, not capturing), and
    ``stream`` (that device's stream before the capture) is made current again. The pool's use
    count taken by capture_begin is left as is: transformers' pool lives as long as its runner,
    and releasing it twice would free memory under live graphs."""
    import torch

    if stream is not None:
        with contextlib.suppress(Exception):
            torch.cuda.set_stream(stream)
    try:
        index = torch.device(device).index if device is not None else None
        index = torch.cuda.current_device() if index is None else index
    except Exception:
        return
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if pool is not None and end is not None:
        with contextlib.suppress(Exception):  # not recording: capture_end ended it
            end(index, pool)
    try:  # the capture's device only: a draw on another would make a context there
        gen = torch.cuda.default_generators[index]
    except Exception:
        return
    try:  # an eager draw fails only on a generator left in capture mode
        torch.rand(1, device=gen.device, generator=gen)
    except RuntimeError:  # graphs that captured the old state keep it
        with contextlib.suppress(Exception):
            gen.graphsafe_set_state(gen.clone_state())


def prompt_ids_problem(ids, vocab_size: int | None) -> str | None:
    """What makes ``ids`` no prompt the batching path can take (a non-empty flat sequence of
    token ids below ``vocab_size``), or None. Found by an audit (2026-12-07): a chat template
    call that returned nested lists reached transformers' continuous batching, whose thread
    then stopped, and every later request was answered 503."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        return f"a {type(ids).__name__}, not a list of token ids"
    if not ids:
        return "empty: no token ids"
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            return (f"not a flat list of token ids: item {i} is a {type(t).__name__} "
                    f"({clip_repr(t)})")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            return (f"token id {t} at {i}, outside the vocabulary (0 to "
                    f"{(vocab_size or 1) - 1})")
    return None


def clip_repr(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


_FINITE_DTYPES = {"torch.float16", "torch.bfloat16", "torch.float32", "torch.float64"}


def _capturing(t) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``t``'s device."""
    import torch

    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _fatal_error(manager):
    """The continuous-batching thread's fatal error, if any (transformers 5.14 keeps it on the
    manager, 5.17 on ``manager.background_thread_status``)."""
    status = getattr(manager, "background_thread_status", None)
    return getattr(manager, "fatal_error", None) or getattr(status, "fatal_error", None)


_BATCHER_LOGGERS = ("ContinuousBatchingLogger", "moe_runtime.serve.batching")


@contextlib.contextmanager
def _quiet_batchers(quiet: bool):
    """The batchers log a failed step with its traceback; the probe reports it in one paragraph."""
    loggers = [logging.getLogger(name) for name in _BATCHER_LOGGERS] if quiet else []
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _ModuleTrace:
    """While active, remembers which module forwards are open on each thread: after a failed
    forward, the innermost one still open is the module that raised (post-hooks never ran)."""

    def __init__(self, model) -> None:
        self._names = {id(m): f"{name or 'the model'} ({type(m).__name__})"
                       for name, m in model.named_modules()}
        self._open: dict[int, list[str]] = {}
        self._handles = []
        # (module, a device flag: its output is all finite), in the order the forwards ended;
        # read after the probe only (no host sync inside a step, none at all while capturing)
        self._finite: list[tuple[str, object]] = []

    def __enter__(self) -> _ModuleTrace:
        import torch
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        def pre(module, args):
            name = self._names.get(id(module))
            if name is not None:
                self._open.setdefault(threading.get_ident(), []).append(name)

        def post(module, args, output):
            stack = self._open.get(threading.get_ident())
            if stack and self._names.get(id(module)) == stack[-1]:
                stack.pop()
            name = self._names.get(id(module))
            t = output[0] if isinstance(output, (tuple, list)) and output else output
            t = getattr(t, "last_hidden_state", None) if not hasattr(t, "is_floating_point") \
                else t
            if (name is not None and t is not None and t.is_floating_point() and t.numel()
                    and str(t.dtype) in _FINITE_DTYPES and len(self._finite) < 100_000
                    and not _capturing(t)):
                try:  # a diagnosis only: it never fails the probe itself
                    self._finite.append((name, torch.isfinite(t).all()))
                except (RuntimeError, NotImplementedError):
                    pass

        self._handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def first_non_finite(self) -> str | None:
        """The first module (in the order forwards ended: the innermost first) whose output held
        inf or NaN during the trace, or None."""
        return next((name for name, ok in self._finite if not bool(ok)), None)

    def failing_module(self) -> str | None:
        stacks = [s for s in self._open.values() if s]
        return stacks[-1][-1] if stacks else None
