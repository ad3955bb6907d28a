"""Ring context parallelism for Focus attention: K/V blocks travel, queries stay.

Forward: each rank keeps its queries and sends its K/V block (with the block's soft assignments
or hard memberships and its global positions) around the context-parallel ring; at every step
it attends the visiting block with the exact per-block Focus attention and merges the result by
log-sum-exp. The next block's transfer is started before the current block is computed
(overlapped communication).

**Block kernels** (``block_kernel``, :mod:`focus_pretrain.parallel.ring_kernels`): ``"flex"``
runs each step as one fused FlexAttention call whose block mask is built from the visiting
block's positions, memberships and document starts
(:func:`~focus_pretrain.parallel.ring_kernels.flex_attend_block`); ``"blockwise"`` runs
:func:`focus_pretrain.focus.reference.attend_block` (explicit positions, PyTorch) in query-row
chunks of at most :data:`SCORE_BUDGET` scores. Both give the same ``(out, lse)`` up to
rounding. ``"auto"`` (default) reads the backend table, as the model's ``auto`` does
(:func:`~focus_pretrain.focus.backends.select_ring_block`): ``"flex"`` on CUDA (compiled,
fp16/bf16/fp32) and ``"blockwise"`` elsewhere. The backward runs ``"flex"`` only on CUDA:
on CPU (no FlexAttention backward) it recomputes every block blockwise, also after an eager
``"flex"`` forward.
``"triton"`` (soft and sliding-window steps; a model with ``focus.backend: triton``) runs each
step, forward and backward, through the fused Triton kernels
(:func:`~focus_pretrain.parallel.ring_kernels.triton_attend_block`).

Backward is its own ring: the blocks travel again, now carrying accumulators for their
``dk, dv`` (and, where the gate applies, the gradient of their soft assignments). Each rank
recomputes its queries against the visiting block, takes the block's share of the merged
output's gradient (``d out_b = w_b d out`` and ``d lse_b = w_b <d out, out_b - out>`` with
``w_b = exp(lse_b - lse)``), adds its ``dk, dv`` into the travelling accumulators and keeps its
``dq``; after a full turn the accumulators are home.

A block with no allowed pair is skipped in both passes (decided exactly, from positions, group
bits and document starts, without an ``n x n`` test: :func:`block_has_pair`); :class:`RingStats`
counts them. Without documents that happens in hard and local-only mode and in sparse training
(``hard_gated``: the hard pattern's memberships, from the detached top-k, travel with the soft
assignments that the gate on its routed pairs reads and differentiates); with packed documents
also in soft mode, whenever no query of the block shares a document with an earlier key of the
visiting block (with short documents, most blocks).

Attention sinks need nothing of their own: positions are global, so the sink keys (global
positions ``< sinks``) are those of whichever rank holds the start of the sequence (rank 0's
first zigzag chunk, and the next ranks' when ``sinks`` is longer than a chunk); they travel the
ring with their block, and the per-block pattern allows them.

**Packed documents**: each rank passes its zigzag shard ``[b, s_loc]`` of the document *starts*
computed on the full sequence
(``shard_sequence(document_starts(ids), 1, CP, rank)``, :func:`~focus_pretrain.focus.pattern.
document_starts`): a start is a global position, so it means the same on every rank, while
per-shard ids could not be compared across ranks. The starts travel with their K/V block (like
the positions) and every per-block attention gets ``doc_q/doc_k``, so no pair crosses a document
and the sinks are each document's first ``sinks`` tokens.
Layout: ``[batch, seq_local, heads, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from focus_pretrain.focus import Routing
from focus_pretrain.focus.attention import check_documents, check_dtypes, raise_if_not_finite
from focus_pretrain.focus.backends import (
    AttentionPattern,
    AttentionRequest,
    BlockSide,
    differentiated,
)
from focus_pretrain.focus.lse import merge_by_lse
from focus_pretrain.focus.pattern import at_least_fp32
from focus_pretrain.focus.pattern_blocks import block_has_pair
from focus_pretrain.focus.pattern_settings import FocusPattern, with_settings
from focus_pretrain.focus.reference import attend_block
from focus_pretrain.parallel.ring_kernels import (
    RING_BLOCK_KERNELS,
    backward_block_kernel,
    resolve_block_kernel,
)
from focus_pretrain.parallel.sharding import zigzag_positions

SCORE_BUDGET = 1 << 26  # scores (fp32: 256 MiB) one ring step holds at a time
FUSED_KERNELS = {  # one call per step
    name: fn for name, fn in RING_BLOCK_KERNELS.items() if name != "blockwise"
}


@dataclass
class RingStats:
    """Ring steps computed and skipped (blocks with no allowed pair: hard or local-only mode,
    or packed documents), counted in the forward pass."""

    computed: int = 0
    skipped: int = 0


def _exchange(tensors: list[Tensor], group: dist.ProcessGroup) -> tuple[list, list[Tensor]]:
    """Start sending ``tensors`` to the next rank and receiving the previous rank's."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, group) for r in received]
    return dist.batch_isend_irecv(ops), received


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, probs, member, positions, docs, group, plan, stats):
        size = dist.get_world_size(group)
        gated = _gated(plan)  # the assignments travel and get gradients (soft, hard_gated)
        block = _block(k, v, positions, probs if gated else None, member, docs)
        out = lse = None
        computed = []  # per step: was the visiting block attended (backward skips the same)
        for step in range(size):
            requests, incoming = _exchange(block, group) if step < size - 1 else ([], None)
            result = _attend(q, probs, member, docs, positions, block, gated, plan, stats)
            computed.append(result is not None)
            if result is not None:
                out, lse = result if out is None else merge_by_lse((out, lse), result)
            _wait(requests)
            block = incoming
        if out is None:  # cannot happen: a rank's own block holds its diagonal
            raise RuntimeError("ring attention computed no block")
        ctx.save_for_backward(q, k, v, probs, member, positions, docs, out, lse)
        ctx.group, ctx.plan, ctx.gated, ctx.computed = group, plan, gated, computed
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, probs, member, positions, docs, out, lse = ctx.saved_tensors
        group, plan, gated = ctx.group, ctx.plan, ctx.gated
        size = dist.get_world_size(group)
        block = _block(k, v, positions, probs if gated else None, member, docs)
        grads = [torch.zeros_like(at_least_fp32(t)) for t in (k, v)]  # accumulators
        if gated:
            grads.append(torch.zeros_like(at_least_fp32(probs)))
        d_q = torch.zeros_like(at_least_fp32(q))
        d_probs = torch.zeros_like(grads[2]) if gated else None
        d_out = at_least_fp32(d_out)
        for step in range(size):
            requests, incoming = _exchange(block, group) if step < size - 1 else ([], None)
            if ctx.computed[step]:
                shares = _block_grads(
                    q, probs, member, docs, positions, block, gated, plan, out, lse, d_out
                )
                d_q += shares[0]
                for acc, g in zip(grads, shares[1:-1] if gated else shares[1:], strict=True):
                    acc += g
                if gated:
                    d_probs += shares[-1]
            if size > 1:  # the accumulators travel with their block; a full turn: home
                grad_requests, grads = _exchange(grads, group)
                _wait(grad_requests)
            _wait(requests)
            block = incoming
        d_k, d_v = grads[0].to(k.dtype), grads[1].to(v.dtype)
        d_p = (d_probs + grads[2]).to(probs.dtype) if gated else None
        return d_q.to(q.dtype), d_k, d_v, d_p, None, None, None, None, None, None


