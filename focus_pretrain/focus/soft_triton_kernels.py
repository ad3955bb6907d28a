"""Triton kernels of the soft-gated training attention (forward, and the two backward passes).

FlashAttention-2's tiling (online softmax over key blocks; the backward split into a pass per
key block for ``dK, dV`` and a pass per query block for ``dQ``) with the Focus gate computed in
the tile: for the ``[BM, BN]`` tile of queries ``i`` and keys ``j``

    a_ij  = g_i . g_j                        (tl.dot of the [BM, KP] and [BN, KP] assignments)
    t_ij  = softcap(scale q_i . k_j) + [gated_ij] gate(a_ij),   gated: i - j > window
                                                                 and j is not a sink

(``softcap`` and ``gate``: the rules of :mod:`~focus_pretrain.focus.pattern_triton`, the Triton
copy of :mod:`~focus_pretrain.focus.pattern`) and in the backward ``dA_ij = dT_ij [gated_ij]
gate'(a_ij)``, reduced on tensor cores
into ``dG_q = dA G_k`` (the dQ pass) and ``dG_k = dA^T G_q`` (the dK/dV pass). Nothing
``Lq x Lk`` is stored and nothing is reduced with atomics: the assignment gradients are written
per head and summed by the caller. ``LOCAL`` (a sliding-window layer) drops the gate and cuts
the pairs beyond the window instead.

Positions: without ``HAS_POS`` queries and keys are one sequence (``i``, ``j`` are the indices,
``Lq = Lk``) and the loops visit only the key blocks a query block may see (causal, its
document, its window); with ``HAS_POS`` each side carries global positions (``[b, L]`` int64,
batch stride 0 when shared; a ring step's zigzag chunks) and every block is visited, masked.

Layouts: ``q, dq [b, Lq, H, D]``, ``k, v, dk, dv [b, Lk, Hkv, D]`` (dK/dV contiguous),
assignments ``g_q [b, Lq, KP]`` and ``g_k [b, Lk, KP]`` fp32 contiguous (``K`` groups
zero-padded to ``KP``), ``lse, delta [b, H, Lq]`` fp32, document starts ``[b, L]`` int64 and,
without positions, document ends (the next document's start). GQA: query head ``h`` reads KV
head ``h // GROUP``; the dK/dV pass loops over the ``GROUP`` query heads of its KV head.

Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is imported) runs these kernels on
CPU tensors with NumPy: that is how the CPU test suite checks them against the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

from focus_pretrain.focus.pattern_triton import (
    key_range,
    pair_masks,
    query_range,
    soft_cap,
    soft_cap_grad,
    soft_gate,
    soft_gate_grad,
)

LOG2E = tl.constexpr(1.4426950408889634)  # compiled kernels read only constexpr globals
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tile(
    q,
    k,
    g_q,
    g_k,
    pos_q,
    pos_k,
    rows,
    cols,
    doc_q,
    doc_k,
    scale,
    lam,
    window,
    sinks,
    cap,
    HAS_DOCS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LOCAL: tl.constexpr,
    QK_PREC: tl.constexpr,
    GATE_PREC: tl.constexpr,
):
    """Scores of a ``[BM, BN]`` tile: ``(t, allowed, gated, x, tanh)`` (``t`` natural units,
    not masked; ``tanh`` is the soft-cap's, for its derivative). ``LOCAL``: a sliding-window
    layer: pairs beyond the window (sinks excepted) are not allowed, and there is no gate."""
    raw = tl.dot(q, tl.trans(k), input_precision=QK_PREC) * scale  # [BM, BN] fp32
    th = raw
    if SOFTCAP:
        raw, th = soft_cap(raw, cap)
    allowed, beyond = pair_masks(pos_q, pos_k, rows, cols, doc_q, doc_k, window, sinks, HAS_DOCS)
    if LOCAL:
        return raw, allowed & ~beyond, beyond, raw, th  # (no gate: beyond and x unused)
    affinity = tl.dot(g_q, tl.trans(g_k), input_precision=GATE_PREC)  # [BM, BN]
    gate, x = soft_gate(affinity, lam)
    return raw + tl.where(beyond, gate, 0.0), allowed, beyond, x, th


@triton.jit
def _tile_grads(
    q,
    k,
    v,
    do,
    g_q,
    g_k,
    pos_q,
    pos_k,
    rows,
    cols,
    doc_q,
    doc_k,
    lse,
    delta,
    scale,
    lam,
    window,
    sinks,
    cap,
    HAS_DOCS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LOCAL: tl.constexpr,
    QK_PREC: tl.constexpr,
    GATE_PREC: tl.constexpr,
):
    """The backward of a ``[BM, BN]`` tile, shared by both backward passes: ``(p, ds,
    d_aff)``, the probabilities, the gradient of the raw (pre-cap) score and the gradient of the
    affinity ``g_i . g_j`` (zeros when ``LOCAL``)."""
    t, allowed, gated, x, th = _tile(
        q, k, g_q, g_k, pos_q, pos_k, rows, cols, doc_q, doc_k, scale, lam, window, sinks,
        cap, HAS_DOCS, SOFTCAP, LOCAL, QK_PREC, GATE_PREC,
    )  # fmt: skip
    p = tl.where(allowed, tl.exp2(t * LOG2E - lse[:, None] * LOG2E), 0.0)  # [BM, BN]
    dp = tl.dot(do, tl.trans(v), input_precision=QK_PREC)  # [BM, BN]
    ds = p * (dp - delta[:, None])  # gradient of the score t
    d_aff = tl.zeros_like(ds)
    if not LOCAL:
        d_aff = tl.where(gated & allowed, ds * soft_gate_grad(x, lam), 0.0)
    if SOFTCAP:
        ds = ds * soft_cap_grad(th)
    return p, ds, d_aff


@triton.jit
def _side(
    G,
    DOC,
    POS,
    stride_pos_b,
    bi,
    offs,
    mask,
    length,
    ROWS: tl.constexpr,
    KP: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_POS: tl.constexpr,
    LOCAL: tl.constexpr,
):
    """One side's per-token data for ``ROWS`` tokens at ``offs`` of sample ``bi``: ``(g [ROWS,
    KP] fp32 (zeros when LOCAL), positions, document starts)``."""
    g = tl.zeros([ROWS, KP], dtype=tl.float32)
    if not LOCAL:
        offs_g = tl.arange(0, KP)
        g = tl.load(
            G + (bi * length + offs)[:, None] * KP + offs_g[None, :], mask=mask[:, None], other=0.0
        )
    pos = offs
    if HAS_POS:
        pos = tl.load(POS + bi * stride_pos_b + offs, mask=mask, other=0)
    doc = offs
    if HAS_DOCS:
        doc = tl.load(DOC + bi * length + offs, mask=mask, other=-1)
    return g, pos, doc


@triton.jit
def _rows(PTR, bi, offs, h, stride_b, stride_n, stride_h, offs_d, mask):
    """The ``[rows, D]`` tile of head ``h`` at tokens ``offs`` of sample ``bi`` (0 where masked)."""
    ptrs = PTR + bi * stride_b + offs[:, None] * stride_n + h * stride_h + offs_d[None, :]
    return tl.load(ptrs, mask=mask[:, None], other=0.0)


@triton.jit
def soft_forward_kernel(  # pointers, strides, sizes and scalars, compile-time switches
    Q, K, V, G_Q, G_K, DOC_Q, DOC_K, POS_Q, POS_K, OUT, LSE,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
    stride_vh, stride_ob, stride_on, stride_oh, stride_pqb, stride_pkb,
    LQ, LK, H, GROUP, scale, lam, window, sinks, cap,
    D: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_DOCS: tl.constexpr,
    HAS_POS: tl.constexpr, SOFTCAP: tl.constexpr, LOCAL: tl.constexpr, QK_PREC: tl.constexpr,
    GATE_PREC: tl.constexpr, PACKED: tl.constexpr,
):  # fmt: skip
    """One program: ``BM`` queries of one (sample, head) against the key blocks they may see.
    Grid ``(cdiv(Lq, BM), b * H)``."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    bi = bh // H
    h = bh % H
    hk = h // GROUP
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    rows = offs_m < LQ
    q = _rows(Q, bi, offs_m, h, stride_qb, stride_qn, stride_qh, offs_d, rows)
    g_q, pos_q, doc_q = _side(
        G_Q, DOC_Q, POS_Q, stride_pqb, bi, offs_m, rows, LQ, BM, KP, HAS_DOCS, HAS_POS, LOCAL
    )
    lo, hi = key_range(
        DOC_Q, pid_m, bi, LQ, LK, window, sinks, BM, BN, HAS_DOCS, HAS_POS, LOCAL, PACKED
    )
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)  # running max, base 2
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    for start_n in range(lo, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        cols = offs_n < LK
        k = _rows(K, bi, offs_n, hk, stride_kb, stride_kn, stride_kh, offs_d, cols)
        v = _rows(V, bi, offs_n, hk, stride_vb, stride_vn, stride_vh, offs_d, cols)
        g_k, pos_k, doc_k = _side(
            G_K, DOC_K, POS_K, stride_pkb, bi, offs_n, cols, LK, BN, KP, HAS_DOCS, HAS_POS, LOCAL
        )
        t, allowed, _, _, _ = _tile(
            q, k, g_q, g_k, pos_q, pos_k, rows, cols, doc_q, doc_k, scale, lam, window, sinks,
            cap, HAS_DOCS, SOFTCAP, LOCAL, QK_PREC, GATE_PREC,
        )  # fmt: skip
        t2 = tl.where(allowed, t * LOG2E, float("-inf"))  # [BM, BN] base 2
        m_new = tl.maximum(m_i, tl.max(t2, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(t2 - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=QK_PREC)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]  # a query with no allowed key: 0
    lse = (m_i + tl.log2(l_safe)) * LN2  # natural log-sum-exp; -inf without an allowed key
    tl.store(
        OUT + bi * stride_ob + offs_m[:, None] * stride_on + h * stride_oh + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=rows[:, None],
    )
    tl.store(LSE + bh * LQ + offs_m, lse, mask=rows)


@triton.jit
def soft_backward_kv_kernel(  # pointers, strides, sizes and scalars, compile-time switches
    Q, K, V, G_Q, G_K, DOC_Q, DOC_K, DOC_END, POS_Q, POS_K, DO, LSE, DELTA, DK, DV, DG_K,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
    stride_vh, stride_pqb, stride_pkb,
    LQ, LK, H, HKV, GROUP, scale, lam, window, sinks, cap,
    D: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_DOCS: tl.constexpr,
    HAS_POS: tl.constexpr, SOFTCAP: tl.constexpr, LOCAL: tl.constexpr, QK_PREC: tl.constexpr,
    GATE_PREC: tl.constexpr, PACKED: tl.constexpr,
):  # fmt: skip
    """One program: ``BN`` keys of one (sample, KV head) against the query blocks that may see
    them, for each of the ``GROUP`` query heads: ``dK, dV [b, Lk, Hkv, D]`` (contiguous; ``dO``
    has ``q``'s strides) and the key-side assignment gradient ``dG_k [b, Hkv, Lk, KP]``. Grid
    ``(cdiv(Lk, BN), b * Hkv)``."""
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    bi = bhk // HKV
    hk = bhk % HKV
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    cols = offs_n < LK
    k = _rows(K, bi, offs_n, hk, stride_kb, stride_kn, stride_kh, offs_d, cols)
    v = _rows(V, bi, offs_n, hk, stride_vb, stride_vn, stride_vh, offs_d, cols)
    g_k, pos_k, doc_k = _side(
        G_K, DOC_K, POS_K, stride_pkb, bi, offs_n, cols, LK, BN, KP, HAS_DOCS, HAS_POS, LOCAL
    )
    lo, hi = query_range(
        DOC_END, pid_n, bi, LQ, LK, window, sinks, BM, BN, HAS_DOCS, HAS_POS, LOCAL, PACKED
    )
    dk = tl.zeros([BN, D], dtype=tl.float32)
    dv = tl.zeros([BN, D], dtype=tl.float32)
    dg_k = tl.zeros([BN, KP], dtype=tl.float32)
    for hh in range(0, GROUP):
        h = hk * GROUP + hh
        bh = bi * H + h
        for start_m in range(lo, hi, BM):
            offs_m = start_m + tl.arange(0, BM)
            rows = offs_m < LQ
            q_rows = bi * stride_qb + offs_m[:, None] * stride_qn + h * stride_qh + offs_d[None, :]
            q = tl.load(Q + q_rows, mask=rows[:, None], other=0.0)
            do = tl.load(DO + q_rows, mask=rows[:, None], other=0.0)
            g_q, pos_q, doc_q = _side(
                G_Q, DOC_Q, POS_Q, stride_pqb, bi, offs_m, rows, LQ, BM, KP, HAS_DOCS, HAS_POS,
                LOCAL,
            )  # fmt: skip
            lse = tl.load(LSE + bh * LQ + offs_m, mask=rows, other=0.0)
            delta = tl.load(DELTA + bh * LQ + offs_m, mask=rows, other=0.0)
            p, ds, d_aff = _tile_grads(
                q, k, v, do, g_q, g_k, pos_q, pos_k, rows, cols, doc_q, doc_k, lse, delta,
                scale, lam, window, sinks, cap, HAS_DOCS, SOFTCAP, LOCAL, QK_PREC, GATE_PREC,
            )  # fmt: skip
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=QK_PREC)
            if not LOCAL:
                dg_k += tl.dot(tl.trans(d_aff), g_q, input_precision=GATE_PREC)  # [BN, KP]
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=QK_PREC)
    kv_rows = ((bi * LK + offs_n) * HKV + hk)[:, None] * D + offs_d[None, :]  # [b, Lk, Hkv, D]
    tl.store(DK + kv_rows, (dk * scale).to(DK.dtype.element_ty), mask=cols[:, None])
    tl.store(DV + kv_rows, dv.to(DV.dtype.element_ty), mask=cols[:, None])
    if not LOCAL:
        offs_g = tl.arange(0, KP)
        dg_rows = (bhk * LK + offs_n)[:, None] * KP + offs_g[None, :]  # [b, Hkv, Lk, KP]
        tl.store(DG_K + dg_rows, dg_k, mask=cols[:, None])


