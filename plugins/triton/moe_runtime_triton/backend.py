"""The experts backend class (imported only when the planner selects ``triton``)."""

from __future__ import annotations

import torch

from moe_runtime import formats as F
from moe_runtime.backend_api import Dispatched, ExpertsBackend, ExpertWeights
from moe_runtime_triton import ops
from moe_runtime_triton.plugin import TRITON_EXPERTS


class TritonExperts(ExpertsBackend):
    """Fused MoE through this package's Triton kernels, token-major layout.

    ``prepare`` checks the weights and lays them out once; ``forward`` launches routing, the two
    grouped GEMMs and the finalize kernel with no host synchronisation (CUDA-graph capturable).
    """

    def __init__(self, *, setup) -> None:
        super().__init__(setup=setup)
        # pinning and hand-built setups bypass the planner: the same matching rule, again
        TRITON_EXPERTS.require_setup(setup)

    def prepare(self, weights: ExpertWeights) -> None:
        expected = self.setup.num_local_experts
        if weights.num_experts != expected:
            raise ValueError(
                f"layer {self.setup.problem.name}: the triton backend got weights of "
                f"{weights.num_experts} experts, expected the {expected} local experts")
        self.weights = ops.prepare_weights(weights, self.setup.runs_as)
        # the configs by call shape, kept with this backend (a class-level lru_cache on the methods
        # held every backend it had seen, with its layer's weights, after the model was deleted)
        self._configs: dict = {}
        self._masked_configs: dict = {}
        self._top_k = self.setup.problem.top_k
        # the TMA path's weight views the tuned table (or MOE_TRITON_TMA=1) will ask for, now:
        # never inside a CUDA graph capture
        ops.prepare_tma_views(self.weights, self._top_k)
        # likewise the NVFP4 W4A16 tile path's repacked weights, only where the tuned table has a
        # "w4a16" config for this layer's shape (or MOE_TRITON_W4A16=1): each layout a second copy
        # of the layer's 4-bit weights, so without an opt-in the memory is unchanged
        ops.prepare_w4a16_views(self.weights, self._top_k)

    def _config(self, n_tokens: int, top_k: int) -> dict:
        key = (n_tokens, top_k)
        cfg = self._configs.get(key)
        if cfg is None:
            pw = self.weights
            cfg = ops.get_config(pw.run_as, pw.num_experts, pw.hidden_size, pw.intermediate_size,
                                 top_k, n_tokens)
            _bounded_put(self._configs, key, cfg, CONFIG_CACHE_SIZE)
        return cfg

    def _masked_config(self, max_tokens: int) -> dict:
        cfg = self._masked_configs.get(max_tokens)
        if cfg is None:
            cfg = ops.masked_config(self.weights, max_tokens)
            _bounded_put(self._masked_configs, max_tokens, cfg, MASKED_CONFIG_CACHE_SIZE)
        return cfg

    def forward(self, d: Dispatched) -> torch.Tensor:
        if d.layout not in (F.TOKEN_MAJOR, F.MASKED):
            raise ValueError(f"the triton backend consumes token_major or masked, got {d.layout!r}")
        hidden_scale = None
        if d.payload == F.FP8:
            hidden_scale = d.hidden_scale
        elif d.payload != F.UNQUANTIZED:
            raise ValueError(f"the triton backend does not accept payload {d.payload!r}")
        if d.layout == F.MASKED:
            if d.masked_m is None:
                raise ValueError("a masked dispatch must carry masked_m (valid rows per expert)")
            return ops.fused_moe_masked(d.hidden, d.masked_m, self.weights,
                                        hidden_scale=hidden_scale, out_dtype=d.out_dtype,
                                        config=self._masked_config(int(d.hidden.shape[1])))
        ids = d.topk_ids
        top_k = ids.shape[1] if ids.dim() == 2 else 1
        cfg = self._config(int(d.hidden.shape[0]), top_k)
        return ops.fused_moe_prepared(d.hidden, ids, d.topk_weights, self.weights,
                                      hidden_scale=hidden_scale, out_dtype=d.out_dtype,
                                      config=cfg)


CONFIG_CACHE_SIZE = 64  # call shapes (token count, top-k) one backend remembers the config of
MASKED_CONFIG_CACHE_SIZE = 16  # masked batch heights likewise


def _bounded_put(cache: dict, key, value, size: int) -> None:
    """``cache[key] = value``, first dropping the oldest entry of a full ``cache``."""
    if len(cache) >= size:
        del cache[next(iter(cache))]
    cache[key] = value
