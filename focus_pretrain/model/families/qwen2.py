"""Qwen2: Llama's architecture with biases on Q, K and V."""

from __future__ import annotations

from focus_pretrain.model.families.base import Family, register
from focus_pretrain.model.families.hf_config import qwen_slides
from focus_pretrain.model.families.keymap import QKV_BIAS, llama_layer

QWEN2 = register(
    Family(
        name="qwen2",
        released="2024-06-06",
        layer_rules=(*llama_layer(), QKV_BIAS),
        qkv_bias=True,
        hf_slides=qwen_slides,
    )
)
