"""The ``segments`` backend: hard top-1 attention on the group-sorted layout, forward and backward.

Sparse training (``focus.training_mode: hard``, attention mode ``hard_gated``) at top-1 needs a
path whose cost follows the pattern and that differentiates, on any device: the decomposed
backend's split (:mod:`~focus_pretrain.focus.decomposed`) with every part in differentiable
PyTorch:

* A, the pairs sharing the group: on the :class:`~focus_pretrain.focus.sorted_layout.
  GroupSortedLayout` each (sample, document, group) is a contiguous segment in causal order;
  query blocks of the packed sequence attend the keys from their segment's start only (cost
  ``~ n^2 / K`` plus a block per segment), through the reference's block kernel
  (:func:`~focus_pretrain.focus.reference.attend_block`, the pattern's own pair rule and gate,
  activation-checkpointed). Positions are renumbered per segment (``segment * n + position``)
  and each segment is its own "document" for the pair rule, with the document start shifted
  alike, so the window, the sinks (counted from the real document's start) and the gate are
  the pattern's, and no pair crosses a segment;
* B, the cross-group local band, and C, the cross-group sink pairs beyond the window
  (:func:`~focus_pretrain.focus.band.band_attention`, :func:`~focus_pretrain.focus.band.
  with_sinks`), merged by log-sum-exp.

Modes ``hard`` and ``hard_gated`` (the gate on A's pairs beyond the window, not sinks), top-1;
exact against the reference, gradients included (q, k, v, and the soft assignments through the
gate). The query blocks' key starts are read on the host (one read per block): a CPU and
debugging path; on CUDA ``flex`` is the block-sparse one. Layout: ``[batch, seq, heads,
head_dim]``.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from focus_pretrain.focus.backends import AttentionPattern, BlockSide
from focus_pretrain.focus.band import band_attention, with_sinks
from focus_pretrain.focus.lse import merge_by_lse
from focus_pretrain.focus.reference import DEFAULT_Q_BLOCK, attend_block
from focus_pretrain.focus.sorted_layout import GroupSortedLayout


def segments_attention(
    q: Tensor, k: Tensor, v: Tensor, pattern: AttentionPattern, *, q_block: int = DEFAULT_Q_BLOCK
) -> tuple[Tensor, Tensor]:
    """Backend entry (:class:`~focus_pretrain.focus.backends.Backend`): ``q [b, n, H, D]``,
    ``k, v [b, n, Hkv, D]``, a hard or hard_gated top-1 pattern -> ``(out, lse [b, n, H])``."""
    if pattern.local_only or pattern.mode not in ("hard", "hard_gated") or pattern.top_k != 1:
        raise ValueError("the segments backend computes hard and hard_gated top-1 attention")
    layout = GroupSortedLayout.of_pattern(pattern)
    out_a, lse_a = _same_group(q, k, v, pattern, layout, q_block)  # [T, H, D], [T, H]
    same_group = (layout.unpack(out_a), layout.unpack(lse_a))  # [b, n, H, D], [b, n, H]
    common = dict(
        window=pattern.window, scale=pattern.scale, softcap=pattern.softcap,
        documents=pattern.documents,
    )  # fmt: skip
    cross_band = band_attention(q, k, v, member=pattern.member, **common)
    result = merge_by_lse(same_group, cross_band)
    return with_sinks(result, q, k, v, sinks=pattern.sinks, member=pattern.member, **common)


def _same_group(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: AttentionPattern,
    layout: GroupSortedLayout,
    q_block: int,
) -> tuple[Tensor, Tensor]:
    """Part A on the packed layout: ``([T, H, D], [T, H])``, blockwise over the packed queries,
    each block against the keys from its first query's segment start."""
    n = layout.seq
    segment = layout.segment  # [T] table entry of each packed token
    doc_start = layout.position.new_zeros(()) if layout.document is None else layout.document
    pos = segment * n + layout.position  # [T] apart per segment, in order inside one
    doc = (segment * n + doc_start).expand_as(pos)[None]  # [1, T] each segment its own unit
    probs = None if pattern.probs is None else layout.pack(pattern.probs)[None]  # [1, T, K]
    member = layout.member[None]  # [1, T]
    packed = [layout.pack(t)[None] for t in (q, k, v)]  # [1, T, H|Hkv, D]
    starts = layout.cu_seqlens.to(torch.int64)[segment].tolist()  # host: each token's key start
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (*packed, probs)
    )
    fn = partial(_attend_sides, pattern)
    outs, lses = [], []
    for start in range(0, pos.shape[0], q_block):
        end = min(pos.shape[0], start + q_block)
        keys = slice(starts[start], end)
        args = (
            packed[0][:, start:end], packed[1][:, keys], packed[2][:, keys],
            pos[start:end], None if probs is None else probs[:, start:end],
            member[:, start:end], doc[:, start:end],
            pos[keys], None if probs is None else probs[:, keys], member[:, keys], doc[:, keys],
        )  # fmt: skip
        if needs_grad:
            out, lse = checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            out, lse = fn(*args)
        outs.append(out[0])  # [Lq, H, D]
        lses.append(lse[0])  # [Lq, H]
    return torch.cat(outs), torch.cat(lses)


def _attend_sides(pattern: AttentionPattern, q, k, v, *sides: Tensor | None):
    """:func:`~focus_pretrain.focus.reference.attend_block` with the two sides flat
    (positions, assignments, memberships, document starts), as checkpointing passes them."""
    return attend_block(q, k, v, pattern, BlockSide(*sides[:4]), BlockSide(*sides[4:]))
