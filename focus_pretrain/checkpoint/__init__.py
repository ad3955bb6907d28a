"""Training checkpoints in one package: save one durably (:mod:`.save`: the trainer's
``Checkpointer``, an atomic ``latest``, manifests), find one (``latest``, a run or checkpoints
directory), verify it against its manifest, read its recipe and its tensors at any
tensor-parallel size (:mod:`.read`), tell its parallel layout and whether a resume reshards
(:mod:`.layout`), reshard it through DeepSpeed's universal checkpoint (:mod:`.reshard`), build
its model (:mod:`.model`).

Below ``train/`` (which drives saving and resuming) and ``convert/`` (which exports): both go
through here, and so do evaluation and analysis, without ``train/``.
The file-level conventions (step folders, the ``latest`` pointer, manifests, durable writes)
are :mod:`focus_pretrain.storage.checkpoint_files`.
"""

from focus_pretrain.checkpoint.layout import check_layout, run_layout, saved_layout
from focus_pretrain.checkpoint.read import (
    checkpoint_config,
    latest_checkpoint,
    load_tp_shards,
    megatron_state_dict,
    resolve_checkpoint,
)

__all__ = [
    "check_layout",
    "checkpoint_config",
    "latest_checkpoint",
    "load_tp_shards",
    "megatron_state_dict",
    "resolve_checkpoint",
    "run_layout",
    "saved_layout",
]
