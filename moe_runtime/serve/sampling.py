"""Per-request sampling inside transformers' continuous batching.

transformers' continuous batching (5.x) samples the whole batch with one ``torch.multinomial`` on
the background thread's global generator, and takes ``do_sample`` from the manager's shared
generation config: a request's seed cannot make its tokens reproducible while other requests share
the batch. It does take per-request logits processors. :class:`PerRequestSampler` is one: the
manager runs greedy (argmax), and for every sampled request this processor applies the request's
temperature, top-k and top-p and draws the token from the request's own ``torch.Generator``,
leaving that token as the row's only finite logit. It also applies presence and frequency
penalties and records log-probabilities where a request asks. Plain greedy requests pass through
untouched. A
request's tokens then depend on its own logits and seed only, whichever requests share its batch.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable

import attrs
import torch
from transformers import LogitsProcessorList
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)

log = logging.getLogger("moe_runtime.serve")

SLOT_KWARG = "moe_runtime_sampling_slot"
GREEDY = -1


@attrs.frozen
class SamplingParams:
    """How one request picks its tokens. ``temperature == 0`` is greedy.

    :param logprobs: record each chosen token's log-probability and this many likeliest
        alternatives (``None``: record nothing). Log-probabilities are the model's own
        (``log_softmax`` of the raw logits, before penalties, temperature and filters).
    :param presence_penalty: subtracted once from the logit of every token already generated.
    :param frequency_penalty: subtracted from a token's logit once per time it was generated.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_slot(self) -> bool:
        """Whether the sampler must see this request's rows (not a plain greedy one)."""
        return not self.greedy or self.logprobs is not None or bool(
            self.presence_penalty or self.frequency_penalty)


@attrs.frozen
class TokenLogprob:
    """One generated token's log-probability and the likeliest alternatives at its step."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class _Slot:
    __slots__ = ("params", "generator", "counts", "records")

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device="cpu").manual_seed(seed % 2**64)
        self.counts: dict[int, int] = {}
        self.records: list[TokenLogprob] = []

    def penalize(self, row: torch.Tensor) -> None:
        """Presence and frequency penalties, in place, over the tokens generated so far."""
        p = self.params
        if not self.counts or not (p.presence_penalty or p.frequency_penalty):
            return
        ids = torch.tensor(list(self.counts), device=row.device)
        counts = torch.tensor(list(self.counts.values()), dtype=row.dtype, device=row.device)
        row.index_put_((ids,), -(p.frequency_penalty * counts + p.presence_penalty),
                       accumulate=True)

    def choose(self, row: torch.Tensor) -> tuple[int, bool]:
        """The row's token, and whether the row must be rewritten to make the batch take it."""
        p = self.params
        raw = row
        if p.logprobs is not None:
            logp = torch.log_softmax(raw.float(), dim=-1)
        if p.presence_penalty or p.frequency_penalty:
            row = row.clone().float()
            self.penalize(row)
        if p.greedy:
            token, forced = int(row.argmax()), row is not raw
        else:
            token, forced = self.sample(row), True
        if p.logprobs is not None:
            top = ()
            if p.logprobs > 0:
                values, ids = torch.topk(logp, min(p.logprobs, logp.numel()))
                top = tuple(zip(ids.tolist(), values.tolist()))
            self.records.append(TokenLogprob(token, float(logp[token]), top))
        self.counts[token] = self.counts.get(token, 0) + 1
        return token, forced

    def sample(self, logits: torch.Tensor) -> int:
        p = self.params
        row = logits.float() / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            row = row.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(row, dim=-1).cpu()
        return int(torch.multinomial(probs, 1, generator=self.generator))


class PerRequestSampler(ContinuousBatchingLogitsProcessor):
    """A continuous-batching logits processor that samples each request with its own generator."""

    supported_kwargs = {SLOT_KWARG: int}
    ignored_kwargs = ()

    def __init__(self) -> None:
        self._slots: dict[int, _Slot] = {}
        self._lock = threading.Lock()
        self._next = 0
        # called with the number of sequences that get a token, once per forward step
        self.on_step: Callable[[int], None] | None = None

    def open(self, params: SamplingParams) -> int:
        """Register a request's sampling; returns the slot to pass as ``SLOT_KWARG`` (or GREEDY)."""
        if not params.needs_slot:
            return GREEDY
        slot = _Slot(params)
        with self._lock:
            key = self._next
            self._next = (self._next + 1) % (2**31 - 1)
            self._slots[key] = slot
        return key

    def records(self, key: int) -> list[TokenLogprob]:
        """The log-probabilities recorded so far for a request (empty: none asked for)."""
        with self._lock:
            slot = self._slots.get(key)
            return list(slot.records) if slot is not None else []

    def close(self, key: int) -> None:
        if key != GREEDY:
            with self._lock:
                self._slots.pop(key, None)

    @property
    def open_slots(self) -> int:
        return len(self._slots)

    # --- the ContinuousBatchingLogitsProcessor interface (called on the batching thread)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(GREEDY)

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        if self.on_step is not None and requests_with_new_token:
            self.on_step(len(requests_with_new_token))
        keys = [r.state.logit_processor_kwargs.get(SLOT_KWARG, GREEDY)
                for r in requests_with_new_token]
        return torch.tensor(keys, dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        keys = tensor_arg[: scores.size(0)].tolist()
        if all(k == GREEDY for k in keys):
            return scores
        with self._lock:
            slots = [self._slots.get(k) if k != GREEDY else None for k in keys]
        for i, slot in enumerate(slots):
            if slot is None:
                continue
            try:
                token, forced = slot.choose(scores[i])
            except RuntimeError:
                # e.g. non-finite logits; an exception here would stop the whole batching thread
                log.exception("sampling failed; this step of the request is greedy")
                continue
            if forced:
                scores[i].fill_(float("-inf"))
                scores[i, token] = 0.0
        return scores


class SamplerProcessorList(ContinuousBatchingLogitsProcessorList):
    """The manager's processor list: only :class:`PerRequestSampler` (one int per request)."""

    def __init__(self, sampler: PerRequestSampler) -> None:
        super().__init__(LogitsProcessorList([sampler]), per_request_processors=False)
        # the base class counts storage rows only for the processors it converts itself
        self.tensors_required = 1
