"""HuggingFace <-> megatron-core key maps as the converters use them, and tensor-parallel cuts.

Each family's rules are part of its description (:mod:`focus_pretrain.model.families`; the rule
type and its transforms: :mod:`focus_pretrain.model.families.keymap`). Here: the rules of a
model by HF ``model_type`` or family name (:func:`rules_for`) and how a full tensor is cut over
tensor-parallel ranks and merged back (:func:`shard`, :func:`unshard`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from focus_pretrain.model.families import hf_family, hf_model_types
from focus_pretrain.model.families.keymap import COLUMN, GLU, REPLICATED, ROW, Geometry, Rule

__all__ = [
    "COLUMN",
    "GLU",
    "REPLICATED",
    "ROW",
    "Geometry",
    "Rule",
    "rules_for",
    "shard",
    "unshard",
]


def rules_for(model_type: str, num_layers: int, tied: bool) -> list[Rule]:
    """Every rule of a model (``model_type``: HF's or our family name), layer placeholders
    expanded (``lm_head`` only when untied)."""
    description = hf_family(model_type)
    if description is None:
        raise ValueError(
            f"unsupported HuggingFace architecture model_type={model_type!r}; supported: "
            f"{', '.join(hf_model_types())}"
        )
    return description.rules(num_layers, tied)


def shard(tensor: Tensor, kind: str, rank: int, size: int) -> Tensor:
    """This tensor-parallel rank's slice of a full tensor."""
    if size == 1 or kind == REPLICATED:
        return tensor
    if kind == COLUMN:
        return tensor.chunk(size, dim=0)[rank].contiguous()
    if kind == ROW:
        return tensor.chunk(size, dim=1)[rank].contiguous()
    if kind == GLU:
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]]).contiguous()
    raise ValueError(f"unknown shard kind {kind!r}")


def unshard(shards: list[Tensor], kind: str) -> Tensor:
    """The full tensor from its tensor-parallel ranks' slices, in rank order (inverse of
    :func:`shard`; a replicated tensor is rank 0's)."""
    if len(shards) == 1 or kind not in (COLUMN, ROW, GLU):
        return shards[0]
    if kind == COLUMN:
        return torch.cat(shards, dim=0)
    if kind == ROW:
        return torch.cat(shards, dim=1)
    halves = [s.chunk(2, dim=0) for s in shards]  # GLU: per rank [gate_r; up_r]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
