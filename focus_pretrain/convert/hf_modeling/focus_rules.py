"""The Focus pattern's rules: the standalone copy shipped with every export.

An exported model runs without ``focus_pretrain`` installed (only torch and transformers), so the
rules of its pattern are copied here from the package's spec (``focus_pretrain/focus/
pattern.py``, ``gate_forms.py``): the soft gate in both forms, logit soft-capping, group
intersection, the pair rule (causal, one document, window, sinks) and the keys' groups under
``key_groups="own_and_previous"`` (a key also in its predecessor's groups), plus the one rule
of this code's own: :func:`key_documents` (padding gives no predecessor).
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


def previous_in_document(t: Tensor, documents: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(previous, has_previous)``: each token's predecessor's row of ``t`` ``[b, s, ...]``
    (shifted by one along ``s``; the first row repeats row 0) and ``[b, s]`` bool, whether the
    token has a predecessor in its document (``documents``: ``[b, s]`` document starts, or
    ``None`` for one document per sample)."""
    b, s = t.shape[:2]
    previous = torch.cat([t[:, :1], t[:, :-1]], dim=1)  # [b, s, ...]: row i holds row i - 1
    positions = torch.arange(s, device=t.device)
    if documents is None:
        return previous, (positions > 0).expand(b, s)
    return previous, documents.to(positions.dtype) != positions  # [b, s]: not a start


def key_memberships(member: Tensor, documents: Tensor | None = None) -> Tensor:
    """``[b, s]`` int64: the groups a key counts as in under ``key_groups="own_and_previous"``:
    its own membership bitmask ``member`` ``[b, s]`` or'ed with its predecessor's in its
    document (``documents``: ``[b, s]`` document starts, or ``None``)."""
    previous, has_previous = previous_in_document(member, documents)
    return member | torch.where(has_previous, previous, torch.zeros_like(previous))


def key_assignments(probs: Tensor, documents: Tensor | None = None) -> Tensor:
    """``[b, s, K]``: a key's soft assignment under ``key_groups="own_and_previous"``: the
    elementwise probabilistic or ``g + g_prev - g * g_prev`` of its own ``probs`` ``[b, s, K]``
    and its predecessor's in its document (``g_prev = 0`` for a document's first token), in
    ``probs``' dtype; one-hot assignments give :func:`key_memberships`' sets."""
    previous, has_previous = previous_in_document(probs, documents)
    previous = previous * has_previous[..., None].to(probs.dtype)  # [b, s, K]
    return probs + previous - probs * previous


def key_documents(valid: Tensor, documents: Tensor | None = None) -> Tensor:
    """``[b, n]`` int64 document starts for the keys' rule: ``documents`` (packed rows), and
    a new start at every real token that follows padding (``valid [b, n]``, False: padding),
    so that a left-padded row's first real token has no predecessor, as when it runs alone."""
    b, n = valid.shape
    positions = torch.arange(n, device=valid.device).expand(b, n)  # [b, n]
    after_padding = torch.ones_like(valid)
    after_padding[:, 1:] = ~valid[:, :-1]  # [b, n]: the token before is padding (or none)
    starts = after_padding if documents is None else after_padding | (documents == positions)
    return torch.where(starts, positions, 0).cummax(dim=1).values


def key_routing(
    probs: Tensor | None,
    members: Tensor,
    valid: Tensor,
    key_groups: str,
    documents: Tensor | None = None,
) -> tuple[Tensor | None, Tensor]:
    """The keys' ``(probs [b, n, K], members [b, n])`` under ``key_groups``: the tokens' own
    routing (``"own"``), or with ``"own_and_previous"`` each key also in the groups of the
    token before it in its document (:func:`key_assignments` / :func:`key_memberships`;
    none for a document's first token or a real token after padding: :func:`key_documents`).
    Queries always keep their own. ``probs=None``: the bitmasks only (``(None, members)``)."""
    if key_groups == "own":
        return probs, members
    starts = key_documents(valid, documents)  # [b, n]
    keys_probs = None if probs is None else key_assignments(probs, starts)
    return keys_probs, key_memberships(members, starts)
