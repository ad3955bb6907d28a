"""The reference backend: exact, differentiable, blockwise; the yardstick for every other backend.

Queries are processed in blocks of ``q_block`` rows against all keys they may see (causal; only
the window, plus the sink keys, for local-only layers). Scores, the pattern bias and the softmax
are computed in fp32 (fp64 for fp64 inputs) from :mod:`focus_pretrain.focus.pattern`, so the
transient memory of a block is ``b * heads * q_block * seq`` and never ``seq^2`` per head. Under
autograd each block is activation-checkpointed: only the inputs are kept, and a block's scores
are recomputed in the backward pass, so memory kept for backward is linear in ``seq`` too.

Layout: ``[batch, seq, heads, head_dim]``; GQA query head ``h`` reads KV head
``h // (heads / heads_kv)`` (Megatron's and HuggingFace's convention).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from focus_pretrain.focus.backends import AttentionPattern, BlockSide
from focus_pretrain.focus.pattern import at_least_fp32, pair_bias, soft_cap

DEFAULT_Q_BLOCK = 128


def attend_block(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: AttentionPattern,
    queries: BlockSide,
    keys: BlockSide,
) -> tuple[Tensor, Tensor]:
    """Exact Focus attention of a block of queries on a block of keys.

    Args:
        q: ``[b, Lq, H, D]``; k, v: ``[b, Lk, Hkv, D]``.
        pattern: the pattern's parameters (window, mode, gate, soft-cap, scale, local-only,
            sinks); its tensors are not read.
        queries, keys: the two sides' positions ``[Lq]``, ``[Lk]``, soft assignments (soft
            mode), memberships (hard mode) and document starts
            (:class:`~focus_pretrain.focus.backends.BlockSide`).

    Returns:
        ``(out [b, Lq, H, D] in q.dtype, lse [b, Lq, H] in at least fp32)``; a query with no
        allowed key in this block gets ``out = 0`` and ``lse = -inf`` (blocks merge by
        log-sum-exp).
    """
    b, lq, h, d = q.shape
    hkv = k.shape[2]
    q5 = at_least_fp32(q).reshape(b, lq, hkv, h // hkv, d)  # [b, Lq, Hkv, G, D]
    scores = torch.einsum("bqhgd,bkhd->bhgqk", q5, at_least_fp32(k)) * pattern.scale
    scores = soft_cap(scores, pattern.softcap)
    bias = pair_bias(
        queries.pos, keys.pos, pattern.window, mode=pattern.mode, probs_q=queries.probs,
        probs_k=keys.probs, member_q=queries.member, member_k=keys.member,
        gate_lambda=pattern.gate_lambda, local_only=pattern.local_only, sinks=pattern.sinks,
        q_doc=queries.doc, k_doc=keys.doc,
    )  # fmt: skip  # [b|1, Lq, Lk]
    scores = scores + bias[:, None, None]  # broadcast over [Hkv, G]
    weights, lse = softmax_with_lse(scores)  # [b, Hkv, G, Lq, Lk], [b, Hkv, G, Lq]
    out = torch.einsum("bhgqk,bkhd->bqhgd", weights, at_least_fp32(v))  # [b, Lq, Hkv, G, D]
    out = out.reshape(b, lq, h, d)  # [b, Lq, H, D]
    lse = lse.permute(0, 3, 1, 2).reshape(b, lq, h)  # [b, Hkv, G, Lq] -> [b, Lq, H]
    return out.to(q.dtype), lse


def softmax_with_lse(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim of masked scores (``-inf`` = not allowed) and its log-sum-exp.

    A row with no allowed key gets all-zero weights and ``lse = -inf`` (so blocks merge by
    log-sum-exp), with zero, not NaN, gradients.
    """
    lse = _logsumexp(scores)
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite_lse[..., None]), lse


def _logsumexp(scores: Tensor) -> Tensor:
    """``torch.logsumexp`` over the last dim, except that a row with no allowed key gives
    ``-inf`` with a zero (not NaN) gradient, so that blocks in which some queries see nothing
    can be differentiated (the ring's per-block backward). Rows with keys are unchanged."""
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # [..., 1]
    lse = torch.logsumexp(torch.where(empty, torch.zeros_like(scores), scores), dim=-1)
    return torch.where(empty.squeeze(-1), torch.full_like(lse, float("-inf")), lse)


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, pattern: AttentionPattern, *, q_block: int = DEFAULT_Q_BLOCK
) -> tuple[Tensor, Tensor]:
    """Focus self-attention over a whole sequence, query block by query block.

    Args:
        q: ``[b, s, H, D]``; k, v: ``[b, s, Hkv, D]`` (validated by ``focus_attention``).
        pattern: what to compute (:class:`~focus_pretrain.focus.backends.AttentionPattern`:
            window, mode, sinks, documents, soft assignments or memberships, ...).
        q_block: rows per block (memory/speed trade-off; the result does not depend on it).

    Returns:
        ``(out [b, s, H, D], lse [b, s, H] fp32)``.
    """
    s = q.shape[1]
    positions = torch.arange(s, device=q.device)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, pattern.probs, pattern.key_probs)
    )
    outs, lses = [], []
    for start in range(0, s, q_block):
        end = min(s, start + q_block)
        keys = _block_keys(pattern, positions, start, end)
        args = _block_inputs(q, k, v, pattern, positions, start, end, keys)
        fn = partial(_attend_sides, pattern)
        if needs_grad:
            out, lse = checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            out, lse = fn(*args)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def _block_keys(pattern: AttentionPattern, positions: Tensor, start: int, end: int):
    """The keys the queries ``[start, end)`` may see: a slice of positions, or ``[Lk]`` indices
    (a local-only block's window plus the sinks before it)."""
    k_start = max(0, start - pattern.window) if pattern.local_only else 0
    if pattern.documents is not None and pattern.sinks:  # any earlier key may be a sink
        k_start = 0
    if min(pattern.sinks, k_start):
        return torch.cat([positions[: min(pattern.sinks, k_start)], positions[k_start:end]])
    return slice(k_start, end)


def _attend_sides(pattern: AttentionPattern, q, k, v, *sides: Tensor | None):
    """:func:`attend_block` with the two sides' tensors flat (``q_pos, probs, member, doc`` of
    the queries, then of the keys), as activation checkpointing passes them."""
    return attend_block(q, k, v, pattern, BlockSide(*sides[:4]), BlockSide(*sides[4:]))


def _block_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: AttentionPattern,
    positions: Tensor,
    start: int,
    end: int,
    keys,
) -> tuple[Tensor | None, ...]:
    """``q, k, v`` of the queries ``[start, end)`` and ``keys``, then the positions, soft
    assignments, memberships and document starts of each side (:func:`_attend_sides`)."""

    def key_rows(t: Tensor | None) -> Tensor | None:  # [b, s, ...] -> [b, Lk, ...]
        if t is None:
            return None
        return t[:, keys] if isinstance(keys, slice) else t.index_select(1, keys)

    def query_rows(t: Tensor | None) -> Tensor | None:  # [b, s, ...] -> [b, Lq, ...]
        return None if t is None else t[:, start:end]

    queries = (pattern.probs, pattern.member, pattern.documents)
    keys_side = (pattern.keys_probs, pattern.keys_member, pattern.documents)  # key_groups
    return (
        q[:, start:end],
        key_rows(k),
        key_rows(v),
        positions[start:end],
        *(query_rows(t) for t in queries),
        positions[keys],
        *(key_rows(t) for t in keys_side),
    )
