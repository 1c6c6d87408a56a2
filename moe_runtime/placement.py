"""Which experts live on which expert-parallel rank: the one placement rule.

A layer's ``num_experts`` experts are split into contiguous blocks, one per rank, in rank order;
when they do not divide evenly the first ``num_experts % ep_size`` ranks hold one more. Loading,
the backends' setups and the communication backends' routing tables all read this module.
"""

from __future__ import annotations


def local_experts(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The global ids of the experts rank ``ep_rank`` of ``ep_size`` holds."""
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"expert-parallel rank {ep_rank} of {ep_size} ranks does not exist")
    base, rem = divmod(num_experts, ep_size)
    first = ep_rank * base + min(ep_rank, rem)
    return range(first, first + base + (1 if ep_rank < rem else 0))


def owner_table(num_experts: int, ep_size: int, device=None):
    """``(owner [E], local_id [E])`` int64 tensors: each expert's rank and its id on that rank."""
    import torch

    owner = torch.empty(num_experts, dtype=torch.int64)
    local = torch.empty(num_experts, dtype=torch.int64)
    for rank in range(ep_size):
        ids = local_experts(num_experts, ep_size, rank)
        owner[ids.start:ids.stop] = rank
        local[ids.start:ids.stop] = torch.arange(len(ids))
    return owner.to(device), local.to(device)
