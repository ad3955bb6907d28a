"""The Focus pattern at block level: what a block of queries may see of a block of keys.

Derived from the pair rules of :mod:`focus_pretrain.focus.pattern` (the spec; this module is its
block-level half, :mod:`~focus_pretrain.focus.pattern_triton` its Triton copy) for the backends
that skip work block by block:

* :func:`summarise_blocks` reduces one side (queries or keys: positions, memberships, document
  starts, in any order) to per-block bounds, ``O(L)``: position range, document-start range,
  the sink tokens' first position and documents, the largest offset inside a document and, in
  hard mode, per group the first and last position and whether every token is in it;
* :func:`block_predicates` turns two sides' summaries into ``(candidate, full)`` ``[B, nq,
  nk]``: *candidate*, the (query block, key block) may hold an allowed pair (a block that is not
  a candidate holds none: skipping it is exact); *full*, every pair of it is allowed (no
  per-pair mask needed). FlexAttention's block masks (:mod:`~focus_pretrain.focus.flex`) and
  the ring's fused kernel (:mod:`~focus_pretrain.parallel.ring_kernels`) build from these;
* :func:`block_has_pair`: the exact question "does any pair of this block pass?", in ``O((Lq +
  Lk) K)``, for the ring's decision to skip a whole step;
* :func:`block_bounds` and :func:`ranges_overlap`: the bounds arithmetic the two above share.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from focus_pretrain.focus.pattern import member_bits

_BIG = torch.iinfo(torch.int64).max


class BlockSummary(NamedTuple):
    """Per-block summaries of a side: ``[B, nb]`` (``B`` is 1 when shared by the samples);
    ``group_*``: ``[b, nb, G]`` over the groups in use. Empty sets give ``_BIG`` minima and
    ``-1`` maxima."""

    pos_lo: Tensor
    pos_hi: Tensor
    doc_lo: Tensor | None
    doc_hi: Tensor | None
    sink_pos_lo: Tensor | None  # the first sink token's position
    sink_doc_lo: Tensor | None  # the sink tokens' document range
    sink_doc_hi: Tensor | None
    offset_hi: Tensor | None  # the largest position inside its document (all sinks: < sinks)
    group_lo: Tensor | None  # the first position of each group
    group_hi: Tensor | None  # the last position of each group
    group_all: Tensor | None  # every token of the block is in the group
    padded: bool = False  # the last block is padded (the side's length is not a multiple)


def _per_block(values: Tensor, block: int, fill) -> Tensor:
    """``[B, L, ...] -> [B, nb, block, ...]``, the last block padded with ``fill``."""
    b, length = values.shape[:2]
    nb = -(-length // block)
    pad = nb * block - length
    if pad:
        filler = values.new_full((b, pad, *values.shape[2:]), fill)
        values = torch.cat([values, filler], dim=1)  # [B, nb * block, ...]
    return values.reshape(b, nb, block, *values.shape[2:])  # [B, nb, block, ...]


def _lo(values: Tensor, block: int) -> Tensor:
    return _per_block(values, block, _BIG).amin(dim=2)  # [B, nb, ...]


def _hi(values: Tensor, block: int) -> Tensor:
    return _per_block(values, block, -_BIG).amax(dim=2)  # [B, nb, ...]


def block_bounds(values: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``([B, nb], [B, nb])``: the minimum and maximum of integer ``values [B, L]`` in each
    block of ``block`` tokens (the last block's padding changes neither)."""
    return _lo(values, block), _hi(values, block)


def summarise_blocks(
    pos: Tensor,
    member: Tensor | None,
    doc: Tensor | None,
    *,
    block: int,
    sinks: int,
    groups: Tensor | None = None,
) -> BlockSummary:
    """Per-block bounds of one side: ``pos`` ``[L]`` (shared by the samples) or ``[b, L]``
    global positions in the side's token order, ``member`` ``[b, L]`` int64 bitmasks (read only
    with ``groups``, ``[G]`` the group bits in use: hard mode), ``doc`` ``[b, L]`` document
    starts or ``None``."""
    pos = pos if pos.dim() == 2 else pos[None]  # [B, L]
    doc_lo = doc_hi = sink_pos_lo = sink_doc_lo = sink_doc_hi = offset_hi = None
    if doc is not None:
        doc_lo, doc_hi = _lo(doc, block), _hi(doc, block)
    if sinks:
        offset = pos if doc is None else pos - doc  # [B, L]: position inside the document
        is_sink = offset < sinks
        sink_pos_lo = _lo(torch.where(is_sink, pos, _BIG), block)
        offset_hi = _hi(offset, block)
        if doc is not None:
            sink_doc_lo = _lo(torch.where(is_sink, doc, _BIG), block)
            sink_doc_hi = _hi(torch.where(is_sink, doc, -1), block)
    group_lo = group_hi = group_all = None
    if groups is not None and member is not None:
        in_group = member_bits(member)[..., groups]  # [b, L, G]
        at = pos[..., None]  # [B, L, 1]
        group_lo = _lo(torch.where(in_group, at, _BIG), block)  # [b, nb, G]
        group_hi = _hi(torch.where(in_group, at, -1), block)
        group_all = _per_block(in_group, block, True).all(dim=2)
    return BlockSummary(
        _lo(pos, block), _hi(pos, block), doc_lo, doc_hi, sink_pos_lo, sink_doc_lo,
        sink_doc_hi, offset_hi, group_lo, group_hi, group_all, pos.shape[-1] % block != 0,
    )  # fmt: skip


def ranges_overlap(q_lo: Tensor, q_hi: Tensor, k_lo: Tensor, k_hi: Tensor) -> Tensor:
    """``[B, nq, nk]``: do the ranges ``[q_lo, q_hi]`` ``[B, nq]`` and ``[k_lo, k_hi]``
    ``[B, nk]`` intersect?"""
    return (k_lo[:, None, :] <= q_hi[:, :, None]) & (q_lo[:, :, None] <= k_hi[:, None, :])


def block_predicates(
    qs: BlockSummary, ks: BlockSummary, *, kind: str, window: int, sinks: int
) -> tuple[Tensor, Tensor]:
    """``(candidate, full)`` ``[B, nq, nk]`` bool from the queries' and the keys' summaries.

    ``kind``: ``"hard"`` (window, sinks or a shared group), ``"local"`` (window or sinks) or
    ``"causal"`` (every causal pair of one document: soft mode). ``candidate``: the block may
    hold an allowed pair; ``full``: every pair in it is allowed, and a candidate (a padded last
    key block, ``key_len % block != 0``, is never full: padding needs the per-pair mask)."""
    q_lo, q_hi = qs.pos_lo[:, :, None], qs.pos_hi[:, :, None]  # [B, nq, 1]
    k_lo, k_hi = ks.pos_lo[:, None, :], ks.pos_hi[:, None, :]  # [B, 1, nk]
    causal = k_lo <= q_hi  # some key precedes some query
    all_causal = k_hi <= q_lo
    if qs.doc_lo is not None:
        causal = causal & ranges_overlap(qs.doc_lo, qs.doc_hi, ks.doc_lo, ks.doc_hi)
        single_q, single_k = qs.doc_lo == qs.doc_hi, ks.doc_lo == ks.doc_hi  # [B, n]
        same = qs.doc_lo[:, :, None] == ks.doc_lo[:, None, :]
        all_causal = all_causal & same & single_q[:, :, None] & single_k[:, None, :]
    if kind == "causal":
        return _candidate_and_full(causal, all_causal, ks)
    reach = k_hi >= q_lo - window  # some pair within the window
    all_reach = q_hi - k_lo <= window
    if sinks:
        all_reach = all_reach | (ks.offset_hi < sinks)[:, None, :]  # every key a sink
    if kind == "hard":
        shares = ks.group_lo[:, None, :, :] <= qs.group_hi[:, :, None, :]  # [b, nq, nk, G]
        reach = reach | shares.any(dim=-1)
        common = qs.group_all[:, :, None, :] & ks.group_all[:, None, :, :]  # [b, nq, nk, G]
        all_reach = all_reach | common.any(dim=-1)
    candidate = causal & reach
    if sinks:  # a sink key of a query's document, not after it
        sink = ks.sink_pos_lo[:, None, :] <= q_hi
        if qs.doc_lo is not None:
            sink = sink & ranges_overlap(qs.doc_lo, qs.doc_hi, ks.sink_doc_lo, ks.sink_doc_hi)
        candidate = candidate | sink
    return _candidate_and_full(candidate, all_causal & all_reach, ks)