class RingPlan(NamedTuple):
    """What every ring step computes: the pattern's settings (``scale`` resolved; the blocks
    carry the tokens' data) and the per-block kernel's name."""

    pattern: AttentionPattern
    kernel: str


def _gated(plan: RingPlan) -> bool:
    """Whether the gate applies (soft, or hard_gated: sparse training), so that the soft
    assignments travel with their block and get gradients."""
    return plan.pattern.kind in ("soft", "hard_gated")


def _block(k, v, positions, probs, member, docs) -> list[Tensor]:
    """What travels the ring: K, V, positions, then those present of soft assignments,
    memberships and document starts (in that order)."""
    return [t for t in (k, v, positions, probs, member, docs) if t is not None]


def _unpack(block: list[Tensor], gated: bool, has_member: bool, has_docs: bool):
    """``(k, v, positions, probs, member, docs)`` of a block (``None`` where absent)."""
    k_b, v_b, pos_b, *rest = block
    probs_b = rest.pop(0) if gated else None
    member_b = rest.pop(0) if has_member else None
    docs_b = rest.pop(0) if has_docs else None
    return k_b, v_b, pos_b, probs_b, member_b, docs_b


def _row_chunks(q: Tensor, keys: int) -> list[slice]:
    """Query-row slices whose scores ``[b, H, rows, keys]`` stay within :data:`SCORE_BUDGET`."""
    b, n, h, _ = q.shape
    rows = max(1, SCORE_BUDGET // max(1, b * h * keys))
    return [slice(start, min(n, start + rows)) for start in range(0, n, rows)]


def _attend(q, probs, member, docs, positions, block, gated, plan, stats):
    """This rank's queries against one visiting block: ``(out, lse)`` or ``None`` (skipped)."""
    k_b, v_b, pos_b, probs_b, member_b, docs_b = _unpack(
        block, gated, member is not None, docs is not None
    )
    if not block_has_pair(
        positions, pos_b, plan.pattern.window, member_q=member, member_k=member_b,
        local_only=plan.pattern.local_only, sinks=plan.pattern.sinks, q_doc=docs,
    ):  # fmt: skip
        if stats is not None:
            stats.skipped += 1
        return None
    if stats is not None:
        stats.computed += 1
    pattern, keys = plan.pattern, BlockSide(pos_b, probs_b, member_b, docs_b)
    queries = BlockSide(positions, probs if gated else None, member, docs)
    if plan.kernel in FUSED_KERNELS:  # one fused call: no score memory to bound
        return FUSED_KERNELS[plan.kernel](q, k_b, v_b, pattern, queries, keys)
    outs, lses = [], []
    for rows in _row_chunks(q, k_b.shape[1]):  # bounded score memory, not a group loop
        out, lse = attend_block(q[:, rows], k_b, v_b, pattern, _rows(queries, rows), keys)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def _block_grads(q, probs, member, docs, positions, block, gated, plan, out, lse, d_out):
    """This rank's queries against one (attended) block: ``[dq, dk, dv]`` (gated: ``+
    [dprobs_k, dprobs_q]``), at least fp32; recomputed by the backward kernel
    (:func:`~focus_pretrain.parallel.ring_kernels.backward_block_kernel`), the gradient through
    the block's ``lse`` included."""
    k_b, v_b, pos_b, probs_b, member_b, docs_b = _unpack(
        block, gated, member is not None, docs is not None
    )
    kernel = backward_block_kernel(plan.kernel, q)
    fused = kernel in FUSED_KERNELS
    attend = FUSED_KERNELS.get(kernel, attend_block)
    d_q = torch.zeros_like(at_least_fp32(q))
    d_k, d_v = torch.zeros_like(at_least_fp32(k_b)), torch.zeros_like(at_least_fp32(v_b))
    d_pk = torch.zeros_like(at_least_fp32(probs_b)) if gated else None
    d_pq = torch.zeros_like(at_least_fp32(probs)) if gated else None
    for rows in [slice(None)] if fused else _row_chunks(q, k_b.shape[1]):
        leaves = [t.detach().requires_grad_(True) for t in (q[:, rows], k_b, v_b)]
        if gated:
            leaves += [probs_b.detach().requires_grad_(True), probs[:, rows].detach()]
            leaves[4].requires_grad_(True)
        queries = _rows(BlockSide(positions, None, member, docs), rows)._replace(
            probs=leaves[4] if gated else None
        )
        keys = BlockSide(pos_b, leaves[3] if gated else None, member_b, docs_b)
        with torch.enable_grad():
            out_b, lse_b = attend(*leaves[:3], plan.pattern, queries, keys)
            weight = torch.exp(lse_b - lse[:, rows])  # [b, rows, H]: the block's share
            grad_out = d_out[:, rows] * weight[..., None]
            mine = at_least_fp32(out_b) - at_least_fp32(out[:, rows])
            grad_lse = weight * (d_out[:, rows] * mine).sum(dim=-1)
            grads = torch.autograd.grad(
                (out_b, lse_b), leaves, (grad_out.to(out_b.dtype), grad_lse), allow_unused=True
            )
        grads = [None if g is None else at_least_fp32(g) for g in grads]
        d_q[:, rows] += grads[0]
        for acc, g in zip((d_k, d_v, d_pk), grads[1:4], strict=False):
            if acc is not None and g is not None:
                acc += g
        if gated and grads[4] is not None:
            d_pq[:, rows] += grads[4]
    return [d_q, d_k, d_v] + ([d_pk, d_pq] if gated else [])


def _rows(side: BlockSide, rows: slice) -> BlockSide:
    """The query side restricted to ``rows`` (``[Lq] -> [rows]``, ``[b, Lq, ...]`` likewise)."""
    return BlockSide(
        *(None if t is None else t[rows] if t.dim() == 1 else t[:, rows] for t in side)
    )


def ring_focus_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor | None,
    pattern: FocusPattern | None = None,
    *,
    group: dist.ProcessGroup,
    positions: Tensor | None = None,
    check_finite: bool = False,
    stats: RingStats | None = None,
    documents: Tensor | None = None,
    block_kernel: str = "auto",
    **settings: Any,
) -> Tensor:
    """Ring context parallelism: this rank's ``[b, s_loc, H, D]`` queries over all K/V.

    ``pattern`` and ``settings``: the pattern to compute, as for
    :func:`~focus_pretrain.focus.focus_attention` (a
    :class:`~focus_pretrain.focus.pattern_settings.FocusPattern`, any of its settings by
    name in place of its own; ``gate_form`` must be ``"sigmoid"``: the ``dot`` form is
    rewritten before, :func:`~focus_pretrain.parallel.context_parallel_attention`).
    ``positions`` ``[s_loc]``: global positions of this rank's tokens (default: the zigzag
    shard of :func:`~focus_pretrain.parallel.sharding.zigzag_positions`). Each block runs the
    exact per-block attention; ``check_finite`` rejects NaN/inf in this rank's inputs; mixed
    dtypes are refused as by :func:`~focus_pretrain.focus.attention.check_dtypes`. Sinks: the
    first ``sinks`` tokens of the sequence (of each document) are visible to every later
    query (of their document). ``documents``: ``[b, s_loc]`` integer document *starts* of
    this rank's tokens (its shard of ``document_starts`` of the full sequence), checked
    against ``positions`` (:func:`check_document_starts`); ``None``: one document.
    ``block_kernel``: ``"auto"``, ``"blockwise"``, ``"flex"`` or ``"triton"`` (soft and
    sliding-window steps), each step's kernel (see the module docstring;
    :func:`~focus_pretrain.parallel.ring_kernels.resolve_block_kernel`).
    """
    pattern = with_settings(pattern, settings, caller="ring_focus_attention")
    pattern.check()
    if pattern.gate_form != "sigmoid" and not pattern.local_only:
        raise ValueError(
            f"ring_focus_attention computes the sigmoid gate form, got gate_form="
            f"{pattern.gate_form!r}; call context_parallel_attention (it rewrites the dot form)"
        )
    if pattern.key_groups != "own" and not pattern.local_only:
        raise ValueError(
            f"ring_focus_attention computes key_groups='own' only, got "
            f"{pattern.key_groups!r} (a shard's first key needs the previous rank's last "
            f"token); use cp_mode 'a2a'"
        )
    mode, local_only = pattern.mode, pattern.local_only
    request = AttentionRequest.of(
        q, k, pattern, needs_grad=differentiated(q, k, v, probs), documents=documents is not None
    )
    kernel = resolve_block_kernel(block_kernel, q, request)
    if kernel == "triton" and mode in ("hard", "hard_gated") and not local_only:
        raise ValueError(
            f"block_kernel 'triton' runs soft and sliding-window steps, not {mode!r}; use "
            "'auto' (flex on CUDA) or 'blockwise'"
        )
    check_dtypes(q, k, v, None if local_only else probs)
    if documents is not None:
        documents = check_document_starts(documents, q)  # [b, s_loc] int64
    if check_finite:
        raise_if_not_finite(q=q, k=k, v=v, probs=None if local_only else probs)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if positions is None:
        positions = zigzag_positions(q.shape[1] * size, size, rank, device=q.device)
    if documents is not None:
        check_document_starts(documents, q, positions)
    member = None
    if local_only:
        probs = None
    elif mode in ("hard", "hard_gated"):  # the selection carries no gradient (the gate does)
        member = Routing(probs.detach()).membership(pattern.top_k)  # [b, s_loc]
    scale = pattern.scale_for(q.shape[-1])
    plan = RingPlan(AttentionPattern.of(replace(pattern, scale=scale)), kernel)
    gated = _gated(plan)
    return _RingAttention.apply(
        q, k, v, probs if gated else None, member, positions, documents, group, plan, stats,
    )  # fmt: skip


