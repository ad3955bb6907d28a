"""The next-token loss of a micro-batch, under data and context parallelism."""

from __future__ import annotations

import torch
import torch.distributed as dist

from focus_pretrain.model.packing import document_params
from focus_pretrain.parallel.sharding import shard_batch


def batch_to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``batch`` on ``device``."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def micro_batch_loss(
    model, batch: dict[str, torch.Tensor], cp_group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss of a micro-batch: ``(for backward, mean over unmasked tokens)``.

    ``batch`` holds ``tokens``, ``position_ids``, ``labels``, ``loss_mask`` ``[b, s]``, and for
    packed documents ``documents`` (document starts) and/or ``rope_positions``
    (:class:`~focus_pretrain.data.documents.DocumentGPTDataset`). Under context parallelism
    each rank takes its shard of every sequence: the mean divides by the unmasked tokens of all
    shards, and the backward loss is scaled by the CP size because DeepSpeed averages gradients
    over data x context-parallel ranks.
    """
    seq_length = batch["tokens"].shape[1]
    if cp_group is not None:
        batch = shard_batch(batch, cp_group)
    per_token = model(
        batch["tokens"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        **packed_documents(batch, seq_length),
    )
    mask = batch["loss_mask"].float()  # [b, s_local]
    total, count = (per_token.float() * mask).sum(), mask.sum()
    if cp_group is None:
        mean = total / count.clamp(min=1)
        return mean, mean.detach()
    both = torch.stack([total.detach(), count])
    dist.all_reduce(both, group=cp_group)
    global_count = both[1].clamp(min=1)
    return total * dist.get_world_size(cp_group) / global_count, both[0] / global_count


def packed_documents(batch: dict[str, torch.Tensor], seq_length: int) -> dict:
    """``{"packed_seq_params": DocumentParams}`` for a batch with document fields, else ``{}``
    (``seq_length``: the global length, before any context-parallel sharding)."""
    params = document_params(batch.get("documents"), batch.get("rope_positions"), seq_length)
    return {} if params is None else {"packed_seq_params": params}


def group_mean(value: torch.Tensor, group: dist.ProcessGroup) -> float:
    """The mean of a scalar over the ranks of ``group``."""
    value = value.detach().float().clone()
    dist.all_reduce(value, group=group)
    return float(value) / dist.get_world_size(group)
