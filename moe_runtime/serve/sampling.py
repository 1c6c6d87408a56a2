"""Batched, graph-capturable sampling for both batching paths.

:class:`BatchSampler` picks the next token of every running request with tensor operations over
the batch: repetition, frequency and presence penalties, temperature, top-k, top-p and min-p (in
transformers' order and with its definitions), then a Gumbel-max draw. A request with ``min_tokens``
has its stop tokens masked out until it has generated that many. Per-request parameters live
in device tables indexed by a row per request, so one step is the same kernels whatever the batch
holds: no Python loop over requests on the device side, no host sync (a CUDA graph can capture it).
Random numbers are counter-based: a splitmix64 hash of (request seed, the request's position, vocab
id), in int64 torch ops on the device. A request's tokens depend on its logits, seed and position
only, not on which requests share its batch nor on its row. Plain greedy requests (no penalties, no
logprobs, no min_tokens) take no row: they share row 0, the scratch row that padding rows also
index. At most ``max_slots`` requests that need a row may be open at once: :meth:`BatchSampler.open`
refuses one more (returns None) until another is released, so the batching thread can never run
out of rows, however the scheduler interleaves, preempts or restarts requests.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import secrets
import threading
from collections.abc import Callable, Collection, Sequence

import attrs
import torch

# stop token ids a request may add to the model's EOS ids (vLLM's stop_token_ids)
MAX_STOP_TOKEN_IDS = 64
# alternatives per token the sampler can record (the API accepts at most
# protocol.MAX_LOGPROBS, which must not exceed it; this module stays free of the HTTP layer)
MAX_LOGPROBS = 20

log = logging.getLogger("moe_runtime.serve")

SLOT_KWARG = "moe_runtime_sampling_slot"
GREEDY = -1
# temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing float32 logits by a
# temperature near 0 overflows to inf, and the draw would then pick among the infinite logits
# by sort order (the least likely of the positive ones), not the likeliest
GREEDY_BELOW = 1e-5
# sets of log-probability buffers: a step writes one while the step before it may still be
# waiting for collect() (transformers' asynchronous batching launches step N+1 before step N's
# tokens reach the host)
_BUFFERS = 2


class SamplingError(ValueError):
    """Sampling parameters no sampler accepts; the message names the field and what is accepted."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise SamplingError(message)


@attrs.frozen
class SamplingParams:
    """How one request picks its tokens. ``temperature`` 0 (below ``GREEDY_BELOW``, as vLLM) or
    ``top_k == 1`` is greedy.

    :param top_k: keep the ``top_k`` likeliest tokens (0: no top-k filter).
    :param min_p: drop tokens less likely than ``min_p`` times the likeliest one (0: off).
    :param logprobs: record each chosen token's log-probability and this many likeliest
        alternatives (``None``: record nothing). Log-probabilities are the model's own
        (``log_softmax`` of the raw logits, before penalties, temperature and filters).
    :param presence_penalty: subtracted once from the logit of every token already generated.
    :param frequency_penalty: subtracted from a token's logit once per time it was generated.
    :param repetition_penalty: transformers' (CTRL's) penalty over prompt and generated tokens: a
        positive logit is divided by it, a negative one multiplied (1: off).
    :param min_tokens: until the request has generated this many tokens, ``stop_token_ids`` are
        never drawn (their logits are -inf, as vLLM's min_tokens processor does).
    :param stop_token_ids: the tokens that would end the request (its EOS ids and any others);
        only ``min_tokens`` reads them here.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        def finite(name):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and math.isfinite(value),
                   f"{name} must be a finite number, got {value!r}")
            return value

        _check(finite("temperature") >= 0, f"temperature must be 0 (greedy) or more, got "
                                           f"{self.temperature}")
        _check(0 < finite("top_p") <= 1, f"top_p must lie in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               f"top_k must be an integer, 0 (off) or more, got {self.top_k!r}")
        _check(0 <= finite("min_p") <= 1, f"min_p must lie in [0, 1], got {self.min_p}")
        _check(finite("repetition_penalty") > 0,
               f"repetition_penalty must be above 0 (1: off), got {self.repetition_penalty}")
        finite("presence_penalty")
        finite("frequency_penalty")
        _check(self.logprobs is None or (isinstance(self.logprobs, int)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got "
               f"{self.logprobs!r}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
               f"min_tokens must be an integer, 0 (off) or more, got {self.min_tokens!r}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        # any integer: seeds are taken modulo 2**64 (n > 1 choices add their index to one)
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
               f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def bans(self) -> bool:
        """Whether some tokens are masked out at the start (``min_tokens`` over stop tokens)."""
        return self.min_tokens > 0 and bool(self.stop_token_ids)

    @property
    def needs_slot(self) -> bool:
        """Whether the request needs a row of its own (not a plain greedy one)."""
        return not self.greedy or self.logprobs is not None or self.penalized or self.bans


@attrs.frozen
class TokenLogprob:
    """One generated token's log-probability and the likeliest alternatives at its step."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# ------------------------------------------------------------------ counter-based random numbers

