"""The ``sdpa`` backend: plain causal attention through PyTorch's
``scaled_dot_product_attention`` (FlashAttention-2 / cuDNN / memory-efficient kernels on CUDA).

It computes exactly one request: a layer without routing whose window covers the whole
sequence (every causal pair attended), no packed documents and no soft-capping. Two callers
make such requests on every step: the dense twin (``focus.enabled: false``) and the ``dot`` gate
form's soft pattern (:mod:`~focus_pretrain.focus.gate_forms`: the gate is ``K`` extra channels of
``q`` and ``k``, and the pattern is every causal pair). ``auto`` picks it on CUDA, where these
kernels are the fastest dense attention there is; on the CPU only by name, so that CPU runs keep
the reference's numbers bit for bit.

It returns no log-sum-exp (the library does not expose one with a gradient), so it refuses calls
that ask for it (``return_lse=True``, and the ring's steps).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from focus_pretrain.focus.backends import AttentionPattern, AttentionRequest


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, pattern: AttentionPattern
) -> tuple[Tensor, Tensor | None]:
    """Causal attention of ``q [b, s, H, D]`` over ``k, v [b, s, Hkv, D]`` at ``pattern.scale``:
    ``(out [b, s, H, D], None)``."""
    gqa = q.shape[2] != k.shape[2]
    q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))  # [b, s, h, D] -> [b, h, s, D]
    out = F.scaled_dot_product_attention(
        q4, k4, v4, is_causal=True, scale=pattern.scale, enable_gqa=gqa
    )  # [b, H, s, D]
    return out.transpose(1, 2), None  # [b, H, s, D] -> [b, s, H, D]


def covers_sequence(r: AttentionRequest) -> bool:
    """Whether every causal pair is in the window (the only pattern this backend computes)."""
    return r.window >= r.seq - 1


def sdpa_priority(r: AttentionRequest) -> int | None:
    """``auto``'s rank: first on CUDA for plain causal attention, by name only elsewhere."""
    if not covers_sequence(r) or r.needs_lse:
        return None
    return 50 if r.device == "cuda" else -1


def sdpa_refusal(r: AttentionRequest) -> str | None:
    """Why a request inside the capabilities is not this backend's, in words."""
    if r.needs_lse:
        return "return_lse (it returns no log-sum-exp)"
    if not covers_sequence(r):
        return (
            f"a window ({r.window}) shorter than the sequence ({r.seq} tokens): it computes "
            "plain causal attention only"
        )
    return None