def _candidate_and_full(candidate: Tensor, full: Tensor, ks: BlockSummary) -> tuple[Tensor, Tensor]:
    """``full`` restricted to candidates and to key blocks without padding."""
    full = full & candidate
    if ks.padded:  # never a padded key block without the per-pair mask
        full[..., -1] = False
    return candidate, full


def block_has_pair(
    q_pos: Tensor,
    k_pos: Tensor,
    window: int,
    *,
    member_q: Tensor | None,
    member_k: Tensor | None,
    local_only: bool,
    sinks: int = 0,
    q_doc: Tensor | None = None,
) -> bool:
    """Whether any (query, key) pair of a block is allowed, exactly, in ``O((Lq + Lk) K)``.

    Args:
        q_pos, k_pos: ``[Lq]``, ``[Lk]`` global positions.
        member_q, member_k: ``[b, Lq|Lk]`` int64 membership bitmasks (hard mode) or ``None``.
        q_doc: ``[b, Lq]`` the queries' document starts (of the full sequence), or ``None``
            (one document: every start is ``0``).

    Documents are contiguous runs of positions, so the keys of query ``i``'s document that it
    may see causally are exactly the keys at positions in ``[d_i, i]`` (the keys' own starts
    are not needed). Hence a causal
    same-document pair exists iff the last key ``<= i`` is ``>= d_i``; a local one iff it is
    also ``>= i - window``; a sink pair iff the first key ``>= d_i`` is ``<= min(i, d_i +
    sinks - 1)``; a pair sharing group ``g`` iff the last key ``<= i`` in group ``g`` is
    ``>= d_i`` for a query ``i`` in group ``g``. Soft mode (no memberships) allows every
    causal same-document pair.
    """
    lk = k_pos.shape[0]
    k_sorted, order = torch.sort(k_pos)
    start = torch.zeros_like(q_pos)[None] if q_doc is None else q_doc  # [b|1, Lq]
    before = torch.searchsorted(k_sorted, q_pos, right=True) - 1  # [Lq]: last key <= i
    nearest = k_sorted[before.clamp(min=0)]  # [Lq]
    causal = (before >= 0) & (nearest >= start)  # [b|1, Lq]: a same-document key <= i
    if bool((causal & (q_pos - nearest <= window)).any()):
        return True
    if sinks:
        after = torch.searchsorted(k_sorted, start)  # [b|1, Lq]: first key >= d_i
        first = k_sorted[after.clamp(max=lk - 1)]
        last_sink = torch.minimum(q_pos, start + sinks - 1)  # [b|1, Lq]
        if bool(((after < lk) & (first <= last_sink)).any()):
            return True
    if local_only:
        return False
    if member_q is None or member_k is None:  # soft: any causal same-document pair
        return bool(causal.any())
    in_q = member_bits(member_q)  # [b, Lq, 64]
    in_k = member_bits(member_k.index_select(1, order))  # [b, Lk, 64], keys sorted
    latest = torch.where(in_k, k_sorted[None, :, None], -1).cummax(dim=1).values  # [b, Lk, 64]
    seen = latest.index_select(1, before.clamp(min=0))  # [b, Lq, 64]: last key <= i per group
    shared = in_q & (seen >= start[..., None]) & (before >= 0)[None, :, None]
    return bool(shared.any())
