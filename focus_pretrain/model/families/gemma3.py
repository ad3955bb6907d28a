"""Gemma-3 (text-only, HF ``gemma3_text``): Gemma-2's layer with a per-head ``(1 + w)``
QK-norm, five local layers to one global by default, the local layers with their own unscaled
RoPE base (``rope_local_base_freq``), a final-logit soft-cap and no attention soft-cap
(transformers' Gemma-3 applies none, whatever its config says)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from focus_pretrain.model.families.base import Family, LocalLayers, register
from focus_pretrain.model.families.hf_config import (
    check_partial_rotary,
    decoder_fields,
    decoder_hf_fields,
    hf_query_pre_attn_scalar,
    layer_types_for,
    rope_scaling,
)
from focus_pretrain.model.families.keymap import (
    EMBEDDING,
    final_norm,
    per_head_qk_norms,
    sandwich_layer,
)

if TYPE_CHECKING:
    from focus_pretrain.model.config import ModelConfig

DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_MULTIMODAL = (
    "multimodal Gemma-3 (Gemma3ForConditionalGeneration: vision tower and "
    "language_model.* weights) is not supported; import a text-only Gemma-3 checkpoint "
    "(model_type gemma3_text, Gemma3ForCausalLM, e.g. google/gemma-3-1b-pt), or save its "
    "language model as a Gemma3ForCausalLM first"
)


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """Global (``full_attention``) and local (``sliding_attention``) RoPE: as in transformers,
    only the per-layer-type dicts of ``rope_parameters`` count."""
    nested = copy.deepcopy(hf.get("rope_parameters") or {})
    params = {layer: nested.get(layer) or {"rope_type": "default"} for layer in DEFAULT_THETA}
    if hf.get("rope_scaling"):
        params["full_attention"].update(hf["rope_scaling"])
    params["full_attention"].setdefault(
        "rope_theta", hf.get("rope_theta", DEFAULT_THETA["full_attention"])
    )
    params["sliding_attention"].setdefault(
        "rope_theta", hf.get("rope_local_base_freq", DEFAULT_THETA["sliding_attention"])
    )
    for rope in params.values():
        check_partial_rotary(hf, rope, "gemma3_text")
    local, full = params["sliding_attention"], params["full_attention"]
    positions = hf.get("max_position_embeddings")
    if rope_scaling(local, "gemma3_text rope_parameters.sliding_attention", positions):
        raise ValueError(
            f"gemma3_text with RoPE scaling on its sliding-window layers ({local}) is not "
            "supported (Gemma-3 scales only its global layers; ours does the same)"
        )
    return {
        "rotary_base": float(full["rope_theta"]),
        "rope_scaling": rope_scaling(full, "gemma3_text rope_parameters.full_attention", positions),
        "local_rotary_base": float(local["rope_theta"]),
    }


def _pattern(hf: dict[str, Any]) -> int:
    """``P``: every ``P``-th layer global, the others local (``layer_types`` must say so)."""
    layers = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern") or 6
    layer_types = hf.get("layer_types")
    if layer_types is None:
        return pattern
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    pattern = full[0] + 1 if full else max(pattern, layers + 1)
    if list(layer_types) != layer_types_for(layers, pattern):
        raise ValueError(
            f"gemma3_text layer_types {layer_types} are not {pattern - 1} sliding-window layers "
            "then one full-attention layer, repeated (the only Gemma-3 layout we build)"
        )
    return pattern


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` fields of a Gemma-3 ``config.json``: window, layer pattern, both RoPEs,
    final soft-cap, attention scale (``attn_logit_softcapping`` is not read: transformers'
    Gemma-3 attention ignores it, and the import follows what the HF model computes)."""
    fields = decoder_fields(hf, GEMMA3, rope=_rope)
    window = hf.get("sliding_window", 4096)
    if window is None:
        raise ValueError("gemma3_text with sliding_window=null is not supported")
    fields.update(
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        sliding_window=window,
        sliding_window_pattern=_pattern(hf),
        final_softcap=hf.get("final_logit_softcapping"),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
    )
    return fields


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """Gemma-3 ``config.json`` fields of ``config`` (RoPE per layer type)."""
    out = decoder_hf_fields(config)
    out["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": config.local_rope_base},
        "full_attention": out["rope_parameters"],
    }
    out.update(
        sliding_window=config.sliding_window,
        layer_types=layer_types_for(config.num_layers, config.local_global_pattern),
        attn_logit_softcapping=None,  # transformers' Gemma-3 applies none (ModelConfig too)
        final_logit_softcapping=config.final_softcap,
        query_pre_attn_scalar=hf_query_pre_attn_scalar(config),
        hidden_activation="gelu_pytorch_tanh",
    )
    return out


GEMMA3 = register(
    Family(
        name="gemma3",
        released="2025-03-12",
        hf_model_type="gemma3_text",  # Gemma3ForCausalLM (the text-only Gemma-3)
        hf_config_class="Gemma3TextConfig",
        layer_rules=(*sandwich_layer(), *per_head_qk_norms("plus_one")),
        top_rules=(EMBEDDING, final_norm("plus_one")),
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        post_norms=True,
        activation="gelu_tanh",
        qk_norm="per_head",
        tied_embeddings=True,
        scale_embeddings=True,
        local_layers=LocalLayers(default_pattern=6, own_rope=True),
        options=frozenset({"final_softcap", "query_pre_attn_scalar"}),
        refused={
            "attn_softcap": "transformers' Gemma-3 does not soft-cap attention logits (its "
            "config's attn_logit_softcapping is ignored), so such a model could not be exported "
            "or match an imported one; remove it (family gemma2 soft-caps attention logits)"
        },
        hf_activation_key="hidden_activation",
        hf_activations=("gelu_pytorch_tanh",),
        hf_refused_model_types={"gemma3": _MULTIMODAL},
    )
)
