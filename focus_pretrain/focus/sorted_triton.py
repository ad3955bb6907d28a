"""The ``triton`` backend's hard top-1 path: sparse training (``hard_gated``) and hard attention
on the group-sorted layout through the fused soft-gate kernels.

At top-1 the pairs beyond the window are those of one group, so on the
:class:`~focus_pretrain.focus.sorted_layout.GroupSortedLayout` (each (sample, document, group)
a contiguous segment in causal order) they are causal attention inside each segment. The fused
kernels (:mod:`~focus_pretrain.focus.soft_triton`) run on the packed sequence with:

* each segment as a document, its start ``R`` (a packed index) as the document start: the
  loops visit, per query tile, only the key tiles from its segment's start to the diagonal
  (``packed=True``), so the work is ``~ n^2 / K`` plus a tile per segment, and no pair crosses
  a segment;
* the positions the pair rule reads set to ``R + (position - document start)``: inside a
  segment, differences are the real distances (the window) and ``position - R`` is the
  distance from the real document's start (the sinks);
* ``hard_gated``: the soft gate on the pairs beyond the window whose key is not a sink, with
  the assignments' gradients (the routers learn), exactly as the reference; ``hard``: a
  sliding-window call with a window no segment exceeds (every same-group pair, no gate).

The cross-group band and sink pairs are added as in the ``decomposed`` backend
(:func:`~focus_pretrain.focus.decomposed.with_cross_group_pairs`). Layout: ``[batch, seq,
heads, head_dim]``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from focus_pretrain.focus.backends import AttentionPattern
from focus_pretrain.focus.decomposed import with_cross_group_pairs
from focus_pretrain.focus.soft_triton import attend, triton_focus_attention
from focus_pretrain.focus.sorted_layout import GroupSortedLayout


def triton_attention(
    q: Tensor, k: Tensor, v: Tensor, pattern: AttentionPattern
) -> tuple[Tensor, Tensor]:
    """Backend entry (:class:`~focus_pretrain.focus.backends.Backend`): the soft pattern and
    sliding-window layers (:func:`~focus_pretrain.focus.soft_triton.triton_focus_attention`),
    and hard / hard_gated top-1 (:func:`sorted_top1_attention`)."""
    if pattern.local_only or pattern.mode == "soft":
        return triton_focus_attention(q, k, v, pattern)
    return sorted_top1_attention(q, k, v, pattern)


def sorted_top1_attention(
    q: Tensor, k: Tensor, v: Tensor, pattern: AttentionPattern
) -> tuple[Tensor, Tensor]:
    """Hard or hard_gated top-1 attention: ``q [b, n, H, D]``, ``k, v [b, n, Hkv, D]`` ->
    ``(out [b, n, H, D], lse [b, n, H] fp32)``, differentiable in ``q``, ``k``, ``v`` and, in
    ``hard_gated``, the soft assignments ``pattern.probs``."""
    if pattern.mode not in ("hard", "hard_gated") or pattern.top_k != 1 or pattern.member is None:
        raise ValueError("the triton backend's sorted path computes hard and hard_gated top-1")
    layout = GroupSortedLayout.of_pattern(pattern)
    start, rule_pos = _segment_coordinates(layout)  # [1, T] each
    q_p, k_p, v_p = (layout.pack(t)[None] for t in (q, k, v))  # [1, b * n, H|Hkv, D]
    gated = pattern.mode == "hard_gated"
    probs = layout.pack(pattern.probs)[None] if gated else None  # [1, T, K] differentiable
    # the same-group pairs: gated beyond the window and the sinks (hard_gated), or all of them
    same = pattern if gated else replace(pattern, window=layout.seq, sinks=0)
    out, lse = attend(
        q_p, k_p, v_p, probs, probs, same, doc_q=start, doc_k=start, pos_q=rule_pos,
        pos_k=rule_pos, packed=True,
    )  # fmt: skip  # [1, T, H, D], [1, T, H]
    same_group = (layout.unpack(out[0]), layout.unpack(lse[0]))  # [b, n, H, D], [b, n, H]
    return with_cross_group_pairs(same_group, q, k, v, pattern)


def _segment_coordinates(layout: GroupSortedLayout) -> tuple[Tensor, Tensor]:
    """Per packed token: its segment's start ``R`` (a packed index: the kernels' document
    start) and the position the pair rule reads, ``R + (position - document start)``; both
    ``[1, T]`` int64 (the packed sequence as one sample)."""
    start = layout.cu_seqlens.to(torch.int64)[layout.segment]  # [T]
    document = layout.document if layout.document is not None else torch.zeros_like(start)
    rule_pos = start + (layout.position - document)  # [T]
    return start[None], rule_pos[None]
