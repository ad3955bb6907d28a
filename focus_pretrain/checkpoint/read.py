"""Reading a training checkpoint: where it is, the recipe it was trained with, its tensors.

One module for every reader (the trainer's resume, the HuggingFace export, evaluation,
analysis, resharding):

* :func:`latest_checkpoint`: the ``step_N`` directory ``latest`` names under a checkpoints
  root, or ``None`` for a fresh run;

* :func:`resolve_checkpoint`: a run directory, its ``checkpoints`` directory or a ``step_N``
  directory -> the ``step_N`` directory (the one ``latest`` names);
* :func:`checkpoint_config`: the resolved recipe saved with it (``config.yaml``), validated;
* :func:`load_tp_shards`: one Megatron state dict per saved tensor-parallel rank (DeepSpeed's
  ``mp_rank_XX_model_states.pt``; ZeRO-3 partitions consolidated with DeepSpeed's
  ``zero_to_fp32``);
* :func:`megatron_state_dict`: the state at any tensor-parallel size, merged over the saved
  ranks and cut again with the declarative rules of :mod:`focus_pretrain.model.tp_rules` (the
  same key map the HuggingFace export uses), so a TP=2 run can be evaluated in one process and
  a TP=1 run under TP=2.

(DeepSpeed's universal checkpoints, for resuming at another layout, are written and read by
:mod:`focus_pretrain.checkpoint.reshard`.)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from focus_pretrain.config import Config, load_config
from focus_pretrain.errors import InputError, MissingInputError
from focus_pretrain.model.tp_rules import rules_for, shard, unshard
from focus_pretrain.storage.checkpoint_files import (
    LATEST,
    damaged_checkpoint_error,
    read_latest,
    step_folders,
    verify_checkpoint,
)
from focus_pretrain.storage.safe_load import load_checkpoint_file, weights_only_loading

__all__ = [
    "checkpoint_config",
    "fp32_master_weights",
    "latest_checkpoint",
    "load_tp_shards",
    "megatron_state_dict",
    "resolve_checkpoint",
    "trained_tp_shards",
]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint directory ``latest`` names under ``root``, validated
    (:func:`~focus_pretrain.storage.checkpoint_files.read_latest`), or ``None`` for a fresh run."""
    tag = read_latest(Path(root))
    return None if tag is None else Path(root) / tag


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory (``.../checkpoints/step_N``) from it, a run directory or its
    ``checkpoints`` directory (the checkpoint ``latest`` names, validated), checked against its
    manifest: every file's size, and the CRC-32 of the model files a reader loads.

    Raises:
        MissingInputError: nothing at ``path`` is a checkpoint.
        InputError: ``latest`` is missing, empty or dangling beside step folders, or the
            checkpoint is truncated or corrupt (naming the file and the previous whole one).
    """
    path = Path(path)
    for root in (path / "checkpoints", path):
        if (root / LATEST).exists() or step_folders(root):
            tag = read_latest(root)
            return _verified(root, tag)
    if (path / "config.yaml").is_file() and any(path.glob("*mp_rank_*_model_states.pt")):
        return _verified(path.parent, path.name)
    raise MissingInputError(
        f"{path} is neither a checkpoint (config.yaml + mp_rank_*_model_states.pt) nor a run "
        "directory whose checkpoints/latest names one"
    )


def _verified(root: Path, tag: str) -> Path:
    """``root / tag`` after checking it against its manifest (:func:`resolve_checkpoint`)."""
    problems = verify_checkpoint(root / tag, checksum_patterns=["*model_states.pt"])
    if problems:
        raise damaged_checkpoint_error(root, tag, problems)
    return root / tag


def checkpoint_config(ckpt: Path, overrides: Sequence[str] = ()) -> Config:
    """The recipe ``ckpt`` (a ``step_N`` directory) was trained with, with ``overrides``."""
    return load_config(ckpt / "config.yaml", list(overrides))


def load_tp_shards(ckpt: Path, tp: int, zero_stage: int) -> list[dict[str, Tensor]]:
    """The model state dict of each of the ``tp`` tensor-parallel ranks of ``ckpt`` (a ZeRO-3
    checkpoint is consolidated per rank first, in fp32).

    Raises:
        MissingInputError: a rank's file is missing.
    """
    if zero_stage == 3:
        return [_consolidate_zero3(ckpt, rank) for rank in range(tp)]
    shards = []
    for rank in range(tp):
        path = ckpt / f"mp_rank_{rank:02d}_model_states.pt"
        if not path.is_file():
            raise MissingInputError(f"{path} is missing (tensor-parallel rank {rank} of {tp})")
        shards.append(load_checkpoint_file(path)["module"])
    return shards


def trained_tp_shards(ckpt: Path, config: Config) -> list[dict[str, Tensor]]:
    """:func:`load_tp_shards` with the trained parameters at the precision they were trained
    in: a bf16/fp16 run's module holds half-precision copies, while the optimizer updated fp32
    master weights (ZeRO-1/2 files; ZeRO-3 is consolidated in fp32 already). An export takes
    these, not the rounded copies."""
    tp, zero_stage = config.parallel.tensor_parallel_size, config.parallel.zero_stage
    shards = load_tp_shards(ckpt, tp, zero_stage)
    if config.train.precision == "fp32" or zero_stage == 3:
        return shards
    for rank, shard_state in enumerate(shards):
        masters = fp32_master_weights(ckpt, rank)
        shard_state.update({k: v for k, v in masters.items() if k in shard_state})
    return shards


def fp32_master_weights(ckpt: Path, tp_rank: int) -> dict[str, Tensor]:
    """The optimizer's fp32 master copy of tensor-parallel rank ``tp_rank``'s trainable
    parameters (gathered over the data-parallel partitions of a ZeRO-1/2 checkpoint), by our
    names; ``{}`` when the checkpoint holds no optimizer files. DeepSpeed's consolidation reads
    every ``*_states.pt`` of a directory, so the rank's files are linked, as ``mp_rank_00``,
    into a scratch directory first."""
    import contextlib
    import io
    import tempfile

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    suffix = f"mp_rank_{tp_rank:02d}_"
    optim = sorted(ckpt.glob(f"*zero_pp_rank_*_{suffix}optim_states.pt"))
    model = ckpt / f"{suffix}model_states.pt"
    if not optim or not model.is_file():
        return {}
    quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
    with tempfile.TemporaryDirectory() as scratch, quiet[0], quiet[1]:
        tag = Path(scratch) / ckpt.name
        tag.mkdir()
        for path in [*optim, model]:
            (tag / path.name.replace(suffix, "mp_rank_00_")).symlink_to(path.resolve())
        with weights_only_loading(ckpt):
            state = get_fp32_state_dict_from_zero_checkpoint(
                scratch, tag=ckpt.name, exclude_frozen_parameters=True
            )
    return {k: v.detach().float() for k, v in state.items() if torch.is_tensor(v)}


def _consolidate_zero3(ckpt: Path, tp_rank: int) -> dict[str, Tensor]:
    """One tensor-parallel rank's full (data-parallel-gathered) fp32 state from a ZeRO-3
    checkpoint. DeepSpeed's consolidation reads every ``*_states.pt`` of a directory, so the
    rank's files are linked, as ``mp_rank_00``, into a scratch directory first."""
    import tempfile

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    suffix = f"mp_rank_{tp_rank:02d}_"
    files = sorted(ckpt.glob(f"zero_pp_rank_*_{suffix}*_states.pt"))
    if not files:
        raise MissingInputError(f"{ckpt} has no ZeRO-3 files of tensor-parallel rank {tp_rank}")
    with tempfile.TemporaryDirectory() as scratch:
        tag = Path(scratch) / ckpt.name
        tag.mkdir()
        for path in files:
            (tag / path.name.replace(suffix, "mp_rank_00_")).symlink_to(path.resolve())
        with weights_only_loading(ckpt):
            state = dict(get_fp32_state_dict_from_zero_checkpoint(scratch, tag=ckpt.name))
    first = ckpt / f"zero_pp_rank_0_{suffix}model_states.pt"
    module = load_checkpoint_file(first)["module"] or {}
    for key, value in module.items():  # buffers (router balance offsets) are not partitioned
        if key not in state and torch.is_tensor(value) and value.numel() > 0:
            state[key] = value
    return state