@triton.jit
def soft_backward_q_kernel(  # pointers, strides, sizes and scalars, compile-time switches
    Q, K, V, G_Q, G_K, DOC_Q, DOC_K, POS_Q, POS_K, DO, LSE, DELTA, DQ, DG_Q,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
    stride_vh, stride_pqb, stride_pkb,
    LQ, LK, H, GROUP, scale, lam, window, sinks, cap,
    D: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_DOCS: tl.constexpr,
    HAS_POS: tl.constexpr, SOFTCAP: tl.constexpr, LOCAL: tl.constexpr, QK_PREC: tl.constexpr,
    GATE_PREC: tl.constexpr, PACKED: tl.constexpr,
):  # fmt: skip
    """One program: ``BM`` queries of one (sample, head): ``dQ [b, Lq, H, D]`` (``q``'s
    strides) and the query-side assignment gradient ``dG_q [b, H, Lq, KP]``. Grid
    ``(cdiv(Lq, BM), b * H)``."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    bi = bh // H
    h = bh % H
    hk = h // GROUP
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    rows = offs_m < LQ
    q_rows = bi * stride_qb + offs_m[:, None] * stride_qn + h * stride_qh + offs_d[None, :]
    q = tl.load(Q + q_rows, mask=rows[:, None], other=0.0)
    do = tl.load(DO + q_rows, mask=rows[:, None], other=0.0)
    g_q, pos_q, doc_q = _side(
        G_Q, DOC_Q, POS_Q, stride_pqb, bi, offs_m, rows, LQ, BM, KP, HAS_DOCS, HAS_POS, LOCAL
    )
    lse = tl.load(LSE + bh * LQ + offs_m, mask=rows, other=0.0)
    delta = tl.load(DELTA + bh * LQ + offs_m, mask=rows, other=0.0)
    lo, hi = key_range(
        DOC_Q, pid_m, bi, LQ, LK, window, sinks, BM, BN, HAS_DOCS, HAS_POS, LOCAL, PACKED
    )
    dq = tl.zeros([BM, D], dtype=tl.float32)
    dg_q = tl.zeros([BM, KP], dtype=tl.float32)
    for start_n in range(lo, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        cols = offs_n < LK
        k = _rows(K, bi, offs_n, hk, stride_kb, stride_kn, stride_kh, offs_d, cols)
        v = _rows(V, bi, offs_n, hk, stride_vb, stride_vn, stride_vh, offs_d, cols)
        g_k, pos_k, doc_k = _side(
            G_K, DOC_K, POS_K, stride_pkb, bi, offs_n, cols, LK, BN, KP, HAS_DOCS, HAS_POS, LOCAL
        )
        _, ds, d_aff = _tile_grads(
            q, k, v, do, g_q, g_k, pos_q, pos_k, rows, cols, doc_q, doc_k, lse, delta, scale,
            lam, window, sinks, cap, HAS_DOCS, SOFTCAP, LOCAL, QK_PREC, GATE_PREC,
        )  # fmt: skip
        if not LOCAL:
            dg_q += tl.dot(d_aff, g_k, input_precision=GATE_PREC)  # [BM, KP]
        dq += tl.dot(ds.to(k.dtype), k, input_precision=QK_PREC)
    tl.store(DQ + q_rows, (dq * scale).to(DQ.dtype.element_ty), mask=rows[:, None])
    if not LOCAL:
        offs_g = tl.arange(0, KP)
        dg_rows = (bh * LQ + offs_m)[:, None] * KP + offs_g[None, :]  # [b, H, Lq, KP]
        tl.store(DG_Q + dg_rows, dg_q, mask=rows[:, None])