def _signed(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (multiplication wraps modulo 2**64)."""
    x = x ^ _shr(x, 30)
    x = x * _MIX1
    x = x ^ _shr(x, 27)
    x = x * _MIX2
    return x ^ _shr(x, 31)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Uniform floats in (0, 1), one per ``ids`` entry, a function of (seed, position, id) only.

    ``seeds`` and ``positions`` are int64 of shape [B]; ``ids`` int64 of shape [B, N].
    """
    row = splitmix64(seeds + splitmix64(positions * _GOLDEN + 1))
    bits = splitmix64(row[:, None] + (ids + 1) * _GOLDEN)
    return (_shr(bits, 40).float() + 0.5) * (1.0 / (1 << 24))


# ------------------------------------------------------------------------------- the sampler

# columns of the float parameter table
_T, _TOP_P, _MIN_P, _REP, _PRES, _FREQ, _GREEDY = range(7)
# columns of the integer parameter table
_TOP_K, _SEED, _POS, _MIN_TOKENS = range(4)
_PROMPT_BIT = 1 << 30  # counts: generated-token count in the low bits, this bit: in the prompt


class _Slot:
    __slots__ = ("params", "seed", "prompt", "records", "row", "released")

    def __init__(self, params: SamplingParams, prompt: Sequence[int]) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.seed = _signed(seed % 2**64)
        self.prompt = tuple(prompt) if params.repetition_penalty != 1.0 else ()
        self.records: list[TokenLogprob] = []
        self.row: int | None = None
        self.released = False  # released or closed: its row may already serve another request


class BatchSampler:
    """Samples the next token of each row of a batch of logits; see the module docstring.

    :param vocab_size: columns of the logits (the LM head's output size).
    :param max_slots: requests that may hold a row at once (plain greedy ones hold none).
    :param max_batch: most logits rows in one step (sizes the log-probability buffers).
    :param max_bans: stop tokens one request's ``min_tokens`` may mask (its ``stop_token_ids``).
    :param device: where the tables live (the model's device).
    :param static: run every stage on every step (what a CUDA graph captures). Without it a step
        skips the stages no row of the batch uses; a row's token is the same either way.

    ``open``, ``close``, ``release`` and ``records`` may be called from any thread;
    ``rows_for``, ``sample`` and ``collect`` from the batching thread only, in that order each
    step, or (after :meth:`pipeline` with depth 2) with the next step's ``rows_for`` and
    ``sample`` between a step's ``sample`` and its ``collect``.
    """

    def __init__(self, vocab_size: int, *, max_slots: int = 64, max_batch: int = 64,
                 max_bans: int = MAX_STOP_TOKEN_IDS + 8, device: str | torch.device = "cpu",
                 static: bool = False) -> None:
        _check(vocab_size >= 1 and max_slots >= 1 and max_batch >= 1,
               f"vocab_size, max_slots and max_batch must be positive, got {vocab_size}, "
               f"{max_slots}, {max_batch}")
        self.vocab_size = vocab_size
        self.max_slots = max_slots
        self.max_batch = max_batch
        self.max_bans = max(1, max_bans)
        self.device = torch.device(device)
        self.static = static
        rows = max_slots + 1  # row 0: greedy scratch (plain greedy requests and padding)
        self._fparams = torch.zeros((rows, 7), dtype=torch.float32, device=self.device)
        self._iparams = torch.zeros((rows, 4), dtype=torch.int64, device=self.device)
        # per row: the token ids min_tokens masks (-1: none)
        self._bans = torch.full((rows, self.max_bans), -1, dtype=torch.int64, device=self.device)
        self._fparams[:, [_T, _TOP_P, _REP, _GREEDY]] = 1.0
        self._iparams[:, _TOP_K] = vocab_size
        self._counts = torch.zeros((rows, vocab_size), dtype=torch.int32, device=self.device)
        # per buffer (see _BUFFERS) and row of a step: its token, the token's log-probability
        # and the top MAX_LOGPROBS alternatives
        self._lp_chosen = torch.zeros((_BUFFERS, max_batch), dtype=torch.float32,
                                      device=self.device)
        self._lp_values = torch.zeros((_BUFFERS, max_batch, MAX_LOGPROBS), dtype=torch.float32,
                                      device=self.device)
        self._lp_ids = torch.zeros((_BUFFERS, max_batch, MAX_LOGPROBS), dtype=torch.int64,
                                   device=self.device)
        self._tokens = torch.zeros((_BUFFERS, max_batch), dtype=torch.int64, device=self.device)
        self._row_index = torch.arange(max_batch, device=self.device)  # made once, not per step
        self._slots: dict[int, _Slot] = {}
        self._holding: set[int] = set()  # keys of open slots not yet released: each may need a row
        self._closed: list[_Slot] = []
        self._free = list(range(max_slots, 0, -1))
        self._lock = threading.Lock()
        self._next = 0
        # steps sampled and not collected yet, oldest first: (their slots (None: a greedy row),
        # their log-probability buffer, whether they counted tokens for penalties); at most one
        # unless pipeline() allows two
        self._pending: collections.deque = collections.deque(maxlen=1)
        self._issued = 0
        # the stream the steps compute on, where row assignments are written (None: the
        # current one); see pipeline()
        self.stream = None
        self._flags = (True, True, True, True)
        # called with the number of sequences that get a token, once per forward step
        self.on_step: Callable[[int], None] | None = None
        # called (from the thread that released or closed it) when a slot stops holding room
        self.on_room: Callable[[], None] | None = None

    # --- any thread

    def open(self, params: SamplingParams, prompt: Sequence[int] = ()) -> int | None:
        """Register a request; returns the key to pass as ``SLOT_KWARG`` (or GREEDY: no row), or
        None when ``max_slots`` requests that need a row are open already (try again once
        ``on_room`` is called)."""
        if not params.needs_slot:
            return GREEDY
        _check(len(params.stop_token_ids) <= self.max_bans or not params.bans,
               f"{len(params.stop_token_ids)} stop tokens for min_tokens; the sampler holds "
               f"{self.max_bans} per request")
        slot = _Slot(params, prompt)
        with self._lock:
            if len(self._holding) >= self.max_slots:
                return None
            key = self._next
            self._next = (self._next + 1) % (2**31 - 1)
            self._slots[key] = slot
            self._holding.add(key)
        return key

    @property
    def has_room(self) -> bool:
        """Whether :meth:`open` would accept a request that needs a row."""
        return len(self._holding) < self.max_slots

    def _roomed(self) -> None:
        if self.on_room is not None:
            self.on_room()

    def close(self, key: int) -> None:
        """The request is done: its row returns to the pool (on the batching thread's next step)."""
        if key == GREEDY:
            return
        with self._lock:
            slot = self._slots.pop(key, None)
            if slot is not None:
                slot.released = True
                self._closed.append(slot)
            freed = key in self._holding
            self._holding.discard(key)
        if freed:
            self._roomed()

    def release(self, key: int) -> None:
        """The request made its last token (called by the batching thread as it delivers it): its
        row returns to the pool on the next step, before the request is closed, so requests that
        finish faster than their consumers close them hold no rows. Its records stay until
        :meth:`close`."""
        if key == GREEDY:
            return
        with self._lock:
            slot = self._slots.get(key)
            freed = key in self._holding
            if slot is not None and freed:
                slot.released = True
                self._closed.append(slot)
            self._holding.discard(key)
        if freed:
            self._roomed()

    def records(self, key: int) -> list[TokenLogprob]:
        """The log-probabilities recorded so far for a request (empty: none asked for)."""
        with self._lock:
            slot = self._slots.get(key)
            return list(slot.records) if slot is not None else []

    @property
    def open_slots(self) -> int:
        return len(self._slots)

    # --- the batching thread

    def pipeline(self, depth: int, stream=None) -> None:
        """How many steps may be sampled before the oldest is collected: 1 (each step collected
        before the next one is prepared) or 2 (transformers' asynchronous batching: step N+1 is
        prepared and launched on ``stream`` while step N runs). ``stream``: the CUDA stream the
        steps compute on; row assignments are written there, after the step before them (whose
        rows may be the ones being reused), instead of on the preparing thread's stream."""
        _check(depth in (1, _BUFFERS), f"pipeline depth {depth}: 1 or {_BUFFERS}")
        self._pending = collections.deque(self._pending, maxlen=depth)
        self.stream = stream

    def forget_steps(self) -> None:
        """Drop the steps not collected yet (warm-up forwards, which are never delivered)."""
        self._pending.clear()

    @property
    def newest_buffer(self) -> int:
        """The log-probability buffer of the step :meth:`rows_for` prepared last."""
        return self._pending[-1][1] if self._pending else 0

    def rows_for(self, keys: Sequence[int]) -> torch.Tensor:
        """The table rows of one step's requests (int32, on the host), in ``keys`` order.

        A request's row is assigned and written the first time it is sampled; rows of closed
        requests return to the pool here.
        """
        with self._lock:
            for slot in self._closed:
                if slot.row is not None:
                    self._free.append(slot.row)
                    slot.row = None
            self._closed.clear()
            slots = [self._slots.get(k) if k != GREEDY else None for k in keys]
        fresh = [s for s in slots if s is not None and s.row is None]
        if fresh:
            with (torch.cuda.stream(self.stream) if self.stream is not None
                  else contextlib.nullcontext()):
                self._assign(fresh)
        if len(self._pending) == self._pending.maxlen and self._pending.maxlen > 1:
            # a step was prepared twice without its outputs being collected: its log-probability
            # records are lost (never seen; warm-up steps are forgotten before serving)
            log.error("sampler: a step's log-probabilities were never collected; dropped")
        live = [s.params for s in slots if s is not None]
        self._flags = (any(not p.greedy for p in live), any(p.penalized for p in live),
                       any(p.logprobs is not None for p in live), any(p.bans for p in live))
        # one step at a time: always buffer 0 (the buffer a step writes then does not depend on
        # the argument row reaching the device before the step runs)
        self._pending.append((slots, self._issued % self._pending.maxlen,
                              self.static or self._flags[1]))
        self._issued += 1
        if self.on_step is not None and keys:
            self.on_step(len(keys))
        return torch.tensor([s.row if s is not None else 0 for s in slots], dtype=torch.int32)

    def _assign(self, fresh: list[_Slot]) -> None:
        if len(fresh) > len(self._free):
            # open() admits at most max_slots unreleased slots, so this cannot happen
            raise SamplingError(
                f"{len(self._slots)} requests hold sampling rows and {len(fresh)} more need one, "
                f"but the sampler has {self.max_slots} rows (max_slots)")
        for s in fresh:
            s.row = self._free.pop()
        rows = torch.tensor([s.row for s in fresh], dtype=torch.int64)
        fvals, ivals = [], []
        bans = torch.full((len(fresh), self.max_bans), -1, dtype=torch.int64)
        for i, s in enumerate(fresh):
            p = s.params
            fvals.append([1.0 if p.greedy else p.temperature, p.top_p, p.min_p,
                          p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                          1.0 if p.greedy else 0.0])
            top_k = p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size
            ivals.append([top_k, s.seed, 0, p.min_tokens if p.bans else 0])
            ids = [t for t in p.stop_token_ids if t < self.vocab_size][:self.max_bans] \
                if p.bans else []
            bans[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        # host tensors made here and not kept: copied without a stream sync (the preparing
        # thread must not wait for the step in flight)
        dev = {"device": self.device, "non_blocking": True}

        def put(t: torch.Tensor) -> torch.Tensor:
            return _pinned(t, self.device).to(**dev)
        dev_rows = put(rows)
        self._fparams.index_copy_(0, dev_rows, put(torch.tensor(fvals)))
        self._iparams.index_copy_(0, dev_rows, put(torch.tensor(ivals, dtype=torch.int64)))
        self._bans.index_copy_(0, dev_rows, put(bans))
        self._counts.index_fill_(0, dev_rows, 0)
        for s in fresh:
            ids = [t for t in s.prompt if 0 <= t < self.vocab_size]
            if ids:
                self._counts[s.row].index_fill_(
                    0, put(torch.tensor(ids, dtype=torch.int64)), _PROMPT_BIT)

    def sample(self, logits: torch.Tensor, rows: torch.Tensor,
               buffer: torch.Tensor | int | None = None) -> torch.Tensor:
        """The next token of each row (int64 [B], on the logits' device); no host sync.

        ``logits``: [B, vocab_size]; ``rows``: [B] from :meth:`rows_for` (on any device);
        ``buffer``: where the step's log-probabilities go, :attr:`newest_buffer` of the step's
        ``rows_for`` (a device tensor whose first element holds it, read when a CUDA graph
        replays, or an int); None: the last ``rows_for``'s.
        """
        b, v = logits.shape
        if v != self.vocab_size or b > self.max_batch:
            raise SamplingError(f"logits of shape {tuple(logits.shape)}: the sampler was made "
                                f"for {self.vocab_size} columns and at most {self.max_batch} rows")
        sampled, penalized, logprobs, banned = (True,) * 4 if self.static else self._flags
        rows = rows.to(device=logits.device, dtype=torch.int64)
        raw = logits.float()
        fp = self._fparams.index_select(0, rows)
        ip = self._iparams.index_select(0, rows)
        x = _ban(raw, ip, self._bans.index_select(0, rows)) if banned else raw
        x = _penalize(x, fp, self._counts.index_select(0, rows)) if penalized else x
        tokens = x.argmax(dim=-1)
        if sampled:
            tokens = torch.where(fp[:, _GREEDY] > 0, tokens, self._draw(x, fp, ip))
        if isinstance(buffer, torch.Tensor):  # read on the device when the step runs
            at = (buffer.reshape(-1)[:1].to(device=self.device, dtype=torch.int64).expand(b),
                  self._row_index[:b])

            def put(dst: torch.Tensor, src: torch.Tensor) -> None:
                dst.index_put_(at, src)
        else:
            i = self.newest_buffer if buffer is None else int(buffer)

            def put(dst: torch.Tensor, src: torch.Tensor) -> None:
                dst[i, :b].copy_(src)
        if logprobs:
            logp = torch.log_softmax(raw, dim=-1)
            put(self._lp_chosen, logp.gather(1, tokens[:, None])[:, 0])
            k = min(MAX_LOGPROBS, v)
            values, ids = torch.topk(logp, k, dim=-1)
            put(self._lp_values[:, :, :k], values)
            put(self._lp_ids[:, :, :k], ids)
        # the step's bookkeeping: each row's position and (if any row is penalized) counts
        self._iparams.index_put_((rows, torch.full_like(rows, _POS)), torch.ones_like(rows),
                                 accumulate=True)
        if penalized:
            self._counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32),
                                    accumulate=True)
        put(self._tokens, tokens)
        return tokens

    def _draw(self, x: torch.Tensor, fp: torch.Tensor, ip: torch.Tensor) -> torch.Tensor:
        """A Gumbel-max draw from the filtered logits, keyed by (seed, position, token id)."""
        ascending, order = _filter(x, fp, ip)
        u = uniforms(ip[:, _SEED], ip[:, _POS], order)
        pick = (ascending - torch.log(-torch.log(u))).argmax(dim=-1, keepdim=True)
        return order.gather(1, pick)[:, 0]

    def filtered_logits(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """What each row's draw samples from: penalized, tempered and filtered logits (-inf where
        filtered). For tests and inspection; it does not advance positions."""
        rows = rows.to(device=logits.device, dtype=torch.int64)
        fp = self._fparams.index_select(0, rows)
        ip = self._iparams.index_select(0, rows)
        x = _ban(logits.float(), ip, self._bans.index_select(0, rows))
        x = _penalize(x, fp, self._counts.index_select(0, rows))
        ascending, order = _filter(x, fp, ip)
        return torch.empty_like(ascending).scatter_(1, order, ascending)

    def _undo(self, rows: list[int], tokens: list[int], counted: bool) -> None:
        """Take one sampled step back from ``rows`` (their tokens ``tokens``), on the compute
        stream, before their next step there."""
        dev = {"device": self.device, "non_blocking": True}
        r = _pinned(torch.tensor(rows, dtype=torch.int64), self.device).to(**dev)
        with (torch.cuda.stream(self.stream) if self.stream is not None
              else contextlib.nullcontext()):
            self._iparams.index_put_((r, torch.full_like(r, _POS)), -torch.ones_like(r),
                                     accumulate=True)
            if counted:
                t = _pinned(torch.tensor(tokens, dtype=torch.int64), self.device).to(**dev)
                self._counts.index_put_((r, t), -torch.ones_like(t, dtype=torch.int32),
                                        accumulate=True)

    def collect(self, skipped: Collection[int] = ()) -> None:
        """After the host has the oldest uncollected step's tokens (its computation is done):
        record log-probabilities for the rows of that step that asked for them (one
        device-to-host copy, only then).

        ``skipped``: rows of the step whose token the batcher drops (with asynchronous batching,
        a request offloaded or finished while the step was in flight): they get no record, and
        a request that keeps its row has the step undone (its position, and its token's count for
        the penalties), so it goes on as if the step had not run.
        """
        if not self._pending:
            return
        step, buf, counted = self._pending.popleft()
        undo = [(i, s) for i, s in enumerate(step)
                if i in skipped and s is not None and not s.released and s.row is not None]
        wanted = [(i, s) for i, s in enumerate(step)
                  if s is not None and s.params.logprobs is not None and i not in skipped]
        if not wanted and not undo:
            return
        n = len(step)
        tokens = self._tokens[buf, :n].tolist()
        if undo:
            self._undo([s.row for _, s in undo], [tokens[i] for i, _ in undo], counted)
        if not wanted:
            return
        chosen = self._lp_chosen[buf, :n].tolist()
        values = self._lp_values[buf, :n].tolist()
        ids = self._lp_ids[buf, :n].tolist()
        with self._lock:
            for i, s in wanted:
                top = min(s.params.logprobs, self.vocab_size)
                s.records.append(TokenLogprob(tokens[i], chosen[i],
                                              tuple(zip(ids[i][:top], values[i][:top]))))


def _pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor made for one copy) in page-locked memory where it goes to a CUDA
    device, so that a non-blocking copy does not wait for the stream's work."""
    return t.pin_memory() if device.type == "cuda" else t


