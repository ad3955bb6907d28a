"""The local band in ``O(n w)`` and the sink keys in ``O(n S)`` (plain PyTorch).

The decomposition of hard Focus attention (:mod:`focus_pretrain.focus.decomposed`) splits the
pattern into disjoint parts, computed separately and merged exactly:

* A, pairs that share a group (causal): attention inside the group-sorted layout;
* B, the **cross-group local band**: ``0 <= i - j <= window`` and the groups do not intersect;
* C, with ``sinks = S > 0``, the **sink-only pairs**: keys ``j < S`` beyond the window whose
  groups do not intersect the query's (:func:`~focus_pretrain.focus.pattern.sink_only_pairs`).

:func:`band_attention` computes B (or the whole window of a sliding-window layer) block by block:
the queries of block ``[t, t + B)`` against keys ``[t - window, t + B)``, all blocks of a chunk
in one batched matmul, so time and memory are ``O(n (B + w))``. :func:`sink_attention` computes C
(every query against the first ``S`` keys, masked); :mod:`focus_pretrain.focus.lse` combines
partial results ``(out, lse)`` of disjoint key sets into the attention over their union.

**Packed documents** (``documents``: ``[b, n]`` int64 document starts ``d``,
:func:`~focus_pretrain.focus.pattern.document_starts`): the band keeps only pairs of one
document (``d_i == d_j``), and the sinks of query ``i`` are its own document's first ``S``
tokens, positions ``d_i .. d_i + S - 1``: :func:`sink_attention` gathers those ``S`` keys per
query, still ``O(n S)`` (never a ``n x n`` mask).

Layout: ``[batch, seq, heads, head_dim]``; GQA query head ``h`` reads KV head
``h // (heads / heads_kv)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from focus_pretrain.focus.lse import merge_by_lse
from focus_pretrain.focus.pattern import (
    at_least_fp32,
    causal_and_local,
    groups_intersect,
    pair_rule,
    soft_cap,
)
from focus_pretrain.focus.reference import softmax_with_lse

DEFAULT_BAND_BLOCK = 64
MAX_BAND_SCORES = 1 << 25  # scores held at once (fp32: 128 MiB); chunks of query blocks


def band_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    scale: float,
    softcap: float | None,
    member: Tensor | None = None,
    documents: Tensor | None = None,
    block: int = DEFAULT_BAND_BLOCK,
    max_scores: int = MAX_BAND_SCORES,
) -> tuple[Tensor, Tensor]:
    """Causal attention of each query on the keys at most ``window`` positions back.

    Args:
        q: ``[b, n, H, D]``; k, v: ``[b, n, Hkv, D]``.
        window: ``w >= 0``; keys ``j`` with ``0 <= i - j <= w``.
        scale, softcap: as in :func:`focus_pretrain.focus.focus_attention`.
        member: ``[b, n]`` int64 bitmasks: if given, only pairs whose bitmasks do **not**
            intersect (the cross-group band B); if ``None``, every pair of the band.
        documents: ``[b, n]`` int64 document starts: if given, only pairs of one document.
        block: query rows per block (the result does not depend on it).
        max_scores: bound on the scores materialised at once.

    Returns:
        ``(out [b, n, H, D] in q.dtype, lse [b, n, H] at least fp32)``; queries with no key
        get ``out = 0``, ``lse = -inf``.
    """
    b, n, h, d = q.shape
    hkv = k.shape[2]
    w = min(window, n - 1)  # a window past the start is the whole causal prefix
    block = max(1, min(block, n))
    nb = -(-n // block)  # query blocks
    span = block + w  # keys seen by one query block
    pad_back = nb * block - n
    q5 = at_least_fp32(q).reshape(b, n, hkv, h // hkv, d)  # [b, n, Hkv, G, D]
    q5 = F.pad(q5, (0, 0, 0, 0, 0, 0, 0, pad_back)).reshape(b, nb, block, hkv, h // hkv, d)
    # keys padded with w rows in front: block t reads padded rows [t * block, t * block + span)
    k_pad = F.pad(at_least_fp32(k), (0, 0, 0, 0, w, pad_back))  # [b, w + nb * block, Hkv, D]
    v_pad = F.pad(at_least_fp32(v), (0, 0, 0, 0, w, pad_back))
    k_win = k_pad.unfold(1, span, block)  # [b, nb, Hkv, D, span] (a view)
    v_win = v_pad.unfold(1, span, block)
    q_idx = torch.arange(block, device=q.device)
    k_idx = torch.arange(span, device=q.device) - w  # key offset relative to the block start
    _, in_band = causal_and_local(q_idx, k_idx, w)  # [block, span], the same for every block
    if member is not None:
        m_q = F.pad(member, (0, pad_back)).reshape(b, nb, block)  # [b, nb, block]
        m_k = F.pad(member, (w, pad_back)).unfold(1, span, block)  # [b, nb, span]
    if documents is not None:
        d_q = F.pad(documents, (0, pad_back)).reshape(b, nb, block)  # [b, nb, block]
        d_k = F.pad(documents, (w, pad_back)).unfold(1, span, block)  # [b, nb, span]
    first_key = torch.arange(nb, device=q.device)[:, None] * block + k_idx  # [nb, span]
    key_exists = first_key >= 0  # the w front-padding keys do not exist
    chunk = max(1, max_scores // max(1, b * h * block * span))
    outs, lses = [], []
    for c0 in range(0, nb, chunk):  # chunks of query blocks bound the memory, not a group loop
        c1 = min(nb, c0 + chunk)
        scores = torch.einsum("btqhgd,bthdk->bthgqk", q5[:, c0:c1], k_win[:, c0:c1]) * scale
        scores = soft_cap(scores, softcap)
        allowed = in_band[None, None] & key_exists[None, c0:c1, None, :]  # [1, c, block, span]
        if member is not None:
            cross = (m_q[:, c0:c1, :, None] & m_k[:, c0:c1, None, :]) == 0  # [b, c, block, span]
            allowed = allowed & cross
        if documents is not None:
            same = d_q[:, c0:c1, :, None] == d_k[:, c0:c1, None, :]  # [b, c, block, span]
            allowed = allowed & same
        allowed = allowed[:, :, None, None]  # [b|1, c, 1, 1, block, span]
        scores = scores.masked_fill(~allowed, float("-inf"))  # [b, c, Hkv, G, block, span]
        weights, lse = softmax_with_lse(scores)  # lse: [b, c, Hkv, G, block]
        out = torch.einsum("bthgqk,bthdk->btqhgd", weights, v_win[:, c0:c1])
        outs.append(out.reshape(b, (c1 - c0) * block, h, d))  # [b, c * block, H, D]
        lses.append(lse.permute(0, 1, 4, 2, 3).reshape(b, (c1 - c0) * block, h))
    out = torch.cat(outs, dim=1)[:, :n]
    lse = torch.cat(lses, dim=1)[:, :n]
    return out.to(q.dtype), lse


def sink_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    sinks: int,
    scale: float,
    softcap: float | None,
    member: Tensor | None = None,
    documents: Tensor | None = None,
    max_scores: int = MAX_BAND_SCORES,
) -> tuple[Tensor, Tensor]:
    """Each query against the sink keys that neither the window nor its groups give it.

    Args:
        q: ``[b, n, H, D]``; k, v: ``[b, n, Hkv, D]``.
        window: ``w >= 0``; sinks: ``S >= 0`` (keys at positions ``< S``).
        scale, softcap: as in :func:`focus_pretrain.focus.focus_attention`.
        member: ``[b, n]`` int64 bitmasks (hard pattern: pairs sharing a group are left to the
            same-group part); ``None`` for a sliding-window layer.
        documents: ``[b, n]`` int64 document starts ``d``: the sinks of query ``i`` are then
            positions ``d_i .. d_i + S - 1`` (its own document's first ``S`` tokens), gathered
            per query (``O(n S)``).
        max_scores: bound on the scores materialised at once (chunks of query rows).

    Returns:
        ``(out [b, n, H, D] in q.dtype, lse [b, n, H] at least fp32)``; queries with no such
        key (every query at most ``w`` past its document's start) get ``out = 0``,
        ``lse = -inf``.
    """
    b, n, h, d = q.shape
    hkv = k.shape[2]
    s = min(sinks, n)
    out = torch.zeros_like(q)  # [b, n, H, D]
    lse = torch.full((b, n, h), float("-inf"), dtype=at_least_fp32(q).dtype, device=q.device)
    first = min(n, window + 1)  # queries at positions <= w reach every sink inside the window
    if s == 0 or first == n:
        return out, lse
    q5 = at_least_fp32(q).reshape(b, n, hkv, h // hkv, d)  # [b, n, Hkv, G, D]
    if documents is None:  # one document per sample: every query's sinks are keys 0 .. S - 1
        documents = torch.zeros(b, n, dtype=torch.int64, device=q.device)
    per_row = b * s * (h + 2 * hkv * d)  # scores and the gathered keys and values
    rows = max(1, max_scores // max(1, per_row))
    kwargs = dict(window=window, sinks=sinks, scale=scale, softcap=softcap, member=member)
    for r0 in range(first, n, rows):  # chunks of query rows bound the memory
        r1 = min(n, r0 + rows)
        part, part_lse = _document_sinks(q5, k, v, r0, r1, documents=documents, **kwargs)
        out[:, r0:r1] = part.reshape(b, r1 - r0, h, d).to(q.dtype)  # [b, r, H, D]
        lse[:, r0:r1] = part_lse  # [b, r, H]
    return out, lse


def _document_sinks(
    q5: Tensor,
    k: Tensor,
    v: Tensor,
    r0: int,
    r1: int,
    *,
    window: int,
    sinks: int,
    scale: float,
    softcap: float | None,
    member: Tensor | None,
    documents: Tensor,
) -> tuple[Tensor, Tensor]:
    """Sink-only part of queries ``[r0, r1)`` (``q5 [b, n, Hkv, G, D]``) given each token's
    document start (all zeros: one document per sample): each query against its own
    document's first ``S`` positions ``d_i + t`` (``t < S``),
    gathered per query; the allowed pairs are those of
    :func:`~focus_pretrain.focus.pattern.sink_only_pairs` with ``q_doc``/``k_doc``: causal,
    beyond the window and, with ``member``, sharing no group (a causal key ``d_i <= j <= i``
    lies in the query's document, so no document test is needed). Returns
    ``([b, r, Hkv, G, D], [b, r, H])``."""
    b, n, hkv = k.shape[:3]
    s = min(sinks, n)
    query = torch.arange(r0, r1, device=k.device)[None, :, None]  # [1, r, 1]
    key = documents[:, r0:r1, None] + torch.arange(s, device=k.device)  # [b, r, S] positions
    causal, near = pair_rule(query, key, window=window)  # [b, r, S] each
    allowed = causal & ~near  # beyond the window: the pairs only the sinks allow
    key = key.clamp(max=n - 1)  # past the end only when not causal (masked above)
    if member is not None:
        key_member = member.gather(1, key.reshape(b, -1)).view_as(key)  # [b, r * S] -> [b, r, S]
        allowed = allowed & ~groups_intersect(member[:, r0:r1, None], key_member)
    # gathered straight into [b, r, Hkv, S, D] (batched matmuls over (b, r, Hkv), no transposes)
    sample = torch.arange(b, device=k.device)[:, None, None, None]  # [b, 1, 1, 1]
    head = torch.arange(hkv, device=k.device)[None, None, :, None]  # [1, 1, Hkv, 1]
    rows = key[:, :, None, :]  # [b, r, 1, S]
    k_s = at_least_fp32(k[sample, rows, head])  # [b, r, Hkv, S, D]
    v_s = at_least_fp32(v[sample, rows, head])
    scores = torch.matmul(q5[:, r0:r1], k_s.transpose(-1, -2)) * scale  # [b, r, Hkv, G, S]
    scores = soft_cap(scores, softcap)
    scores = scores.masked_fill(~allowed[:, :, None, None], float("-inf"))
    weights, lse = softmax_with_lse(scores)  # [b, r, Hkv, G, S], [b, r, Hkv, G]
    part = torch.matmul(weights, v_s)  # [b, r, Hkv, G, D]
    return part, lse.reshape(b, r1 - r0, -1)  # [b, r, Hkv, G] -> [b, r, H]


def with_sinks(
    result: tuple[Tensor, Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    sinks: int,
    scale: float,
    softcap: float | None,
    member: Tensor | None = None,
    documents: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``result`` (the pattern's other parts, ``(out [b, n, H, D], lse [b, n, H])``) merged with
    the sink-only part of :func:`sink_attention` (each document's own sinks with ``documents``
    ``[b, n]`` document starts); ``result`` itself when that part is empty."""
    if not sinks or window + 1 >= q.shape[1]:  # every query reaches the sinks in its window
        return result
    extra = sink_attention(
        q,
        k,
        v,
        window=window,
        sinks=sinks,
        scale=scale,
        softcap=softcap,
        member=member,
        documents=documents,
    )
    return merge_by_lse(result, extra)
