"""The next-token loss of a micro-batch, under data and context parallelism."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from focus_pretrain.model.attention import dense_attention, removed_attention_mass_of
from focus_pretrain.model.packing import document_params
from focus_pretrain.parallel.sharding import shard_batch
from focus_pretrain.train.distill import per_token_objective


@dataclass(frozen=True)
class Objective:
    """What a training step minimises (``train.objective``, :mod:`focus_pretrain.train.distill`):
    ``lm`` (the next-token loss), ``distill`` (KL from the model's dense self, the frozen
    original of a retrofit), ``mix`` (``(1 - weight) * lm + weight * distill``) or
    ``attention_mass`` (per layer, the share of the frozen original's attention mass the
    pattern removes, :mod:`focus_pretrain.focus.attention_mass`)."""

    name: str = "lm"
    weight: float = 0.5
    temperature: float = 1.0

    @classmethod
    def from_config(cls, train) -> Objective:
        """The objective of a ``TrainConfig``."""
        return cls(train.objective, train.distill_weight, train.distill_temperature)


def batch_to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``batch`` on ``device``."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def micro_batch_loss(
    model,
    batch: dict[str, torch.Tensor],
    cp_group: dist.ProcessGroup | None = None,
    objective: Objective | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The objective (default: the next-token loss) of a micro-batch: ``(for backward, mean
    over unmasked tokens)``.

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
    if objective is not None and objective.name == "attention_mass":
        per_token = _removed_mass_per_token(model, batch, seq_length)
    elif objective is None or objective.name == "lm":
        per_token = model(
            batch["tokens"],
            batch["position_ids"],
            None,
            labels=batch["labels"],
            **packed_documents(batch, seq_length),
        )  # [b, s_local]
    else:
        per_token = _distillation_per_token(model, batch, seq_length, objective)
    mask = batch["loss_mask"].float()  # [b, s_local]
    total, count = (per_token.float() * mask).sum(), mask.sum()
    if cp_group is None:
        mean = total / count.clamp(min=1)
        return mean, mean.detach()
    both = torch.stack([total.detach(), count])
    dist.all_reduce(both, group=cp_group)
    global_count = both[1].clamp(min=1)
    return total * dist.get_world_size(cp_group) / global_count, both[0] / global_count


def _distillation_per_token(
    model, batch: dict[str, torch.Tensor], seq_length: int, objective: Objective
) -> torch.Tensor:
    """Per-token ``distill`` / ``mix`` objective ``[b, s_local]``: the teacher is ``model``
    itself with its Focus layers bypassed (:func:`dense_attention`), in ``eval()`` and without
    gradients; the student is ``model`` as it trains."""
    from megatron.core import parallel_state

    inputs = (batch["tokens"], batch["position_ids"], None)
    documents = packed_documents(batch, seq_length)
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), dense_attention(model):
            teacher = model(*inputs, **documents)  # [b, s_local, V / tp]
    finally:
        model.train(training)
    student = model(*inputs, **documents)  # [b, s_local, V / tp]
    group = None
    if parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_tensor_model_parallel_group()
    return per_token_objective(
        student,
        batch["labels"],
        teacher,
        objective=objective.name,
        weight=objective.weight,
        temperature=objective.temperature,
        group=group,
    )


def _removed_mass_per_token(model, batch: dict[str, torch.Tensor], seq_length: int) -> torch.Tensor:
    """Per-token ``attention_mass`` objective ``[b, s]``: the mean over Focus layers (and
    heads) of ``-log`` of the share of the frozen original's attention mass the layer's
    training pattern keeps (:func:`~focus_pretrain.model.attention.removed_attention_mass_of`).
    The model runs as the original dense model; only the routers are differentiated."""
    inputs = (batch["tokens"], batch["position_ids"], None)
    with removed_attention_mass_of(model) as removed:
        model(*inputs, **packed_documents(batch, seq_length))  # [b, s, V / tp], unused
    if not removed:
        raise ValueError(
            "train.objective=attention_mass needs Focus layers with routers; this model has none"
        )
    return torch.stack(removed).mean(dim=0)  # [layers, b, s] -> [b, s]


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
