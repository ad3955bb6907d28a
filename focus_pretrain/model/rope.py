"""RoPE frequencies exactly as HuggingFace ``transformers`` computes them, and where they go.

Megatron's ``RotaryEmbedding`` keeps its inverse frequencies ``inv_freq [head_dim / 2]`` (fp32)
as a plain attribute and builds ``emb = outer(positions, inv_freq)`` from it on every call
(cached per sequence length, then sliced per context-parallel rank), so replacing
``inv_freq`` right after construction changes every layer's rotation, under context
parallelism too. Its own Llama-3 scaling fixes ``low_freq_factor``, ``high_freq_factor`` and
``original_max_position_embeddings`` at Llama-3.1's values; :func:`hf_inv_freq` takes any.
:class:`RopeScaling` is the ``model.rope_scaling`` section (HF semantics).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from focus_pretrain.validation import check_choice, check_int, check_positive

ROPE_SCALING_TYPES = ("llama3", "linear")
_LLAMA3_KEYS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, HuggingFace semantics (``rope_parameters`` of ``config.json``).

    The scaled inverse frequencies are computed as ``transformers`` computes them
    (``_compute_llama3_parameters``, ``_compute_linear_scaling_rope_parameters``) and written
    into the model's rotary embedding, so the logits equal the HF model's.

    Attributes:
        type: ``llama3`` (Llama-3.1/3.2: low frequencies divided by ``factor``, high ones kept,
            a smooth ramp between) or ``linear`` (every frequency divided by ``factor``).
        factor: the scaling factor (> 0; 1 leaves ``linear`` unchanged).
        low_freq_factor, high_freq_factor, original_max_position_embeddings: ``llama3`` only
            (required there): wavelengths above ``original / low_freq_factor`` are divided by
            ``factor``, those below ``original / high_freq_factor`` kept.
    """

    type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        check_choice("model.rope_scaling.type", self.type, ROPE_SCALING_TYPES)
        check_positive("model.rope_scaling.factor", self.factor)
        given = [k for k in _LLAMA3_KEYS if getattr(self, k) is not None]
        if self.type == "linear" and given:
            raise ValueError(
                f"model.rope_scaling.{given[0]} is only used by type llama3, got it for linear"
            )
        if self.type == "llama3":
            missing = [k for k in _LLAMA3_KEYS if getattr(self, k) is None]
            if missing:
                raise ValueError(
                    f"model.rope_scaling.{missing[0]} is required for type llama3 (Llama-3.1 "
                    "uses low_freq_factor 1, high_freq_factor 4, "
                    "original_max_position_embeddings 8192)"
                )
            check_positive("model.rope_scaling.low_freq_factor", self.low_freq_factor)
            check_positive("model.rope_scaling.high_freq_factor", self.high_freq_factor)
            check_int(
                "model.rope_scaling.original_max_position_embeddings",
                self.original_max_position_embeddings,
                low=1,
            )
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError(
                    f"model.rope_scaling.high_freq_factor ({self.high_freq_factor}) must be > "
                    f"model.rope_scaling.low_freq_factor ({self.low_freq_factor})"
                )

    @classmethod
    def from_mapping(cls, values: Mapping) -> RopeScaling:
        """From a plain mapping (``ModelConfig(rope_scaling={...})``), unknown keys refused."""
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(
                f"unknown key(s) {', '.join('model.rope_scaling.' + k for k in unknown)}; "
                f"allowed keys: {', '.join(allowed)}"
            )
        return cls(**values)


def hf_inv_freq(
    head_dim: int,
    base: float,
    scaling: RopeScaling | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """``[head_dim / 2]`` fp32 inverse frequencies: ``transformers``' default RoPE, then its
    ``linear`` (``inv_freq / factor``) or ``llama3`` (``_compute_llama3_parameters``)
    scaling, operation for operation (bit-identical)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (base ** (exponents / head_dim))  # [head_dim / 2]
    if scaling is None:
        return inv_freq
    factor = scaling.factor
    if scaling.type == "linear":
        return inv_freq / factor
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (low frequencies) divided by factor, short ones kept, a ramp between
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def set_rope_frequencies(
    rotary: nn.Module, head_dim: int, base: float, scaling: RopeScaling | None
) -> None:
    """Give a megatron-core ``RotaryEmbedding`` HF's inverse frequencies, computed on the CPU
    as ``transformers`` does at model creation, then moved to the embedding's device."""
    rotary.inv_freq = hf_inv_freq(head_dim, base, scaling, "cpu").to(rotary.inv_freq.device)
    cache_clear = getattr(type(rotary).forward, "cache_clear", None)
    if cache_clear is not None:  # embeddings made with the old frequencies are cached
        cache_clear()
