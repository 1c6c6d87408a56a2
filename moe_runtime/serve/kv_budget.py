"""How many tokens the server's KV cache holds, from the options and the model's config.

One of three, in this order:

1. ``--kv-cache-tokens N``: N tokens;
2. ``--gpu-memory-utilization F``: the fraction F of the device's memory (a CUDA device's total
   memory; on the CPU, the machine's physical memory) that this server may hold in all, weights
   included: the cache gets ``F * total`` minus what the process holds once the model is loaded,
   divided by the bytes one token costs (every full-attention layer's keys and values at the
   model's dtype);
3. neither: room for ``--max-num-seqs`` sequences of the full context (``--max-model-len``).

The cache is never made larger than (3): at most ``--max-num-seqs`` sequences run at once, so
more tokens could not be used; a budget cut to it says so.

A budget that cannot hold one sequence of the full context is refused at start, naming both, and
so is one of (1) or (3) larger than the memory free once the model is loaded (the device's free
memory, or the machine's available memory on the CPU): it failed inside transformers with a bare
MemoryError, or ran out of memory at the first long requests. (``serve`` refuses such options
before loading too, from the checkpoint check's estimate.)
"""

from __future__ import annotations

import math
import os

import attrs


class BudgetError(ValueError):
    """The KV cache cannot hold what the options ask; the message says which option to change."""


@attrs.frozen
class KVBudget:
    """The cache's size in tokens, what one token costs, and a sentence saying where it came from."""

    tokens: int
    bytes_per_token: int
    source: str

    def describe(self) -> str:
        gib = self.tokens * self.bytes_per_token / 2**30
        return f"{self.tokens} tokens ({gib:.3g} GiB, {self.bytes_per_token} bytes/token): {self.source}"


def bytes_per_token(config, dtype_bytes: int) -> int:
    """Bytes of keys and values that one token writes into every attention layer's cache."""
    from moe_runtime.checkpoint.architectures import architecture_of

    data = config.to_dict()
    arch = architecture_of(data, "config.json")
    cache = arch.attention_cache(data, "config.json")
    fields = data.get("text_config") or data if arch.text_config else data
    layers = int(fields.get("num_hidden_layers") or 1)
    per_layer = cache.kv_heads * (cache.key_head_size + cache.value_head_size) * dtype_bytes
    return max(1, layers * per_layer)


def _memory(device: str) -> tuple[int, int]:
    """(total bytes of the device, bytes this process holds on it now)."""
    import torch

    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        _, total = torch.cuda.mem_get_info(index)
        return total, torch.cuda.memory_reserved(index)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total, rss


def kv_budget(*, config, dtype_bytes: int, device: str, context_length: int, max_num_seqs: int,
              kv_cache_tokens: int | None = None,
              gpu_memory_utilization: float | None = None,
              allocated_up_front: bool = True) -> KVBudget:
    """The KV budget for the options (see the module's order); raises :class:`BudgetError`.
    ``allocated_up_front``: the cache is allocated at start (the paged cache of continuous
    batching), so it must fit the free memory; the dynamic cache grows with its requests and
    the budget only bounds admission."""
    per_token = bytes_per_token(config, dtype_bytes)
    if kv_cache_tokens is not None:
        budget = KVBudget(kv_cache_tokens, per_token, "--kv-cache-tokens")
    elif gpu_memory_utilization is not None:
        total, held = _memory(device)
        room = int(gpu_memory_utilization * total) - held
        where = "the CUDA device's" if device.startswith("cuda") else "this machine's physical"
        source = (f"--gpu-memory-utilization {gpu_memory_utilization} of {where} memory "
                  f"({total / 2**30:.3g} GiB), less the {held / 2**30:.3g} GiB the loaded model "
                  "and process hold")
        if room < per_token * context_length:
            raise BudgetError(
                f"--gpu-memory-utilization {gpu_memory_utilization} leaves "
                f"{max(room, 0) / 2**30:.3g} GiB for the KV cache ({where} memory is "
                f"{total / 2**30:.3g} GiB, {held / 2**30:.3g} GiB already held), fewer than the "
                f"{per_token * context_length / 2**30:.3g} GiB one sequence of {context_length} "
                "tokens needs: raise --gpu-memory-utilization or lower --max-model-len")
        budget = KVBudget(room // per_token, per_token, source)
    else:
        budget = None
    most = max_num_seqs * context_length
    full = f"--max-num-seqs {max_num_seqs} sequences of {context_length} tokens"
    if budget is None:
        budget = KVBudget(most, per_token, full)
    elif budget.tokens > most:
        budget = KVBudget(most, per_token, f"{budget.source}, cut to the {full} that can run at "
                                           "once")
    if budget.tokens < context_length:
        raise BudgetError(f"the KV cache of {budget.tokens} tokens ({budget.source}) cannot hold "
                          f"one sequence of the full context, {context_length} tokens: raise "
                          "--kv-cache-tokens or lower --max-model-len")
    if gpu_memory_utilization is None and allocated_up_front:  # sized from the options alone
        free = _free(device)
        need = budget.tokens * per_token
        if free is not None and need > free:
            where = "the CUDA device" if device.startswith("cuda") else "this machine"
            raise BudgetError(
                f"the KV cache of {budget.tokens} tokens ({budget.source}) needs "
                f"{need / 2**30:.3g} GiB, and {where} has {free / 2**30:.3g} GiB free once the "
                "model is loaded: lower --max-num-seqs or --max-model-len, or size the cache "
                "from memory with --gpu-memory-utilization (or --kv-cache-tokens)")
    return budget


def _free(device: str) -> int | None:
    """Bytes free for the cache now: the CUDA device's free memory, or the machine's available
    memory (``MemAvailable``); None where it cannot be read."""
    try:
        if device.startswith("cuda"):
            import torch

            index = torch.device(device).index or 0
            free, _ = torch.cuda.mem_get_info(index)
            # what torch's allocator holds but does not use is free to the cache too
            return int(free + torch.cuda.memory_reserved(index)
                       - torch.cuda.memory_allocated(index))
        from moe_runtime.checkpoint.memory import MachineMemory

        return MachineMemory.probe("cpu").available_bytes  # MemAvailable, capped by a cgroup
    except (OSError, RuntimeError, ValueError, AttributeError):
        return None


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)
