"""``config.json`` <-> :class:`ModelConfig` for RoPE (base, scaling) and Gemma-3's layers.

RoPE parameters come in two spellings: ``transformers`` 5 writes ``rope_parameters``
(``rope_type``, ``rope_theta``, scaling keys; Gemma-3 one dict per layer type,
``sliding_attention`` and ``full_attention``), older files ``rope_theta`` plus ``rope_scaling``
(``type`` or ``rope_type``; Gemma-3 also ``rope_local_base_freq``). Both are read the way
``transformers`` reads them (``convert_rope_params_to_dict``, ``standardize_rope_params``);
the export writes the new spelling. Supported: the default RoPE, ``llama3`` and ``linear``
scaling (reproduced bit for bit, :mod:`focus_pretrain.model.rope`); every other type is refused
by name.
"""

from __future__ import annotations

import copy
from typing import Any

from focus_pretrain.model.config import ModelConfig, RopeScaling

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
GEMMA3_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
# HF model_types we recognise but do not import, with the reason and what to do instead
REFUSED_MODEL_TYPES = {
    "gemma3": "multimodal Gemma-3 (Gemma3ForConditionalGeneration: vision tower and "
    "language_model.* weights) is not supported; import a text-only Gemma-3 checkpoint "
    "(model_type gemma3_text, Gemma3ForCausalLM, e.g. google/gemma-3-1b-pt), or save its "
    "language model as a Gemma3ForCausalLM first",
}


def rope_fields(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """``rotary_base`` and ``rope_scaling`` (plus Gemma-3's ``local_rotary_base``) from an
    HF ``config.json``; raises ``ValueError`` on RoPE we do not reproduce exactly."""
    if model_type == "gemma3_text":
        return _gemma3_rope(hf)
    rope = copy.deepcopy(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    _check_partial(hf, rope, model_type)
    if "original_max_position_embeddings" in hf and _kind(rope) == "llama3":
        rope["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    return {
        "rotary_base": float(rope["rope_theta"]),
        "rope_scaling": rope_scaling(
            rope, f"{model_type} rope_parameters", hf.get("max_position_embeddings")
        ),
    }


def _gemma3_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma-3: global (``full_attention``) and local (``sliding_attention``) RoPE."""
    nested = copy.deepcopy(hf.get("rope_parameters") or {})
    # as in transformers, only the per-layer-type dicts count
    params = {
        layer: nested.get(layer) or {"rope_type": "default"} for layer in GEMMA3_DEFAULT_THETA
    }
    if hf.get("rope_scaling"):
        params["full_attention"].update(hf["rope_scaling"])
    params["full_attention"].setdefault(
        "rope_theta", hf.get("rope_theta", GEMMA3_DEFAULT_THETA["full_attention"])
    )
    params["sliding_attention"].setdefault(
        "rope_theta", hf.get("rope_local_base_freq", GEMMA3_DEFAULT_THETA["sliding_attention"])
    )
    for rope in params.values():
        _check_partial(hf, rope, "gemma3_text")
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


def _check_partial(hf: dict[str, Any], rope: dict[str, Any], model_type: str) -> None:
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"{model_type} with partial_rotary_factor={partial} is not supported (RoPE on part "
            "of each head); our rotary embedding rotates the whole head"
        )


def _kind(rope: dict[str, Any]) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def rope_scaling(
    rope: dict[str, Any], where: str, max_positions: int | None = None
) -> RopeScaling | None:
    """The :class:`RopeScaling` of one HF RoPE dict (``llama3`` without
    ``original_max_position_embeddings`` takes ``max_positions``, as HF does); ``None`` for
    the default RoPE. Refuses every other type by name, saying what is supported."""
    kind = _kind(rope)
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


def gemma3_fields(hf: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Gemma-3's window, local/global layer pattern, final soft-cap and attention scale.

    ``attn_logit_softcapping`` is not read: transformers' Gemma-3 attention ignores it (unlike
    Gemma-2's), and the import follows what the HF model computes."""
    window = hf.get("sliding_window", 4096)
    if window is None:
        raise ValueError("gemma3_text with sliding_window=null is not supported")
    return {
        "head_dim": head_dim,
        "sliding_window": window,
        "sliding_window_pattern": _gemma3_pattern(hf),
        "final_softcap": hf.get("final_logit_softcapping"),
        "query_pre_attn_scalar": hf.get("query_pre_attn_scalar", 256),
    }


def _gemma3_pattern(hf: dict[str, Any]) -> int:
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


def layer_types_for(num_layers: int, pattern: int) -> list[str]:
    """HF ``layer_types`` of the Gemma pattern (0-based layer ``i`` global iff
    ``(i + 1) % pattern == 0``)."""
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def rope_parameters(config: ModelConfig) -> dict[str, Any]:
    """HF ``rope_parameters`` for ``config`` (inverse of :func:`rope_fields`)."""
    scaling = config.rope_scaling
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rotary_base}
    if scaling is not None:
        rope = {"rope_type": scaling.type, "rope_theta": config.rotary_base}
        rope["factor"] = scaling.factor
        if scaling.type == "llama3":
            rope["low_freq_factor"] = scaling.low_freq_factor
            rope["high_freq_factor"] = scaling.high_freq_factor
            rope["original_max_position_embeddings"] = scaling.original_max_position_embeddings
    if config.family != "gemma3":
        return rope
    local = config.local_rotary_base or config.rotary_base
    return {
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
        "full_attention": rope,
    }
