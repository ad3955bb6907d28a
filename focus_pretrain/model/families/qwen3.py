"""Qwen3: Llama's architecture with a per-head RMSNorm of queries and keys (one ``[head_dim]``
weight each)."""

from __future__ import annotations

from focus_pretrain.model.families.base import Family, register
from focus_pretrain.model.families.hf_config import qwen_slides
from focus_pretrain.model.families.keymap import llama_layer, per_head_qk_norms

QWEN3 = register(
    Family(
        name="qwen3",
        released="2025-04-29",
        layer_rules=(*llama_layer(), *per_head_qk_norms()),
        qk_norm="per_head",
        hf_slides=qwen_slides,
    )
)
