"""``parallel.deepspeed``: DeepSpeed settings passed through to its config, merged over the one
the trainer generates (:func:`focus_pretrain.train.optim.deepspeed_config`).

Anything DeepSpeed's config accepts can go there: its monitors (``csv_monitor``, ``wandb``,
``tensorboard``, ``comet``), the ``flops_profiler``, the ``comms_logger``, ZeRO's bucket and
overlap settings (``zero_optimization.reduce_bucket_size`` ...), fp16 loss-scaling knobs,
activation-checkpointing options. Mappings merge key by key; any other value replaces.

Keys the recipe owns are refused with the key to use instead (:data:`OWNED`): batch sizes,
gradient accumulation and clipping, the ZeRO stage and optimizer offload, the precision,
the optimizer and schedule (the trainer builds AdamW and steps the learning rate itself), and
universal checkpoint loading (resharding decides it per resume).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

OWNED = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": (
        "train.global_batch_size (divided by train.micro_batch_size x the data-parallel size)"
    ),
    "gradient_clipping": "train.clip_grad",
    "zero_optimization.stage": "parallel.zero_stage",
    "zero_optimization.offload_optimizer.device": "parallel.cpu_offload",
    "bf16.enabled": "train.precision",
    "fp16.enabled": "train.precision",
    "amp.enabled": "train.precision",
    "optimizer": "train.lr, train.betas, train.eps and train.weight_decay (AdamW)",
    "scheduler": "train.schedule, train.warmup_steps and train.min_lr",
    "checkpoint.load_universal": "train.load_universal (launcher flag --universal-checkpoint)",
}


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{path}.")
        else:
            yield path, value


def check_deepspeed_overrides(overrides: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first key of ``overrides`` the recipe owns (and the
    recipe key to set instead): a key equal to an owned one, inside an owned section
    (``optimizer.params.lr``), or a value that would replace a section holding one
    (``bf16: true``)."""
    if not isinstance(overrides, Mapping):
        raise ValueError(f"parallel.deepspeed must be a mapping, got {overrides!r}")
    for path, _ in _leaves(overrides):
        for owned, ours in OWNED.items():
            if path == owned or path.startswith(f"{owned}.") or owned.startswith(f"{path}."):
                raise ValueError(
                    f"parallel.deepspeed.{path} is set by the recipe: use {ours} instead "
                    "(parallel.deepspeed passes through only what the recipe does not own)"
                )


def merge_deepspeed_config(generated: dict[str, Any], overrides: Mapping[str, Any]) -> dict:
    """``generated`` with ``overrides`` merged over it (mappings recursively, other values
    replaced); neither input is modified."""
    merged = copy.deepcopy(generated)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = merge_deepspeed_config(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged
