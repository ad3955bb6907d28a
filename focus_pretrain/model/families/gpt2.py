"""GPT-2: learned absolute positions, pre-LayerNorm, GELU (tanh) MLP, biases on every linear,
multi-head attention, tied embeddings. HF ``GPT2LMHeadModel`` (``Conv1D`` weights ``[in, out]``,
fused ``c_attn``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from focus_pretrain.model.families.base import Family, register
from focus_pretrain.model.families.keymap import COLUMN, ROW, rule

if TYPE_CHECKING:
    from focus_pretrain.model.config import ModelConfig

_L, _H, _T = "decoder.layers.{i}.", "transformer.h.{i}.", "transpose"
LAYER = (
    rule(f"{_L}input_layernorm.weight", f"{_H}ln_1.weight"),
    rule(f"{_L}input_layernorm.bias", f"{_H}ln_1.bias"),
    rule(f"{_L}self_attention.linear_qkv.weight", f"{_H}attn.c_attn.weight", "gpt2_qkv", COLUMN),
    rule(f"{_L}self_attention.linear_qkv.bias", f"{_H}attn.c_attn.bias", "gpt2_qkv", COLUMN),
    rule(f"{_L}self_attention.linear_proj.weight", f"{_H}attn.c_proj.weight", _T, ROW),
    rule(f"{_L}self_attention.linear_proj.bias", f"{_H}attn.c_proj.bias"),
    rule(f"{_L}pre_mlp_layernorm.weight", f"{_H}ln_2.weight"),
    rule(f"{_L}pre_mlp_layernorm.bias", f"{_H}ln_2.bias"),
    rule(f"{_L}mlp.linear_fc1.weight", f"{_H}mlp.c_fc.weight", _T, COLUMN),
    rule(f"{_L}mlp.linear_fc1.bias", f"{_H}mlp.c_fc.bias", shard=COLUMN),
    rule(f"{_L}mlp.linear_fc2.weight", f"{_H}mlp.c_proj.weight", _T, ROW),
    rule(f"{_L}mlp.linear_fc2.bias", f"{_H}mlp.c_proj.bias"),
)
TOP = (
    rule("embedding.word_embeddings.weight", "transformer.wte.weight", shard=COLUMN),
    rule("embedding.position_embeddings.weight", "transformer.wpe.weight"),
    rule("decoder.final_layernorm.weight", "transformer.ln_f.weight"),
    rule("decoder.final_layernorm.bias", "transformer.ln_f.bias"),
)
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")

# attention-scale flags: (value that changes the scores, what it does). Our attention divides
# every layer's scores by sqrt(head_dim), i.e. HF's defaults. ``reorder_and_upcast_attn`` only
# computes the same scores in fp32, so it is accepted.
_SCALE_FLAGS = {
    "scale_attn_by_inverse_layer_idx": (
        True,
        "divides layer i's attention scores by a further i + 1 (as in Stanford CRFM's GPT-2 runs)",
    ),
    "scale_attn_weights": (False, "leaves the attention scores unscaled (no 1/sqrt(head_dim))"),
}


def _check_attention_scale(hf: dict[str, Any]) -> None:
    """Refuse GPT-2 checkpoints whose softmax scale differs from 1/sqrt(head_dim)."""
    for flag, (odd, effect) in _SCALE_FLAGS.items():
        if hf.get(flag, not odd) == odd:
            raise ValueError(
                f"GPT-2 with {flag}={str(odd).lower()} is not supported: it {effect}, while our "
                "attention scales every layer by 1/sqrt(head_dim), so the imported model's logits "
                f"would differ. Editing {flag} in config.json does not help (the weights were "
                "trained with that scale); import a GPT-2 checkpoint with the default "
                "scale_attn_weights=true and scale_attn_by_inverse_layer_idx=false"
            )


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` fields of a GPT-2 ``config.json``."""
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise ValueError(f"GPT-2 activation_function={activation!r} is not supported")
    _check_attention_scale(hf)
    return {
        "family": "gpt2",
        "num_layers": hf["n_layer"],
        "hidden_size": hf["n_embd"],
        "num_attention_heads": hf["n_head"],
        "num_query_groups": hf["n_head"],
        "ffn_hidden_size": hf.get("n_inner") or 4 * hf["n_embd"],
        "vocab_size": hf["vocab_size"],
        "max_seq_length": hf["n_positions"],
        "norm_epsilon": hf.get("layer_norm_epsilon", 1e-5),
        "tie_embeddings": hf.get("tie_word_embeddings", True),
    }


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """GPT-2 ``config.json`` fields of ``config``."""
    return {
        "n_layer": config.num_layers,
        "n_embd": config.hidden_size,
        "n_head": config.num_attention_heads,
        "n_inner": config.ffn_hidden_size,
        "vocab_size": config.vocab_size,
        "n_positions": config.max_seq_length,
        "layer_norm_epsilon": config.norm_epsilon,
        "activation_function": "gelu_new",
        "tie_word_embeddings": config.tied,
    }


GPT2 = register(
    Family(
        name="gpt2",
        released="2019-02-14",
        hf_config_class="GPT2Config",
        hf_model_class="GPT2LMHeadModel",
        layer_rules=LAYER,
        top_rules=TOP,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        positions="learned_absolute",
        norm="LayerNorm",
        activation="gelu_tanh",
        gated_mlp=False,
        linear_bias=True,
        qkv_bias=True,
        multi_head_only=True,
        tied_embeddings=True,
        hf_activation_key="activation_function",
        hf_activations=ACTIVATIONS,
        hf_router_prefix="transformer.h.{i}.attn.router.",
    )
)