def megatron_state_dict(
    checkpoint: str | os.PathLike, tp_size: int = 1, tp_rank: int = 0
) -> tuple[dict[str, Tensor], Config]:
    """Tensor-parallel rank ``tp_rank`` of ``tp_size``'s Megatron state of ``checkpoint``
    (a checkpoint or run directory), and the config the checkpoint was trained with.

    Tensors a rule names are merged over the saved ranks and re-sharded; every other entry
    (routers, their balance offsets, replicated norms, Transformer Engine's extra states) is
    taken from saved rank 0. ZeRO-3 checkpoints are consolidated first (fp32).

    Raises:
        FileNotFoundError: no checkpoint at ``checkpoint``, or one of its shards is missing.
        ValueError: the checkpoint lacks a tensor its family needs.
    """
    ckpt = resolve_checkpoint(checkpoint)
    config = checkpoint_config(ckpt)
    saved_tp = config.parallel.tensor_parallel_size
    shards = load_tp_shards(ckpt, saved_tp, config.parallel.zero_stage)
    model = config.model
    if tp_size == saved_tp:
        return dict(shards[tp_rank]), config
    model.check_tensor_parallel(tp_size)
    state = dict(shards[0])
    for rule in rules_for(model.family, model.num_layers, model.tied):
        if rule.ours not in shards[0]:
            raise InputError(f"the checkpoint {ckpt} lacks {rule.ours}")
        full = unshard([s[rule.ours] for s in shards], rule.shard)
        state[rule.ours] = shard(full, rule.shard, tp_rank, tp_size)
    return state, config
