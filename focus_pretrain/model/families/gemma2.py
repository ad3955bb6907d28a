"""Gemma-2: alternating sliding-window (local) and global layers, RMSNorms ``(1 + w)`` before
*and* after attention and MLP, GeGLU (tanh) MLP, attention- and final-logit soft-capping,
attention scale ``query_pre_attn_scalar ** -0.5``, embeddings scaled by ``sqrt(hidden)``, tied
embeddings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from focus_pretrain.model.families.base import Family, LocalLayers, register
from focus_pretrain.model.families.hf_config import (
    decoder_fields,
    decoder_hf_fields,
    hf_query_pre_attn_scalar,
)
from focus_pretrain.model.families.keymap import EMBEDDING, final_norm, sandwich_layer

if TYPE_CHECKING:
    from focus_pretrain.model.config import ModelConfig


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` fields of a Gemma-2 ``config.json`` (its ``layer_types``, when given,
    must be the alternating pattern)."""
    fields = decoder_fields(hf, GEMMA2)
    layer_types = hf.get("layer_types")
    alternating = [
        "sliding_attention" if i % 2 == 0 else "full_attention"
        for i in range(hf["num_hidden_layers"])
    ]
    if layer_types is not None and list(layer_types) != alternating:
        raise ValueError(
            f"gemma2 layer_types {layer_types} are not the alternating sliding/full pattern"
        )
    fields.update(
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        sliding_window=hf["sliding_window"],
        attn_softcap=hf.get("attn_logit_softcapping"),
        final_softcap=hf.get("final_logit_softcapping"),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
    )
    return fields


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """Gemma-2 ``config.json`` fields of ``config``."""
    return {
        **decoder_hf_fields(config),
        "sliding_window": config.sliding_window,
        "attn_logit_softcapping": config.attn_softcap,
        "final_logit_softcapping": config.final_softcap,
        "query_pre_attn_scalar": hf_query_pre_attn_scalar(config),
        "hidden_activation": "gelu_pytorch_tanh",
    }


GEMMA2 = register(
    Family(
        name="gemma2",
        released="2024-06-27",
        layer_rules=sandwich_layer(),
        top_rules=(EMBEDDING, final_norm("plus_one")),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        post_norms=True,
        activation="gelu_tanh",
        tied_embeddings=True,
        scale_embeddings=True,
        local_layers=LocalLayers(default_pattern=2, fixed=True),  # layers 1, 3, 5, ... local
        options=frozenset({"attn_softcap", "final_softcap", "query_pre_attn_scalar"}),
        hf_activation_key="hidden_activation",
        hf_activations=("gelu_pytorch_tanh",),
    )
)
