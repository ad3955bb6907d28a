"""The Focus pattern's rules as ``@triton.jit`` helpers: the Triton copy of
:mod:`focus_pretrain.focus.pattern`, shared by the forward and both backward kernels
(:mod:`~focus_pretrain.focus.soft_triton_kernels`).

* :func:`soft_cap` / :func:`soft_cap_grad`: logit soft-capping ``cap * tanh(raw / cap)`` and its
  derivative (:func:`~focus_pretrain.focus.pattern.soft_cap`).
* :func:`soft_gate` / :func:`soft_gate_grad`: the gate ``log sigmoid(lambda (a - 1/2))`` of an
  affinity ``a = g_i . g_j`` and its derivative in ``a``
  (:func:`~focus_pretrain.focus.pattern.soft_gate`).
* :func:`gate_weight`: the same gate as a weight, ``sigmoid(x) = exp(log sigmoid(x))`` (and
  ``1 - sigmoid(x)``, the derivative's factor): the kernels multiply a probability by it instead
  of adding the log to the score (one transcendental per pair, none with ``FAST`` tanh).
* :func:`tile_kind`: which rule a whole tile follows, from the positions and documents at its
  corners: every pair allowed and inside the window (``PLAIN``: no mask, no gate), every pair
  allowed, beyond the window and not a sink (``GATED``: the gate, no mask), or any other
  (``MASKED``: the per-pair rules).
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
def soft_cap(raw, cap, FAST: tl.constexpr = False):
    """``(cap * tanh(raw / cap), tanh(raw / cap))``: the capped score and the ``tanh`` its
    derivative needs (:func:`soft_cap_grad`); ``FAST``: the GPU's ``tanh`` (:func:`tanh`)."""
    th = tanh(raw / cap, FAST)
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


MASKED = tl.constexpr(0)
PLAIN = tl.constexpr(1)
GATED = tl.constexpr(2)


@triton.jit
def tanh(z, FAST: tl.constexpr):
    """``tanh(z)``: the GPU's one-instruction ``tanh.approx.f32`` when ``FAST`` (CUDA, half
    precision inputs: max relative error 2^-11), else ``1 - 2 / (exp(2z) + 1)``."""
    if FAST:
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=r,r", [z], dtype=tl.float32, is_pure=True, pack=1
        )
    return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)


@triton.jit
def gate_weight(affinity, lam, FAST: tl.constexpr):
    """``(sigmoid(x), 1 - sigmoid(x))`` with ``x = lam (affinity - 1/2)``: the soft gate as a
    weight, ``exp(soft_gate) = sigmoid(x)``, and ``1 - sigmoid(x)``, with which
    ``d soft_gate / d affinity = lam (1 - sigmoid(x))``. ``FAST``: ``(1 +- tanh(x / 2)) / 2``
    with the GPU's ``tanh``; else from ``exp(-x)``, accurate in relative terms for small
    weights."""
    x = lam * (affinity - 0.5)
    if FAST:
        th = tanh(0.5 * x, FAST)
        return 0.5 + 0.5 * th, 0.5 - 0.5 * th
    e = tl.exp(-x)  # inf for very negative x: weight 0, 1 - weight 1
    w = 1.0 / (1.0 + e)
    return w, tl.where(x > 0.0, e * w, 1.0 - w)


@triton.jit
def tile_kind(
    q_first,
    q_last,
    k_first,
    k_last,
    dq_first,
    dq_last,
    dk_first,
    dk_last,
    full,
    window,
    sinks,
    LOCAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """:data:`PLAIN`, :data:`GATED` or :data:`MASKED` for the tile of queries at
    positions ``q_first..q_last`` and keys at ``k_first..k_last`` (each side increasing;
    ``dq_*``, ``dk_*``: the document starts at the ends when ``HAS_DOCS``; ``full``: every row and
    column exists). Only :data:`MASKED` tiles need the per-pair rules of :func:`pair_masks`. In a
    sliding-window layer (``LOCAL``) a tile beyond the window is cut: :data:`MASKED` too."""
    causal = k_last <= q_first  # every pair causal
    first_key = k_first  # the first key's position inside its document
    uniform = full & causal
    if HAS_DOCS:  # one document
        uniform = uniform & (dq_first == dq_last) & (dk_first == dk_last) & (dq_first == dk_first)
        first_key = k_first - dk_first
    inside = q_last - k_first <= window
    beyond = (q_first - k_last > window) & (first_key >= sinks)
    if LOCAL:
        return tl.where(uniform & inside, PLAIN, MASKED)
    return tl.where(uniform & inside, PLAIN, tl.where(uniform & beyond, GATED, MASKED))


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
