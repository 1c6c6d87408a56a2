"""Per-request sampling inside transformers' continuous batching.

transformers' continuous batching (5.x) samples the whole batch with one ``torch.multinomial`` on
the background thread's global generator, and takes ``do_sample`` from the manager's shared
generation config: a request's seed cannot make its tokens reproducible while other requests share
the batch. It does take per-request logits processors. :class:`PerRequestSampler` is one: the
manager runs greedy (argmax), and for every sampled request this processor applies the request's
temperature, top-k and top-p and draws the token from the request's own ``torch.Generator``,
leaving that token as the row's only finite logit. Greedy requests pass through untouched. A
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
    """How one request picks its tokens. ``temperature == 0`` is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class _Slot:
    __slots__ = ("params", "generator")

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

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
        if params.greedy:
            return GREEDY
        slot = _Slot(params)
        with self._lock:
            key = self._next
            self._next = (self._next + 1) % (2**31 - 1)
            self._slots[key] = slot
        return key

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
                token = slot.sample(scores[i])
            except RuntimeError:
                # e.g. non-finite logits; an exception here would stop the whole batching thread
                log.exception("sampling failed; this step of the request is greedy")
                continue
            scores[i].fill_(float("-inf"))
            scores[i, token] = 0.0
        return scores


class SamplerProcessorList(ContinuousBatchingLogitsProcessorList):
    """The manager's processor list: only :class:`PerRequestSampler` (one int per request)."""

    def __init__(self, sampler: PerRequestSampler) -> None:
        super().__init__(LogitsProcessorList([sampler]), per_request_processors=False)
        # the base class counts storage rows only for the processors it converts itself
        self.tensors_required = 1
