"""The Focus pattern's rules as ``@triton.jit`` helpers: the Triton copy of
:mod:`focus_pretrain.focus.pattern`, shared by the forward and both backward kernels
(:mod:`~focus_pretrain.focus.soft_triton_kernels`).

* :func:`soft_cap` / :func:`soft_cap_grad`: logit soft-capping ``cap * tanh(raw / cap)`` and its
  derivative (:func:`~focus_pretrain.focus.pattern.soft_cap`).
* :func:`soft_gate` / :func:`soft_gate_grad`: the gate ``log sigmoid(lambda (a - 1/2))`` of an
  affinity ``a = g_i . g_j`` and its derivative in ``a``
  (:func:`~focus_pretrain.focus.pattern.soft_gate`).
* :func:`pair_masks`: which pairs of a tile are causal and in one document (``allowed``) and
  which are beyond the window and not a sink (``beyond``: gated in soft mode, cut in a
  sliding-window layer) (:func:`~focus_pretrain.focus.pattern.causal_and_local`).
* :func:`key_range` / :func:`query_range`: the tiles a query tile may see, and the tiles that
  may see a key tile, on one sequence (the block-level predicates of
  :mod:`~focus_pretrain.focus.pattern`, for contiguous tiles).

``tests/unit/test_soft_triton.py`` checks the helpers against the torch spec on random inputs
(under Triton's interpreter) besides the kernels against the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap(raw, cap):
    """``(cap * tanh(raw / cap), tanh(raw / cap))``: the capped score and the ``tanh`` its
    derivative needs (:func:`soft_cap_grad`)."""
    th = 1.0 - 2.0 / (tl.exp(2.0 * raw / cap) + 1.0)  # tanh(raw / cap), overflow-safe
    return cap * th, th


@triton.jit
def soft_cap_grad(th):
    """``d(cap * tanh(raw / cap)) / d raw`` from the ``tanh`` :func:`soft_cap` returned."""
    return 1.0 - th * th


@triton.jit
def soft_gate(affinity, lam):
    """``(log sigmoid(x), x)`` with ``x = lam (affinity - 1/2)``; ``log sigmoid(x) = min(x, 0) -
    log(1 + exp(-|x|))``, the formula of the torch spec."""
    x = lam * (affinity - 0.5)
    return tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x))), x


@triton.jit
def soft_gate_grad(x, lam):
    """``d log sigmoid(lam (a - 1/2)) / d a = lam sigmoid(-x)`` at ``x`` (:func:`soft_gate`)."""
    return lam * tl.sigmoid(-x)


@triton.jit
def pair_masks(pos_q, pos_k, rows, cols, doc_q, doc_k, window, sinks, HAS_DOCS: tl.constexpr):
    """``(allowed, beyond)`` ``[BM, BN]`` of the queries at ``pos_q [BM]`` and the keys at
    ``pos_k [BN]`` (``rows``/``cols``: which exist; ``doc_*``: document starts when
    ``HAS_DOCS``): ``allowed`` is causal and one document; ``beyond`` is past the window and not
    a sink (the first ``sinks`` keys of each document)."""
    allowed = (pos_k[None, :] <= pos_q[:, None]) & rows[:, None] & cols[None, :]
    key = pos_k  # the key's position inside its document
    if HAS_DOCS:
        allowed = allowed & (doc_q[:, None] == doc_k[None, :])
        key = pos_k - doc_k
    beyond = (pos_q[:, None] - pos_k[None, :] > window) & (key[None, :] >= sinks)
    return allowed, beyond


@triton.jit
def key_range(
    DOC_Q,
    pid_m,
    bi,
    LQ,
    LK,
    window,
    sinks,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_POS: tl.constexpr,
    LOCAL: tl.constexpr,
    PACKED: tl.constexpr,
):
    """``[lo, hi)``: the keys query tile ``pid_m`` (of ``BM`` queries, sample ``bi``) may see, in
    steps of ``BN``. With positions (``HAS_POS``: a ring step's chunks), all; on one sequence, up
    to its diagonal, from its first query's document start and, in a sliding-window layer
    without sinks, its window. ``PACKED`` (positions for the pair rule on one packed sequence
    whose document starts are indices, e.g. the group-sorted layout): the diagonal and the
    document start bound the range as on one sequence."""
    lo = pid_m * 0
    hi = LK + pid_m * 0
    if not HAS_POS:
        lo, hi = _index_key_range(DOC_Q, pid_m, bi, LQ, BM, BN, HAS_DOCS)
        if LOCAL:  # noqa: SIM102 (compile-time if, then run-time): no key before the window
            if sinks == 0:
                lo = tl.maximum(lo, tl.maximum(pid_m * BM - window, 0) // BN * BN)
    if PACKED:
        lo, hi = _index_key_range(DOC_Q, pid_m, bi, LQ, BM, BN, HAS_DOCS)
    return lo, hi


@triton.jit
def _index_key_range(
    DOC_Q, pid_m, bi, LQ, BM: tl.constexpr, BN: tl.constexpr, HAS_DOCS: tl.constexpr
):
    """:func:`key_range` by index: from the first query's document start to the diagonal."""
    lo = pid_m * 0
    hi = (pid_m + 1) * BM  # keys past Lk (last tile) are masked
    if HAS_DOCS:  # document starts never decrease: the first query's is the lowest
        lo = (tl.load(DOC_Q + bi * LQ + pid_m * BM).to(tl.int32) // BN) * BN
    return lo, hi


@triton.jit
def query_range(
    DOC_END,
    pid_n,
    bi,
    LQ,
    LK,
    window,
    sinks,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_POS: tl.constexpr,
    LOCAL: tl.constexpr,
    PACKED: tl.constexpr,
):
    """``[lo, hi)``: the queries that may see key tile ``pid_n`` (of ``BN`` keys, sample
    ``bi``), in steps of ``BM``. With positions, all (``PACKED``: as on one sequence); on one
    sequence, from its diagonal to its last key's document end (``DOC_END``: each token's next
    document start) and, in a sliding-window layer without sinks, its window."""
    lo = pid_n * 0
    hi = LQ + pid_n * 0
    if not HAS_POS:
        lo, hi = _index_query_range(DOC_END, pid_n, bi, LQ, LK, BM, BN, HAS_DOCS)
        if LOCAL:  # noqa: SIM102 (compile-time if, then run-time): none past the window
            if sinks == 0:
                hi = tl.minimum(hi, pid_n * BN + BN + window)
    if PACKED:
        lo, hi = _index_query_range(DOC_END, pid_n, bi, LQ, LK, BM, BN, HAS_DOCS)
    return lo, hi


@triton.jit
def _index_query_range(
    DOC_END, pid_n, bi, LQ, LK, BM: tl.constexpr, BN: tl.constexpr, HAS_DOCS: tl.constexpr
):
    """:func:`query_range` by index: from the diagonal to the last key's document end."""
    lo = (pid_n * BN // BM) * BM
    hi = LQ + pid_n * 0
    if HAS_DOCS:
        last = tl.minimum(pid_n * BN + BN, LK) - 1
        hi = tl.load(DOC_END + bi * LK + last).to(tl.int32)  # its document's end
    return lo, hi
