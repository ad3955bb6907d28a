"""Qwen3: Llama's architecture with a per-head RMSNorm of queries and keys (one ``[head_dim]``
weight each)."""

from __future__ import annotations

from typing import Any

from focus_pretrain.model.families.base import Family, register
from focus_pretrain.model.families.hf_config import decoder_fields, decoder_hf_fields, qwen_slides
from focus_pretrain.model.families.keymap import (
    EMBEDDING,
    final_norm,
    llama_layer,
    per_head_qk_norms,
)


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` fields of a Qwen3 ``config.json``."""
    return decoder_fields(hf, QWEN3)


QWEN3 = register(
    Family(
        name="qwen3",
        released="2025-04-29",
        hf_model_type="qwen3",
        hf_config_class="Qwen3Config",
        hf_model_class="Qwen3ForCausalLM",
        class_stem="Qwen3",
        layer_rules=(*llama_layer(), *per_head_qk_norms()),
        top_rules=(EMBEDDING, final_norm()),
        config_from_hf=config_from_hf,
        config_to_hf=decoder_hf_fields,
        qk_norm="per_head",
        hf_slides=qwen_slides,
    )
)