def _ban(x: torch.Tensor, ip: torch.Tensor, bans: torch.Tensor) -> torch.Tensor:
    """-inf at each row's banned ids while it has made fewer than its min_tokens tokens."""
    active = (ip[:, _POS, None] < ip[:, _MIN_TOKENS, None]) & (bans >= 0)
    ninf = torch.full_like(bans, 0, dtype=x.dtype).masked_fill_(active, float("-inf"))
    # adding 0 or -inf: padding entries (index 0, adding 0) cannot undo a real ban of token 0
    return x.scatter_add(1, bans.clamp(min=0), ninf)


def _penalize(x: torch.Tensor, fp: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Repetition penalty (transformers' RepetitionPenaltyLogitsProcessor, over prompt and
    generated tokens), then frequency and presence penalties over the generated tokens."""
    generated = (counts & (_PROMPT_BIT - 1)).float()
    rep = fp[:, _REP, None]
    x = torch.where(counts != 0, torch.where(x < 0, x * rep, x / rep), x)
    return x - fp[:, _FREQ, None] * generated - fp[:, _PRES, None] * (generated > 0).float()


def _filter(x: torch.Tensor, fp: torch.Tensor, ip: torch.Tensor):
    """Temperature, top-k, top-p and min-p, in transformers' order and as its warpers define them
    (min_tokens_to_keep 1), on logits sorted ascending: returns them (-inf where filtered) and
    the sort order."""
    v = x.shape[-1]
    ninf = float("-inf")
    ascending, order = torch.sort(x / fp[:, _T, None], dim=-1)
    # top-k: keep what is at least the k-th largest (ties kept, as TopKLogitsWarper does)
    kth = ascending.gather(1, (v - ip[:, _TOP_K].clamp(1, v))[:, None])
    ascending = ascending.masked_fill(ascending < kth, ninf)
    # top-p: drop the tokens whose ascending cumulative mass is at most 1 - top_p
    drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - fp[:, _TOP_P, None])
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, ninf)
    # min-p: drop what is less likely than min_p times the likeliest (the last one, ascending)
    probs = ascending.softmax(dim=-1)
    drop = probs < fp[:, _MIN_P, None] * probs[:, -1:]
    drop[:, -1] = False
    return ascending.masked_fill(drop, ninf), order


def vocab_size_of(model) -> int:
    """Columns of the model's logits: the output embedding's rows, else ``config.vocab_size``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None and weight.dim() == 2:
        return int(weight.shape[0])
    return int(model.config.vocab_size)


# ---------------------------------------------------------- transformers' continuous batching

def _processor_classes():
    from transformers import LogitsProcessorList
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
        ContinuousBatchingLogitsProcessorList,
    )

    return LogitsProcessorList, ContinuousBatchingLogitsProcessor, \
        ContinuousBatchingLogitsProcessorList


