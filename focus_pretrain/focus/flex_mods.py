"""The Focus rule's FlexAttention copy: soft-capping and the soft gate as ``score_mod``s.

One ``score_mod`` of the soft gate (:func:`gate_score_mod`) serves every FlexAttention path:
the soft pattern and sparse training's routed pairs (:mod:`~focus_pretrain.focus.flex`) and the
ring's fused step (:mod:`~focus_pretrain.parallel.ring_kernels`); each says how a pair's
positions and key document are read (its token order). The gate and soft-capping themselves are
the spec's (:func:`~focus_pretrain.focus.pattern.soft_gate`,
:func:`~focus_pretrain.focus.pattern.soft_cap`), called on FlexAttention's scalar tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from focus_pretrain.focus.pattern import (
    at_least_fp32,
    compute_dtype,
    pair_rule,
    soft_cap,
    soft_gate,
)
from focus_pretrain.focus.pattern_settings import FocusPattern


def score_constant(value: float | None, like: Tensor) -> Tensor | None:
    """A float for a ``score_mod`` as a captured 0-dim tensor (``like``'s compute dtype and
    device). A Python float in the closure would become a symbolic float for dynamo once it
    changes between calls (floats are not specialised), which FlexAttention's tracing refuses."""
    if value is None:
        return None
    return torch.full((), value, dtype=compute_dtype(like.dtype), device=like.device)


def softcap_mod(softcap: float | None, like: Tensor):
    """Soft-capping (:func:`~focus_pretrain.focus.pattern.soft_cap`) as a ``score_mod``
    (``None`` without)."""
    cap = score_constant(softcap, like)
    if cap is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        return soft_cap(score, cap)

    return score_mod


def gate_tables(probs_q: Tensor, probs_k: Tensor | None = None) -> tuple[list, list]:
    """The soft assignments of the queries ``probs_q [b, Lq, K]`` and of the keys ``probs_k
    [b, Lk, K]`` (default: the same) as ``K`` query-side and ``K`` key-side tables ``[b, L]``
    (at least fp32), each its own tensor: compiled FlexAttention cannot differentiate a
    ``score_mod`` that indexes one tensor twice (torch 2.11: "multiple indexing operations on
    the same tensor that requires gradients"), so every table is read once."""
    g_q = at_least_fp32(probs_q)
    g_k = g_q if probs_k is None else at_least_fp32(probs_k)
    num_groups = g_q.shape[-1]
    tables_q = [g_q[..., c].contiguous() for c in range(num_groups)]  # K x [b, Lq]
    tables_k = [g_k[..., c].clone(memory_format=torch.contiguous_format) for c in range(num_groups)]
    return tables_q, tables_k


def pair_gate(g_q: list, g_k: list, lam: Tensor, b, q_idx, kv_idx) -> Tensor:
    """Inside a ``score_mod``: the gate (:func:`~focus_pretrain.focus.pattern.soft_gate`) of
    the pair ``(q_idx, kv_idx)`` of sample ``b``, from :func:`gate_tables`' per-group tables."""
    affinity = g_q[0][b, q_idx] * g_k[0][b, kv_idx]
    for c in range(1, len(g_q)):
        affinity = affinity + g_q[c][b, q_idx] * g_k[c][b, kv_idx]
    return soft_gate(affinity, lam)


def gate_score_mod(
    pattern: FocusPattern,
    probs_q: Tensor,
    probs_k: Tensor | None,
    like: Tensor,
    *,
    q_pos: Callable,
    k_pos: Callable,
    k_doc: Callable | None,
) -> Callable:
    """The soft gate as a ``score_mod`` (the rule's FlexAttention copy, for every flex path and
    the ring's fused step): soft-capping, then the gate
    (:func:`~focus_pretrain.focus.pattern.soft_gate`) on the pairs beyond the window whose key
    is not a sink; the mask says which pairs exist.

    Args:
        pattern: the window, sinks, gate and soft-capping.
        probs_q, probs_k: ``[b, Lq, K]``, ``[b, Lk, K]`` soft assignments in kernel order
            (``probs_k`` ``None``: the same tokens).
        like: a tensor on the device and in the dtype of the scores (the constants').
        q_pos, k_pos: ``(b, idx) -> position`` of a query and of a key (in its document's
            sequence or globally; the same origin as ``k_doc``).
        k_doc: ``(b, idx) -> document start`` of a key, or ``None`` (one document).
    """
    g_q, g_k = gate_tables(probs_q, probs_k)  # K x [b, Lq], K x [b, Lk]: each read once
    cap = score_constant(pattern.softcap, like)
    lam = score_constant(pattern.gate_lambda, like)
    window, sinks = pattern.window, pattern.sinks
    key_doc = k_doc if sinks else None  # documents matter to the gate through the sinks only

    def score_mod(score, b, h, q_idx, kv_idx):
        score = soft_cap(score, cap)
        gate = pair_gate(g_q, g_k, lam, b, q_idx, kv_idx)
        doc = None if key_doc is None else key_doc(b, kv_idx)
        _, near = pair_rule(
            q_pos(b, q_idx), k_pos(b, kv_idx), window=window, sinks=sinks, k_doc=doc
        )
        return score + torch.where(near, torch.zeros_like(gate), gate)  # the mask is causal

    return score_mod
