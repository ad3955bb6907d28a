"""Training checkpoints, read by everyone who reads them: find one (``latest``, a run or
checkpoints directory), verify it against its manifest, read its recipe and its tensors at any
tensor-parallel size, tell its parallel layout, build its model.

Below ``train/`` (which writes checkpoints, resumes and reshards them) and ``convert/`` (which
exports them): both read through here, and so do evaluation and analysis, without ``train/``.
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