def check_document_starts(documents: Tensor, q: Tensor, positions: Tensor | None = None) -> Tensor:
    """Check this rank's document starts ``[b, s_loc]`` against ``q [b, s_loc, H, D]``; return
    them as int64.

    Raises ``ValueError`` on a shape other than ``[b, s_loc]``, a non-integer dtype or another
    device and, given this rank's global ``positions [s_loc]``, on values that cannot be starts
    of the full sequence: a start after its token, or, between neighbouring positions, a token
    that neither continues the previous token's document nor starts its own (what per-token
    document *ids*, or starts computed per shard, usually look like). A local check: it costs
    one device sync and no communication.
    """
    check_documents(documents, q, seq="seq_local", what="document starts of this rank")
    documents = documents.to(torch.int64)
    if positions is None:
        return documents
    pos = positions[None]  # [1, s_loc]
    bad = (documents < 0) | (documents > pos)  # [b, s_loc]
    follows = (positions[1:] == positions[:-1] + 1)[None]  # [1, s_loc - 1]: neighbours
    same = documents[:, 1:] == documents[:, :-1]
    own = documents[:, 1:] == pos[:, 1:]
    bad[:, 1:] |= follows & ~(same | own)
    if bool(bad.any()):
        raise ValueError(
            "documents must be the document starts of the full sequence (each token's global "
            "position of its document's first token: shard_sequence(document_starts(ids), 1, "
            "CP, rank)), not per-token ids or starts computed per shard; got values that "
            "cannot be starts at these positions"
        )
    return documents
