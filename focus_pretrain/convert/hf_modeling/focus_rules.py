"""The Focus pattern's rules: the standalone copy shipped with every export.

An exported model runs without ``focus_pretrain`` installed (only torch and transformers), so the
rules of its pattern are copied here from the package's spec (``focus_pretrain/focus/
pattern.py``, ``gate_forms.py``): the soft gate in both forms, logit soft-capping, group
intersection and the pair rule (causal, one document, window, sinks).
``tests/unit/test_pattern_copies.py`` checks every function here against the spec on random
inputs; ``modeling_focus.py``, ``focus_cache.py`` and ``focus_static.py`` use only these.
"""

from __future__ import annotations

import torch
from torch import Tensor


def soft_gate(affinity: Tensor, gate_lambda: float) -> Tensor:
    """The soft gate ``log sigmoid(lambda * (affinity - 1/2))`` (``affinity = g_i . g_j``, the
    soft co-membership), elementwise, at least fp32."""
    affinity = affinity.to(torch.promote_types(affinity.dtype, torch.float32))
    return torch.nn.functional.logsigmoid(gate_lambda * (affinity - 0.5))


def dot_gate(probs_q: Tensor, probs_k: Tensor, gate_lambda: float) -> Tensor:
    """The ``dot`` gate form's logit term ``lambda * g_i . g_j`` of every pair, added to the score
    before soft-capping: ``probs_q [b, q, K]``, ``probs_k [b, kv, K]`` -> ``[b, q, kv]``, at
    least fp32."""
    dtype = torch.promote_types(probs_q.dtype, torch.float32)
    return gate_lambda * torch.einsum("bqc,bkc->bqk", probs_q.to(dtype), probs_k.to(dtype))


def soft_cap(scores: Tensor, cap: float | None) -> Tensor:
    """Logit soft-capping ``cap * tanh(scores / cap)``; ``cap=None``: unchanged."""
    if cap is None:
        return scores
    return cap * torch.tanh(scores / cap)


def groups_intersect(member_q: Tensor, member_k: Tensor) -> Tensor:
    """Elementwise (broadcasting) bool: do the int64 group-membership bitmasks intersect?"""
    return (member_q & member_k) != 0


def pair_rule(
    q_pos: Tensor,
    k_pos: Tensor,
    *,
    window: int,
    sinks: int = 0,
    q_doc: Tensor | None = None,
    k_doc: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(causal, near)`` bool of broadcast-compatible query and key positions (and document
    starts): ``causal`` is ``j <= i`` in one document; ``near`` is ``i - j <= window`` or a sink
    key (``j - d_j < sinks``). Always attended: ``causal & near``; the rest of ``causal`` is
    gated (soft), routed (hard: a shared group) or cut (window-only layers)."""
    causal = k_pos <= q_pos
    offset = k_pos if k_doc is None else k_pos - k_doc
    if q_doc is not None and k_doc is not None:
        causal = causal & (q_doc == k_doc)
    near = q_pos - k_pos <= window
    if sinks:
        near = near | (offset < sinks)
    return causal, near
