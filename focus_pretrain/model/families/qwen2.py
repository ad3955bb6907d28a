"""Qwen2: Llama's architecture with biases on Q, K and V."""

from __future__ import annotations

from typing import Any

from focus_pretrain.model.families.base import Family, register
from focus_pretrain.model.families.hf_config import decoder_fields, decoder_hf_fields, qwen_slides
from focus_pretrain.model.families.keymap import EMBEDDING, QKV_BIAS, final_norm, llama_layer


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` fields of a Qwen2 ``config.json``."""
    return decoder_fields(hf, QWEN2)


QWEN2 = register(
    Family(
        name="qwen2",
        released="2024-06-06",
        hf_model_type="qwen2",
        hf_config_class="Qwen2Config",
        hf_model_class="Qwen2ForCausalLM",
        class_stem="Qwen2",
        layer_rules=(*llama_layer(), QKV_BIAS),
        top_rules=(EMBEDDING, final_norm()),
        config_from_hf=config_from_hf,
        config_to_hf=decoder_hf_fields,
        qkv_bias=True,
        hf_slides=qwen_slides,
    )
)
