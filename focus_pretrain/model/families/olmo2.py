"""OLMo-2: RMSNorm *after* attention and MLP (no pre-norms), an RMSNorm over the whole query
(key) projection, all heads together."""

from __future__ import annotations

from typing import Any

from focus_pretrain.model.families.base import Family, register
from focus_pretrain.model.families.hf_config import decoder_fields, decoder_hf_fields
from focus_pretrain.model.families.keymap import (
    ATTENTION,
    COLUMN,
    EMBEDDING,
    GATED_MLP,
    HF,
    OURS,
    final_norm,
    rule,
)

LAYER = (
    *ATTENTION,
    rule(f"{OURS}self_attention.q_layernorm.weight", f"{HF}self_attn.q_norm.weight", shard=COLUMN),
    rule(f"{OURS}self_attention.k_layernorm.weight", f"{HF}self_attn.k_norm.weight", shard=COLUMN),
    rule(f"{OURS}self_attention.post_norm.weight", f"{HF}post_attention_layernorm.weight"),
    *GATED_MLP,
    rule(f"{OURS}mlp.post_norm.weight", f"{HF}post_feedforward_layernorm.weight"),
)


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` fields of an OLMo-2 ``config.json``."""
    return decoder_fields(hf, OLMO2)


OLMO2 = register(
    Family(
        name="olmo2",
        released="2024-11-26",
        hf_model_type="olmo2",
        hf_config_class="Olmo2Config",
        hf_model_class="Olmo2ForCausalLM",
        class_stem="Olmo2",
        layer_rules=LAYER,
        top_rules=(EMBEDDING, final_norm()),
        config_from_hf=config_from_hf,
        config_to_hf=decoder_hf_fields,
        pre_norms=False,
        post_norms=True,
        qk_norm="full_width",
    )
)