def processor_list(sampler: BatchSampler):
    """The continuous-batching manager's logits processor list: ``sampler`` picks every row's
    token and leaves it as the row's only finite logit (the manager runs greedy).

    It writes the whole argument row each step: the manager resets that row only once, and a
    CUDA graph's padding rows would otherwise read the rows of earlier requests.
    """
    processors, base, base_list = _processor_classes()

    class _Rows(base):
        supported_kwargs = {SLOT_KWARG: int}
        ignored_kwargs = ()

        def fill_defaults(self, int32_tensor):
            int32_tensor.fill_(0)

        def prepare_tensor_args(self, requests_with_new_token):  # pragma: no cover - unused
            raise NotImplementedError

        def __call__(self, scores, tensor_arg):  # pragma: no cover - unused
            raise NotImplementedError

    class SamplerProcessorList(base_list):
        def __init__(self) -> None:
            super().__init__(processors([_Rows()]), per_request_processors=False)
            # row 0: each sequence's sampler row; row 1 (every entry): the step's
            # log-probability buffer, read on the device (a replayed graph sees the new one)
            self.tensors_required = 2
            self.sampler = sampler

        def fill_defaults(self, int32_tensor):
            int32_tensor.fill_(0)

        def prepare_tensor_args(self, requests_in_batch, arg_storage):
            keys = [r.state.logit_processor_kwargs.get(SLOT_KWARG, GREEDY)
                    for r in requests_in_batch if r.has_new_token]
            rows = torch.zeros(arg_storage.shape[-1], dtype=torch.int32)
            rows[:len(keys)] = sampler.rows_for(keys)
            arg_storage[0].copy_(rows)
            arg_storage[1].fill_(sampler.newest_buffer)
            return arg_storage

        def __call__(self, input_ids, scores, logits_processor_args):
            tokens = sampler.sample(scores, logits_processor_args[0, :scores.shape[0]],
                                    buffer=logits_processor_args[1, :1])
            out = torch.full_like(scores, float("-inf"))
            return out.scatter_(1, tokens[:, None], 0.0)

    return SamplerProcessorList()
