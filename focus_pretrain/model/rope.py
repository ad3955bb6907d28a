"""RoPE frequencies exactly as HuggingFace ``transformers`` computes them, and where they go.

Megatron's ``RotaryEmbedding`` keeps its inverse frequencies ``inv_freq [head_dim / 2]`` (fp32)
as a plain attribute and builds ``emb = outer(positions, inv_freq)`` from it on every call
(cached per sequence length, then sliced per context-parallel rank), so replacing
``inv_freq`` right after construction changes every layer's rotation, under context
parallelism too. Its own Llama-3 scaling fixes ``low_freq_factor``, ``high_freq_factor`` and
``original_max_position_embeddings`` at Llama-3.1's values; :func:`hf_inv_freq` takes any.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from focus_pretrain.model.config import RopeScaling


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
