"""A checkpoint's Megatron state at any tensor-parallel size (for evaluation and analysis).

A run saved at ``parallel.tensor_parallel_size = T`` holds one state dict per tensor-parallel
rank. :func:`megatron_state_dict` merges them with the declarative rules of
:mod:`focus_pretrain.convert.families` (the same key map the HuggingFace export uses) and cuts
the full tensors again for the rank that loads them, so a TP=2 run can be evaluated in one
process and a TP=1 run under TP=2.
"""

from __future__ import annotations

import os

from torch import Tensor

from focus_pretrain.config import Config, load_config
from focus_pretrain.convert.families import rules_for, shard, unshard
from focus_pretrain.convert.hf_export import _load_shards, resolve_checkpoint


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
    config = load_config(ckpt / "config.yaml", [])
    saved_tp = config.parallel.tensor_parallel_size
    shards = _load_shards(ckpt, saved_tp, config.parallel.zero_stage)
    model = config.model
    if tp_size == saved_tp:
        return dict(shards[tp_rank]), config
    model.check_tensor_parallel(tp_size)
    state = dict(shards[0])
    for rule in rules_for(model.family, model.num_layers, model.tied):
        if rule.ours not in shards[0]:
            raise ValueError(f"the checkpoint {ckpt} lacks {rule.ours}")
        full = unshard([s[rule.ours] for s in shards], rule.shard)
        state[rule.ours] = shard(full, rule.shard, tp_rank, tp_size)
    return state, config
