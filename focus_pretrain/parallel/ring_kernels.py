"""The per-block attention of one ring step as one fused kernel: FlexAttention with a block mask.

The ring (:mod:`focus_pretrain.parallel.ring`) attends its queries to a visiting K/V block whose
tokens carry arbitrary increasing global positions (two zigzag chunks per rank), soft assignments
or hard memberships, and document starts. :func:`flex_attend_block` computes exactly what
:func:`focus_pretrain.focus.reference.attend_block` computes on the same inputs, ``(out, lse)``,
in one FlexAttention call:

* ``mask_mod`` reads the positions, memberships and document starts **by index**
  (``q_pos[b, q_idx]``, ``k_pos[b, kv_idx]``): causal (``k_pos <= q_pos``), one document, and
  the window, the sink keys (``k_pos - d_k < sinks``) or a shared group (hard mode);
* ``score_mod`` soft-caps and, in soft mode, adds the gate
  (:func:`~focus_pretrain.focus.pattern.soft_gate`) to pairs beyond the window that are not
  sinks, reading the assignments by index;
* the ``BlockMask`` keeps a (query block, key block) only when it may hold an allowed pair,
  decided from per-block summaries (``O(L / B)`` per block row, never ``L x L``): minimum and
  maximum positions, document-start ranges, the sinks' positions and documents and, in hard
  mode, per group the last query and the first key of the group. A block is *full* (no
  ``mask_mod``) when every pair is allowed: every key precedes every query, one document, and
  all within the window, all sink keys or one group common to every token.

Hard mode first sorts each side per sample by (document, membership), stably (positions stay
increasing inside a run), so that blocks are group- and document-tight and the same-group pairs
are block-sparse (as in the flex backend's group-sorted layout); positions are explicit, so the
mask is unchanged by the permutation, and the output is put back in the caller's order. Soft
and local-only blocks keep the positional order (the window is a band there).

On CUDA the call is compiled (Triton kernels that skip the blocks the mask leaves out) and
differentiable, the gradient through the returned ``lse`` included (FlexAttention differentiates
its log-sum-exp since PyTorch 2.5), so the ring's backward runs the same kernel. On CPU
FlexAttention runs eagerly, forward only (PyTorch has no CPU FlexAttention backward): the inputs
are detached, and the ring's backward recomputes its blocks with the blockwise kernel
(:func:`backward_block_kernel`).

Layout: ``[batch, seq, heads, head_dim]``; GQA query head ``h`` reads KV head
``h // (heads / heads_kv)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from focus_pretrain.focus import flex, soft_triton
from focus_pretrain.focus.backends import (
    AttentionPattern,
    AttentionRequest,
    BlockFn,
    BlockSide,
    differentiated,
    select_ring_block,
)
from focus_pretrain.focus.flex import DEFAULT_BLOCK, block_mask_from_predicates
from focus_pretrain.focus.flex_mods import gate_score_mod, softcap_mod
from focus_pretrain.focus.pattern import groups_intersect, member_bits, pair_rule
from focus_pretrain.focus.pattern_blocks import block_predicates, summarise_blocks
from focus_pretrain.focus.pattern_settings import FocusPattern
from focus_pretrain.focus.reference import attend_block


def ring_request(
    q: Tensor,
    k: Tensor | None = None,
    *,
    softcap: bool = False,
    documents: bool = False,
    needs_grad: bool | None = None,
    **settings: Any,
) -> AttentionRequest:
    """What one ring step asks of a block kernel: this rank's queries ``q`` ``[b, s_loc, H, D]``
    (and keys ``k``, default ``q``'s shape) under the pattern of ``settings``
    (:class:`~focus_pretrain.focus.pattern_settings.FocusPattern`'s by name); ``needs_grad``
    default: whether autograd will differentiate through ``q`` or ``k``."""
    k = q if k is None else k
    pattern = FocusPattern(softcap=1.0 if softcap else None, **settings)
    needs_grad = differentiated(q, k) if needs_grad is None else needs_grad
    return AttentionRequest.of(q, k, pattern, needs_grad=needs_grad, documents=documents)


def resolve_block_kernel(
    block_kernel: str, q: Tensor, request: AttentionRequest | None = None
) -> str:
    """The kernel of the ring's forward steps: ``"blockwise"``, ``"flex"`` or ``"triton"``.

    ``"auto"`` reads the backend table (:func:`~focus_pretrain.focus.backends.select_ring_block`
    on ``request``, default :func:`ring_request` of ``q``): the fused FlexAttention kernel where
    the ``flex`` backend is available (CUDA, fp16/bf16/fp32, Triton importable: compiled), else
    the reference's blockwise :func:`~focus_pretrain.focus.reference.attend_block`; ``triton``
    only by name. ``"flex"`` on CPU runs FlexAttention eagerly (exact, forward only: for
    tests)."""
    if block_kernel not in BLOCK_KERNELS:
        raise ValueError(f"block_kernel must be one of {BLOCK_KERNELS}, got {block_kernel!r}")
    if block_kernel == "triton" and not (
        soft_triton.runs_on(q.device.type, q.dtype) and soft_triton.supports(q.shape[-1])
    ):
        raise ValueError(
            f"block_kernel 'triton' cannot run {q.dtype} head dim {q.shape[-1]} on "
            f"{q.device.type}: it needs Triton (CUDA, or CPU under TRITON_INTERPRET=1) and a "
            f"head dim in {soft_triton.HEAD_DIMS}; use 'auto'"
        )
    if block_kernel != "auto":
        return block_kernel
    return select_ring_block(request if request is not None else ring_request(q))


def flex_backward_on(device: torch.device) -> bool:
    """Whether FlexAttention differentiates on ``device``: on CUDA. PyTorch refuses CPU inputs
    that require grad (tests that lift the refusal, to run its exact dense backward eagerly,
    patch this function too)."""
    return device.type == "cuda"


def backward_block_kernel(kernel: str, q: Tensor) -> str:
    """The kernel of the ring's backward steps: ``"triton"`` after a ``"triton"`` forward;
    ``"flex"`` only where FlexAttention has a backward (CUDA, :func:`flex_backward_on`); the
    blockwise recomputation otherwise, also when the forward ran ``"flex"`` eagerly on CPU (the
    same attention up to rounding, so the merged ``out, lse`` it uses agree)."""
    if kernel == "triton":
        return kernel
    return "flex" if kernel == "flex" and flex_backward_on(q.device) else "blockwise"


class _Side(NamedTuple):
    """One side (queries or keys) of a block in the kernel's token order.

    ``pos``: ``[L]`` (shared by the samples) or ``[b, L]`` global positions; ``member``,
    ``doc``: ``[b, L]`` or ``None``; ``order``: ``[b, L]``, the caller's index of each token
    (``None``: the caller's order)."""

    pos: Tensor
    member: Tensor | None
    doc: Tensor | None
    order: Tensor | None


class BlockPlan(NamedTuple):
    """The two sides in kernel order and the block predicates ``[B, nq, nk]`` bool: ``candidate``
    (may hold an allowed pair: kept) and ``full`` (every pair allowed: no ``mask_mod``)."""

    q: _Side
    k: _Side
    candidate: Tensor
    full: Tensor


def _take(t: Tensor, order: Tensor) -> Tensor:
    """``t [b, L, ...]`` in the token order ``order [b, L]`` (differentiable)."""
    index = order.reshape(*order.shape, *[1] * (t.dim() - 2))  # [b, L, 1, ...]
    return torch.take_along_dim(t, index, dim=1)


def _arrange(pos: Tensor, member: Tensor | None, doc: Tensor | None, sort: bool) -> _Side:
    """A side in kernel order: sorted per sample by (document, membership), stably, when
    ``sort`` (hard mode), else as given."""
    if not sort or member is None:
        return _Side(pos, member, doc, None)
    order = torch.sort(member, dim=1, stable=True).indices  # [b, L]
    if doc is not None:
        by_doc = torch.sort(doc.gather(1, order), dim=1, stable=True).indices
        order = order.gather(1, by_doc)  # [b, L]: by document, then membership, then position
    return _Side(
        pos[order],  # [b, L]
        member.gather(1, order),
        None if doc is None else doc.gather(1, order),
        order,
    )


def plan_block(
    q_pos: Tensor,
    k_pos: Tensor,
    member_q: Tensor | None,
    member_k: Tensor | None,
    doc_q: Tensor | None,
    doc_k: Tensor | None,
    *,
    kind: str,
    window: int,
    sinks: int,
    block: int = DEFAULT_BLOCK,
) -> BlockPlan:
    """The token order and block predicates of one block.

    Args:
        q_pos, k_pos: ``[Lq]``, ``[Lk]`` global positions.
        member_q, member_k: ``[b, Lq|Lk]`` int64 bitmasks (``kind="hard"``) or ``None``.
        doc_q, doc_k: ``[b, Lq|Lk]`` int64 document starts or ``None``.
        kind: ``"hard"`` (window, sinks or a shared group), ``"local"`` (window or sinks) or
            ``"causal"`` (every causal pair: soft mode).
    """
    sort = kind == "hard"
    q_side = _arrange(q_pos, member_q, doc_q, sort)
    k_side = _arrange(k_pos, member_k, doc_k, sort)
    groups = None
    if kind == "hard":
        used = member_bits(member_q).flatten(0, 1).any(0)  # [b, Lq, 64] -> [b * Lq, 64] -> [64]
        used = used | member_bits(member_k).flatten(0, 1).any(0)
        groups = used.nonzero().squeeze(1)  # [G] the group bits in use
    qs, ks = (
        summarise_blocks(side.pos, side.member, side.doc, block=block, sinks=sinks, groups=groups)
        for side in (q_side, k_side)
    )
    candidate, full = block_predicates(qs, ks, kind=kind, window=window, sinks=sinks)
    return BlockPlan(q_side, k_side, candidate, full)


def _at(t: Tensor, b: Tensor, idx: Tensor) -> Tensor:
    """``t[idx]`` of a shared ``[L]`` tensor, ``t[b, idx]`` of a per-sample ``[b, L]`` one."""
    return t[idx] if t.dim() == 1 else t[b, idx]


def _mask_mod(q: _Side, k: _Side, kind: str, window: int, sinks: int):
    """The allowed pairs of :func:`~focus_pretrain.focus.pattern.allowed_pairs`, by index."""

    def mask_mod(b, h, q_idx, kv_idx):
        docs = {} if q.doc is None else dict(q_doc=q.doc[b, q_idx], k_doc=k.doc[b, kv_idx])
        q_pos, k_pos = _at(q.pos, b, q_idx), _at(k.pos, b, kv_idx)
        causal, near = pair_rule(q_pos, k_pos, window=window, sinks=sinks, **docs)
        if kind == "causal":
            return causal
        if kind == "hard":
            near = near | groups_intersect(q.member[b, q_idx], k.member[b, kv_idx])
        return causal & near

    return mask_mod


class FusedCall(NamedTuple):
    """What one fused call runs: ``q [b, Lq, H, D]``, ``k, v [b, Lk, Hkv, D]`` in kernel order,
    the block mask (with its ``mask_mod``), the ``score_mod``, ``q_order [b, Lq]`` (the caller's
    index of each query; ``None``: the caller's order) and the :class:`BlockPlan`."""

    q: Tensor
    k: Tensor
    v: Tensor
    block_mask: BlockMask
    score_mod: object
    q_order: Tensor | None
    plan: BlockPlan


def fused_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: AttentionPattern,
    queries: BlockSide,
    keys: BlockSide,
    *,
    block: int = DEFAULT_BLOCK,
) -> FusedCall:
    """The FlexAttention call of :func:`flex_attend_block` (same arguments): inputs in kernel
    order, block mask and ``score_mod``."""
    if pattern.mode not in ("soft", "hard", "hard_gated"):
        raise ValueError(f"mode must be 'soft', 'hard' or 'hard_gated', got {pattern.mode!r}")
    hard = pattern.mode in ("hard", "hard_gated")
    routed = hard and queries.member is not None and keys.member is not None
    if pattern.mode == "hard_gated" and not routed and not pattern.local_only:
        raise ValueError("mode 'hard_gated' needs the memberships of queries and keys")
    kind = "local" if pattern.local_only else "hard" if routed else "causal"
    gated = pattern.mode in ("soft", "hard_gated") and not pattern.local_only
    probs_q, probs_k = queries.probs, keys.probs
    if gated and (probs_q is None or probs_k is None):
        raise ValueError(f"mode {pattern.mode!r} needs the soft assignments of queries and keys")
    doc_q, doc_k = (
        (None, None) if queries.doc is None or keys.doc is None else (queries.doc, keys.doc)
    )
    if not flex_backward_on(q.device):  # CPU FlexAttention refuses inputs that require grad
        q, k, v = q.detach(), k.detach(), v.detach()
        if gated:
            probs_q, probs_k = probs_q.detach(), probs_k.detach()
    window, sinks = pattern.window, pattern.sinks
    plan = plan_block(
        queries.pos, keys.pos, queries.member if routed else None,
        keys.member if routed else None, doc_q, doc_k, kind=kind, window=window, sinks=sinks,
        block=block,
    )  # fmt: skip
    if plan.q.order is not None:
        q = _take(q, plan.q.order)  # [b, Lq, H, D] in kernel order
    if plan.k.order is not None:
        k, v = _take(k, plan.k.order), _take(v, plan.k.order)  # [b, Lk, Hkv, D]
    mask_mod = _mask_mod(plan.q, plan.k, kind, window, sinks)
    score_mod = softcap_mod(pattern.softcap, q)
    if gated:  # the assignments in kernel order (hard_gated sorts the sides; soft keeps them)
        if plan.q.order is not None:
            probs_q = _take(probs_q, plan.q.order)  # [b, Lq, K]
        if plan.k.order is not None:
            probs_k = _take(probs_k, plan.k.order)  # [b, Lk, K]
        side_q, side_k = plan.q, plan.k
        score_mod = gate_score_mod(
            pattern, probs_q, probs_k, probs_q,
            q_pos=lambda b, i: _at(side_q.pos, b, i), k_pos=lambda b, i: _at(side_k.pos, b, i),
            k_doc=None if side_k.doc is None else lambda b, i: side_k.doc[b, i],
        )  # fmt: skip
    block_mask = block_mask_from_predicates(
        plan.candidate, plan.full, mask_mod, block, q.shape[1], k.shape[1]
    )
    return FusedCall(q, k, v, block_mask, score_mod, plan.q.order, plan)


def flex_attend_block(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: AttentionPattern,
    queries: BlockSide,
    keys: BlockSide,
    *,
    block: int = DEFAULT_BLOCK,
) -> tuple[Tensor, Tensor]:
    """:func:`~focus_pretrain.focus.reference.attend_block` (same arguments, same result up to
    rounding) in one FlexAttention call; ``block``: the block mask's block size.

    ``q [b, Lq, H, D]``, ``k, v [b, Lk, Hkv, D]``; the sides' positions may be any increasing
    positions. Returns ``(out [b, Lq, H, D] in q.dtype, lse [b, Lq, H] in at least fp32)``; a
    query with no allowed key gets ``out = 0``, ``lse = -inf``. Differentiable on CUDA
    (``lse`` included); on CPU the inputs are detached (eager FlexAttention is forward only).
    """
    call = fused_call(q, k, v, pattern, queries, keys, block=block)
    out, lse = flex._call(
        call.q, call.k, call.v, block_mask=call.block_mask, scale=pattern.scale,
        score_mod=call.score_mod,
    )  # fmt: skip  # [b, Lq, H, D], [b, Lq, H] (lse fp64 for fp64 inputs, as attend_block)
    if call.q_order is not None:  # back to the caller's order
        inverse = torch.argsort(call.q_order, dim=1)  # [b, Lq]
        out, lse = _take(out, inverse), _take(lse, inverse)
    return out, lse


def triton_attend_block(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: AttentionPattern,
    queries: BlockSide,
    keys: BlockSide,
) -> tuple[Tensor, Tensor]:
    """:func:`~focus_pretrain.focus.reference.attend_block` (same arguments, same result up to
    rounding) through the fused Triton kernels (:func:`focus_pretrain.focus.soft_triton.attend`
    with explicit positions): soft-gated or sliding-window steps, not the hard pattern.
    Differentiable, the gradient through ``lse`` included, so the ring's backward runs the same
    kernels. ``[b, L, H, D]`` layout; positions ``[L]`` or ``[b, L]``."""
    local = pattern.local_only
    if not local and pattern.mode != "soft":
        raise ValueError("block_kernel 'triton' runs soft and sliding-window steps; use 'auto'")
    return soft_triton.attend(
        q, k, v, None if local else queries.probs, None if local else keys.probs, pattern,
        doc_q=queries.doc, doc_k=keys.doc, pos_q=queries.pos, pos_k=keys.pos,
    )  # fmt: skip


# The ring step kernels by name (a backend's ``ring_block``, :mod:`focus_pretrain.focus.backends`):
# the reference's blockwise attention and the two fused ones; ``auto`` picks among them.
RING_BLOCK_KERNELS: dict[str, BlockFn] = {
    "blockwise": attend_block,
    "flex": flex_attend_block,
    "triton": triton_attend_block,
}
BLOCK_KERNELS = ("auto", *RING_BLOCK_KERNELS)
