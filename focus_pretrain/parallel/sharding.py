"""Splitting sequences over context-parallel ranks (Megatron's zigzag convention).

The global sequence of ``S`` tokens is cut into ``2 * CP`` equal chunks and rank ``r`` holds
chunks ``r`` and ``2 * CP - 1 - r``, so causal attention costs every rank the same and
megatron-core's RoPE slicing (``get_pos_emb_on_this_cp_rank``) agrees with our shards. A rank
knows the global position of each of its tokens (:func:`zigzag_positions`); Focus's window and
causal test use them. Used by the context-parallel attention (all-to-all and ring), the trainer
(batches) and evaluation (logits gathered back).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> Tensor:
    """Global positions ``[seq_len / cp_size]`` of rank ``cp_rank``'s tokens (chunks r, 2c-1-r)."""
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    second = torch.arange(second_start, second_start + chunk, device=device)
    return torch.cat([first, second])


def shard_sequence(x: Tensor, dim: int, cp_size: int, cp_rank: int) -> Tensor:
    """This rank's tokens of a full-sequence tensor (``x.shape[dim]`` is the global length)."""
    positions = zigzag_positions(x.shape[dim], cp_size, cp_rank, device=x.device)
    return x.index_select(dim, positions)


def gather_sequence(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """All ranks' shards (no gradient) back in global order along ``dim``."""
    cp_size = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(cp_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    _, to_global = rank_major_orders(x.shape[dim] * cp_size, cp_size, x.device)
    return torch.cat(parts, dim=dim).index_select(dim, to_global)


@functools.lru_cache(maxsize=16)
def rank_major_orders(total: int, cp_size: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(order, to_global)`` ``[total]``: the global position of each token of the rank-major
    concatenation of all shards, and the permutation that puts that concatenation in global
    order. Cached: every a2a layer call of a run uses the same two."""
    order = torch.cat([zigzag_positions(total, cp_size, r, device) for r in range(cp_size)])
    return order, torch.argsort(order)


def shard_batch(batch: dict[str, Tensor], group: dist.ProcessGroup) -> dict[str, Tensor]:
    """This rank's zigzag shard of every ``[b, s, ...]`` tensor of a batch (tokens, labels,
    loss mask, position ids: global positions survive the sharding)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return {key: shard_sequence(value, 1, size, rank) for key, value in batch.items()}
