"""``config.json`` <-> :class:`~focus_pretrain.model.config.ModelConfig` pieces the families share.

A family's description names two functions, ``config_from_hf`` (``config.json`` with the
transformers class defaults filled in -> ``ModelConfig`` fields) and ``config_to_hf`` (the
inverse, for an export); most families build them from the Llama-style decoder fields here.

RoPE parameters come in two spellings: ``transformers`` 5 writes ``rope_parameters``
(``rope_type``, ``rope_theta``, scaling keys; Gemma-3 one dict per layer type), older files
``rope_theta`` plus ``rope_scaling`` (``type`` or ``rope_type``). Both are read the way
``transformers`` reads them (``convert_rope_params_to_dict``, ``standardize_rope_params``); the
export writes the new spelling. Supported: the default RoPE, ``llama3`` and ``linear`` scaling
(reproduced bit for bit, :mod:`focus_pretrain.model.rope`); every other type is refused by name.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from focus_pretrain.errors import InputError
from focus_pretrain.model.rope import RopeScaling

if TYPE_CHECKING:
    from focus_pretrain.model.config import ModelConfig
    from focus_pretrain.model.families.base import Family

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
_LLAMA3_KEYS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_WHY_NOT = {
    "yarn": "YaRN blends interpolated and extrapolated frequencies (beta_fast, beta_slow) and "
    "rescales the attention logits (attention_factor)",
    "longrope": "LongRoPE takes per-dimension factors and switches between its short and long "
    "factors with the sequence length",
    "dynamic": "dynamic NTK recomputes the frequencies from the current sequence length",
    "proportional": "proportional RoPE rotates only part of each head",
}


def rope_fields(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """``rotary_base`` and ``rope_scaling`` from an HF ``config.json`` with one RoPE for every
    layer; raises ``ValueError`` on RoPE we do not reproduce exactly."""
    rope = copy.deepcopy(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    check_partial_rotary(hf, rope, model_type)
    if "original_max_position_embeddings" in hf and rope_kind(rope) == "llama3":
        rope["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    return {
        "rotary_base": float(rope["rope_theta"]),
        "rope_scaling": rope_scaling(
            rope, f"{model_type} rope_parameters", hf.get("max_position_embeddings")
        ),
    }


def check_partial_rotary(hf: dict[str, Any], rope: dict[str, Any], model_type: str) -> None:
    """Refuse RoPE on part of each head (ours rotates the whole head)."""
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"{model_type} with partial_rotary_factor={partial} is not supported (RoPE on part "
            "of each head); our rotary embedding rotates the whole head"
        )


def rope_kind(rope: dict[str, Any]) -> str:
    """The ``rope_type`` of one HF RoPE dict (``default`` when unsaid)."""
    return rope.get("rope_type", rope.get("type", "default"))


def rope_scaling(
    rope: dict[str, Any], where: str, max_positions: int | None = None
) -> RopeScaling | None:
    """The :class:`RopeScaling` of one HF RoPE dict (``llama3`` without
    ``original_max_position_embeddings`` takes ``max_positions``, as HF does); ``None`` for
    the default RoPE. Refuses every other type by name, saying what is supported."""
    kind = rope_kind(rope)
    if kind == "default":
        return None
    if kind not in SUPPORTED_ROPE_TYPES:
        why = _WHY_NOT.get(kind, "it has no exact counterpart in our rotary embedding")
        raise ValueError(
            f"RoPE scaling rope_type={kind!r} ({where}: {rope}) is not supported: {why}, so "
            "the imported model's logits would differ from the checkpoint's. Supported, and "
            f"reproduced exactly: {', '.join(map(repr, SUPPORTED_ROPE_TYPES))} (with any "
            "factor, low_freq_factor, high_freq_factor, original_max_position_embeddings); "
            "import a checkpoint that uses one of them"
        )
    values = {"original_max_position_embeddings": max_positions, **rope}
    keys = ("factor",) if kind == "linear" else ("factor", *_LLAMA3_KEYS)
    missing = [k for k in keys if values.get(k) is None]
    if missing:
        raise ValueError(f"{where}: rope_type {kind!r} needs {missing[0]!r} (got {rope})")
    floats = {k: float(values[k]) for k in keys if k != "original_max_position_embeddings"}
    return RopeScaling(type=kind, **{**{k: values[k] for k in keys}, **floats})


def rope_parameters(config: ModelConfig) -> dict[str, Any]:
    """HF ``rope_parameters`` of the model's (global layers') RoPE (inverse of
    :func:`rope_fields`)."""
    scaling = config.rope_scaling
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rotary_base}
    if scaling is not None:
        rope = {"rope_type": scaling.type, "rope_theta": config.rotary_base}
        rope["factor"] = scaling.factor
        if scaling.type == "llama3":
            rope["low_freq_factor"] = scaling.low_freq_factor
            rope["high_freq_factor"] = scaling.high_freq_factor
            rope["original_max_position_embeddings"] = scaling.original_max_position_embeddings
    return rope


def layer_types_for(num_layers: int, pattern: int) -> list[str]:
    """HF ``layer_types`` of a local/global pattern (0-based layer ``i`` global iff
    ``(i + 1) % pattern == 0``)."""
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def check_activation(hf: dict[str, Any], family: Family) -> None:
    """Refuse an MLP activation other than the family's (read from the key its MLP reads;
    a stray other key is ignored)."""
    activation = hf.get(family.hf_activation_key)
    if activation not in family.hf_activations:
        raise ValueError(f"{family.hf_model_type} with activation {activation!r} is not supported")


def decoder_fields(
    hf: dict[str, Any],
    family: Family,
    rope: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``ModelConfig`` fields of a Llama-style ``config.json`` (every family but GPT-2):
    sizes, GQA, head_dim, RoPE, norm epsilon, tied embeddings. ``rope``: the family's RoPE
    fields from ``config.json`` (default :func:`rope_fields`: one RoPE for every layer)."""
    rope_of = rope or (lambda values: rope_fields(values, family.hf_model_type))
    check_activation(hf, family)
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag) and not family.qkv_bias:
            raise ValueError(f"{family.hf_model_type} with {flag}=true is not supported")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return {
        "family": family.name,
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "ffn_hidden_size": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "max_seq_length": hf.get("max_position_embeddings", 4096),
        "head_dim": None if head_dim * heads == hf["hidden_size"] else head_dim,
        **rope_of(hf),  # rotary_base, rope_scaling (refuses other RoPE)
        "norm_epsilon": hf.get("rms_norm_eps", 1e-6),
        "tie_embeddings": hf.get("tie_word_embeddings", family.tied_embeddings),
    }


