"""OLMo-2: RMSNorm *after* attention and MLP (no pre-norms), an RMSNorm over the whole query
(key) projection, all heads together."""

from __future__ import annotations

from focus_pretrain.model.families.base import Family, register
from focus_pretrain.model.families.keymap import (
    ATTENTION,
    COLUMN,
    GATED_MLP,
    HF,
    OURS,
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


OLMO2 = register(
    Family(
        name="olmo2",
        released="2024-11-26",
        layer_rules=LAYER,
        pre_norms=False,
        post_norms=True,
        qk_norm="full_width",
    )
)
