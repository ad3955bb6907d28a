"""Llama (and Llama-3.x RoPE scaling): RoPE, pre-RMSNorm, SwiGLU MLP, no biases, GQA."""

from __future__ import annotations

from typing import Any

from focus_pretrain.model.families.base import Family, register
from focus_pretrain.model.families.hf_config import decoder_fields, decoder_hf_fields
from focus_pretrain.model.families.keymap import EMBEDDING, final_norm, llama_layer


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` fields of a Llama ``config.json`` (its sliding-window keys are unused
    by transformers' Llama, whatever they say)."""
    return decoder_fields(hf, LLAMA)


LLAMA = register(
    Family(
        name="llama",
        released="2023-02-24",
        hf_model_type="llama",
        hf_config_class="LlamaConfig",
        hf_model_class="LlamaForCausalLM",
        class_stem="Llama",
        layer_rules=llama_layer(),
        top_rules=(EMBEDDING, final_norm()),
        config_from_hf=config_from_hf,
        config_to_hf=decoder_hf_fields,
    )
)