def decoder_hf_fields(config: ModelConfig) -> dict[str, Any]:
    """The Llama-style ``config.json`` fields of ``config`` (inverse of :func:`decoder_fields`)."""
    return {
        "num_hidden_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.kv_heads,
        "intermediate_size": config.ffn_hidden_size,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_length,
        "head_dim": config.kv_channels,
        "rms_norm_eps": config.norm_epsilon,
        "rope_parameters": rope_parameters(config),
        "tie_word_embeddings": config.tied,
    }


def qwen_slides(hf: dict[str, Any]) -> bool:
    """Whether transformers runs some layers of a Qwen2/Qwen3 checkpoint with a sliding
    window: ``use_sliding_window`` and layers past ``max_window_layers`` (or ``layer_types``)."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return False
    if hf.get("layer_types") is not None:
        return "sliding_attention" in hf["layer_types"]
    return hf.get("max_window_layers", 28) < hf["num_hidden_layers"]


def hf_query_pre_attn_scalar(config: ModelConfig) -> int:
    """Gemma's ``query_pre_attn_scalar`` as the int ``transformers``' Gemma2Config (and
    Gemma3TextConfig) requires (a recipe stores it as a float: 256 comes back from config.yaml as
    256.0)."""
    value = config.query_pre_attn_scalar
    if value is None:
        return config.kv_channels
    if not float(value).is_integer():
        raise InputError(
            f"model.query_pre_attn_scalar is {value}, not an integer: transformers' Gemma "
            "configs (what the exported config.json loads into) only take an int, and rounding "
            "it would change the attention scale the model was trained with. Export a model "
            "trained with an integral model.query_pre_attn_scalar (HF Gemma checkpoints use one)"
        )
    return int(value)
