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
    GATED,
    PLAIN,
    gate_weight,
    key_range,
    pair_masks,
    query_range,
    soft_cap,
    soft_cap_grad,
    tile_kind,
)

LOG2E = tl.constexpr(1.4426950408889634)  # compiled kernels read only constexpr globals
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _scores(q, k, scale, cap, SOFTCAP: tl.constexpr, QK_PREC: tl.constexpr, FAST: tl.constexpr):
    """``(s, th)``: the ``[BM, BN]`` scores in base 2 (``log2 e`` times the natural ones, capped
    when ``SOFTCAP``) and the soft-cap's ``tanh`` for its derivative (``s`` itself otherwise)."""
    raw = tl.dot(q, tl.trans(k), input_precision=QK_PREC)  # [BM, BN] fp32
    if SOFTCAP:
        capped, th = soft_cap(raw * scale, cap, FAST)
        return capped * LOG2E, th
    return raw * (scale * LOG2E), raw


@triton.jit
def _corners(POS, DOC, stride_pos_b, bi, first, length, B: tl.constexpr, HAS_POS: tl.constexpr,
             HAS_DOCS: tl.constexpr):  # fmt: skip
    """Positions and document starts (int32) of the first and last existing token of the ``B``
    tokens from ``first`` of sample ``bi``: ``(pos_first, pos_last, doc_first, doc_last)``."""
    last = tl.minimum(first + B, length) - 1
    p0 = first
    p1 = last
    if HAS_POS:
        p0 = tl.load(POS + bi * stride_pos_b + first).to(tl.int32)
        p1 = tl.load(POS + bi * stride_pos_b + last).to(tl.int32)
    d0 = first * 0
    d1 = d0
    if HAS_DOCS:
        d0 = tl.load(DOC + bi * length + first).to(tl.int32)
        d1 = tl.load(DOC + bi * length + last).to(tl.int32)
    return p0, p1, d0, d1


@triton.jit
def _rule_side(DOC, POS, stride_pos_b, bi, offs, mask, length, HAS_DOCS: tl.constexpr,
               HAS_POS: tl.constexpr):  # fmt: skip
    """Positions and document starts (int32) of the tokens at ``offs`` of sample ``bi``."""
    pos = offs
    if HAS_POS:
        pos = tl.load(POS + bi * stride_pos_b + offs, mask=mask, other=0).to(tl.int32)
    doc = offs
    if HAS_DOCS:
        doc = tl.load(DOC + bi * length + offs, mask=mask, other=-1).to(tl.int32)
    return pos, doc


@triton.jit
def _table(T, bi, offs, mask, length, W: tl.constexpr):
    """Rows ``offs`` of sample ``bi`` of a ``[b, length, W]`` per-token table (0 where masked)."""
    cols = tl.arange(0, W)
    return tl.load(T + (bi * length + offs)[:, None] * W + cols[None, :], mask=mask[:, None],
                   other=0.0)  # fmt: skip


@triton.jit
def _rows(PTR, bi, offs, h, stride_b, stride_n, stride_h, offs_d, mask):
    """The ``[rows, D]`` tile of head ``h`` at tokens ``offs`` of sample ``bi`` (0 where masked)."""
    ptrs = PTR + bi * stride_b + offs[:, None] * stride_n + h * stride_h + offs_d[None, :]
    return tl.load(ptrs, mask=mask[:, None], other=0.0)


@triton.jit
def _tile_masks(DOC_Q, DOC_K, POS_Q, POS_K, stride_pqb, stride_pkb, bi, offs_m, offs_n, rows,
                cols, LQ, LK, window, sinks, HAS_DOCS: tl.constexpr, HAS_POS: tl.constexpr,
                LOCAL: tl.constexpr):  # fmt: skip
    """``(allowed, gated)`` ``[BM, BN]`` of a :data:`MASKED` tile: ``gated`` is beyond the window
    and not a sink (the gate's pairs); a sliding-window layer (``LOCAL``) cuts those instead."""
    pos_q, doc_q = _rule_side(DOC_Q, POS_Q, stride_pqb, bi, offs_m, rows, LQ, HAS_DOCS, HAS_POS)
    pos_k, doc_k = _rule_side(DOC_K, POS_K, stride_pkb, bi, offs_n, cols, LK, HAS_DOCS, HAS_POS)
    allowed, beyond = pair_masks(pos_q, pos_k, rows, cols, doc_q, doc_k, window, sinks, HAS_DOCS)
    if LOCAL:
        return allowed & ~beyond, beyond  # (no gate: the second is unused)
    return allowed, beyond & allowed


@triton.jit
def _tile_rule(
    s, w, w_rest, kind, lam, DOC_Q, DOC_K, POS_Q, POS_K, stride_pqb, stride_pkb, bi, offs_m,
    offs_n, rows, cols, LQ, LK, window, sinks, HAS_DOCS: tl.constexpr, HAS_POS: tl.constexpr,
    LOCAL: tl.constexpr, KEYS_FIRST: tl.constexpr,
):  # fmt: skip
    """The pattern's rule on a tile of kind ``kind``, shared by the three kernels: ``(s,
    weight, d_gate)``, the scores with disallowed pairs at ``-inf``, each pair's gate weight
    (``w`` where gated, else 1) and ``d t / d affinity`` (``lam (1 - w)`` where gated, else 0);
    ``[BM, BN]``, or ``[BN, BM]`` with ``KEYS_FIRST``. Only a :data:`MASKED` tile reads the
    per-pair rules (one branch per kind: Triton 3.6's pipeliner failed a dQ kernel that had the
    backward's code in each branch)."""
    weight = s * 0.0 + 1.0  # PLAIN: every pair allowed and ungated
    d_gate = s * 0.0
    if kind == GATED:  # every pair allowed and gated
        weight = w
        d_gate = lam * w_rest
    elif kind != PLAIN:
        allowed, gated = _tile_masks(
            DOC_Q, DOC_K, POS_Q, POS_K, stride_pqb, stride_pkb, bi, offs_m, offs_n, rows,
            cols, LQ, LK, window, sinks, HAS_DOCS, HAS_POS, LOCAL,
        )  # fmt: skip  # [BM, BN]: transposed below (boundary tiles only)
        if KEYS_FIRST:
            allowed = tl.trans(allowed)
            gated = tl.trans(gated)
        s = tl.where(allowed, s, float("-inf"))
        if not LOCAL:
            weight = tl.where(gated, w, 1.0)
            d_gate = tl.where(gated, lam * w_rest, 0.0)
    return s, weight, d_gate


@triton.jit
def soft_forward_kernel(  # pointers, strides, sizes and scalars, compile-time switches
    Q, K, V, A_Q, A_K, DOC_Q, DOC_K, POS_Q, POS_K, OUT, LSE,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
    stride_vh, stride_ob, stride_on, stride_oh, stride_pqb, stride_pkb,
    LQ, LK, H, GROUP, scale, lam, window, sinks, cap,
    D: tl.constexpr, KA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_DOCS: tl.constexpr, HAS_POS: tl.constexpr, SOFTCAP: tl.constexpr, LOCAL: tl.constexpr,
    QK_PREC: tl.constexpr, FAST: tl.constexpr, PACKED: tl.constexpr,
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
    a_q = tl.zeros([BM, KA], dtype=tl.float16)
    if not LOCAL:
        a_q = _table(A_Q, bi, offs_m, rows, LQ, KA)
    qp0, qp1, qd0, qd1 = _corners(POS_Q, DOC_Q, stride_pqb, bi, pid_m * BM, LQ, BM, HAS_POS,
                                  HAS_DOCS)  # fmt: skip
    rows_full = pid_m * BM + BM <= LQ
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
        s, _ = _scores(q, k, scale, cap, SOFTCAP, QK_PREC, FAST)  # [BM, BN] base 2
        w = s  # the gate's weights (a placeholder when LOCAL)
        if not LOCAL:
            a_k = _table(A_K, bi, offs_n, cols, LK, KA)
            affinity = tl.dot(a_q, tl.trans(a_k))  # [BM, BN] fp32 (split fp16 tables)
            w, _ = gate_weight(affinity, lam, FAST)
        kp0, kp1, kd0, kd1 = _corners(POS_K, DOC_K, stride_pkb, bi, start_n, LK, BN, HAS_POS,
                                      HAS_DOCS)  # fmt: skip
        kind = tile_kind(qp0, qp1, kp0, kp1, qd0, qd1, kd0, kd1, rows_full & (start_n + BN <= LK),
                         window, sinks, LOCAL, HAS_DOCS)  # fmt: skip
        s, weight, _ = _tile_rule(
            s, w, w, kind, lam, DOC_Q, DOC_K, POS_Q, POS_K, stride_pqb, stride_pkb, bi, offs_m,
            offs_n, rows, cols, LQ, LK, window, sinks, HAS_DOCS, HAS_POS, LOCAL, False,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1))  # the gate's weight <= 1: s bounds the row
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_ref[:, None]) * weight
        alpha = tl.exp2(m_i - m_ref)
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
def _per_query(x, KEYS_FIRST: tl.constexpr):
    """A per-query ``[BM]`` vector broadcast over the tile's key axis."""
    if KEYS_FIRST:  # noqa: SIM108
        y = x[None, :]
    else:
        y = x[:, None]
    return y


@triton.jit
def _tile_grads(
    q, k, v, do, a_q, a_k, lse2, delta, kind, DOC_Q, DOC_K, POS_Q, POS_K, stride_pqb,
    stride_pkb, bi, offs_m, offs_n, rows, cols, LQ, LK, scale, lam, window, sinks, cap,
    HAS_DOCS: tl.constexpr, HAS_POS: tl.constexpr, SOFTCAP: tl.constexpr, LOCAL: tl.constexpr,
    QK_PREC: tl.constexpr, FAST: tl.constexpr, KEYS_FIRST: tl.constexpr,
):  # fmt: skip
    """The backward of a tile of kind ``kind``, shared by both backward passes: ``(p, ds,
    d_aff)``, the probabilities, the gradient of the raw (pre-cap) score and the gradient of the
    affinity ``g_i . g_j`` (a placeholder when ``LOCAL``), each ``[BM, BN]``, or ``[BN, BM]``
    with ``KEYS_FIRST`` (the dK/dV pass: its products ``p^T dO``, ``dS^T Q`` then take the tiles
    as they are, with no transpose in registers)."""
    if KEYS_FIRST:
        s, th = _scores(k, q, scale, cap, SOFTCAP, QK_PREC, FAST)  # [BN, BM] base 2
        dp = tl.dot(v, tl.trans(do), input_precision=QK_PREC)  # [BN, BM]
    else:
        s, th = _scores(q, k, scale, cap, SOFTCAP, QK_PREC, FAST)  # [BM, BN] base 2
        dp = tl.dot(do, tl.trans(v), input_precision=QK_PREC)  # [BM, BN]
    w = s
    w_rest = s  # 1 - w
    if not LOCAL:
        if KEYS_FIRST:  # noqa: SIM108
            affinity = tl.dot(a_k, tl.trans(a_q))  # [BN, BM] fp32 (split fp16 tables)
        else:
            affinity = tl.dot(a_q, tl.trans(a_k))  # [BM, BN]
        w, w_rest = gate_weight(affinity, lam, FAST)
    s, weight, d_gate = _tile_rule(
        s, w, w_rest, kind, lam, DOC_Q, DOC_K, POS_Q, POS_K, stride_pqb, stride_pkb, bi, offs_m,
        offs_n, rows, cols, LQ, LK, window, sinks, HAS_DOCS, HAS_POS, LOCAL, KEYS_FIRST,
    )  # fmt: skip
    lse_safe = tl.where(lse2 == float("-inf"), 0.0, lse2)  # rows without an allowed key
    p = tl.exp2(s - _per_query(lse_safe, KEYS_FIRST)) * weight
    ds = p * (dp - _per_query(delta, KEYS_FIRST))  # gradient of the score t
    d_aff = ds * d_gate
    if SOFTCAP:
        ds = ds * soft_cap_grad(th)
    return p, ds, d_aff


@triton.jit
def _add_query_grads(DQ_ACC, DG_Q_ACC, ds, d_aff, k, g_k, bi, bh, h, H, offs_m, rows, offs_d, LQ,
                     scale, D: tl.constexpr, KP: tl.constexpr, LOCAL: tl.constexpr,
                     QK_PREC: tl.constexpr, GRAD_PREC: tl.constexpr):  # fmt: skip
    """A keys-first tile's share of ``dQ = dS K`` and ``dG_q = dA G_k`` (``ds``, ``d_aff``:
    ``[BN, BM]``), added atomically into the fp32 accumulators."""
    dq = tl.dot(tl.trans(ds.to(k.dtype)), k, input_precision=QK_PREC) * scale  # [BM, D]
    dq_rows = ((bi * LQ + offs_m) * H + h)[:, None] * D + offs_d[None, :]  # [b, Lq, H, D]
    tl.atomic_add(DQ_ACC + dq_rows, dq, mask=rows[:, None], sem="relaxed")
    if not LOCAL:
        dg = tl.dot(tl.trans(d_aff.to(g_k.dtype)), g_k, input_precision=GRAD_PREC)  # [BM, KP]
        offs_g = tl.arange(0, KP)
        dg_rows = (bh * LQ + offs_m)[:, None] * KP + offs_g[None, :]  # [b, H, Lq, KP]
        tl.atomic_add(DG_Q_ACC + dg_rows, dg, mask=rows[:, None], sem="relaxed")


@triton.jit
def soft_backward_kv_kernel(  # pointers, strides, sizes and scalars, compile-time switches
    Q, K, V, A_Q, A_K, G_Q, G_K, DOC_Q, DOC_K, DOC_END, POS_Q, POS_K, DO, LSE, DELTA, DK, DV,
    DG_K, DQ_ACC, DG_Q_ACC,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
    stride_vh, stride_pqb, stride_pkb,
    LQ, LK, H, HKV, GROUP, scale, lam, window, sinks, cap,
    D: tl.constexpr, KA: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_DOCS: tl.constexpr, HAS_POS: tl.constexpr, SOFTCAP: tl.constexpr, LOCAL: tl.constexpr,
    QK_PREC: tl.constexpr, GRAD_PREC: tl.constexpr, FAST: tl.constexpr, PACKED: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
):  # fmt: skip
    """One program: ``BN`` keys of one (sample, KV head) against the query blocks that may see
    them, for each of the ``GROUP`` query heads: ``dK, dV [b, Lk, Hkv, D]`` (contiguous; ``dO``
    has ``q``'s strides) and the key-side assignment gradient ``dG_k [b, Hkv, Lk, KP]``. Grid
    ``(cdiv(Lk, BN), b * Hkv)``. ``ATOMIC_DQ`` (FlashAttention-2's backward): also each tile's
    share of ``dQ`` and ``dG_q``, added atomically into ``DQ_ACC [b, Lq, H, D]`` and ``DG_Q_ACC
    [b, H, Lq, KP]`` (fp32, zeroed): no dQ pass, at the price of atomics (not deterministic)."""
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    bi = bhk // HKV
    hk = bhk % HKV
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    cols = offs_n < LK
    k = _rows(K, bi, offs_n, hk, stride_kb, stride_kn, stride_kh, offs_d, cols)
    v = _rows(V, bi, offs_n, hk, stride_vb, stride_vn, stride_vh, offs_d, cols)
    a_k = tl.zeros([BN, KA], dtype=tl.float16)
    if not LOCAL:
        a_k = _table(A_K, bi, offs_n, cols, LK, KA)
    g_k = a_k  # a placeholder unless ATOMIC_DQ
    if ATOMIC_DQ:  # noqa: SIM102 (compile-time ifs: nested, not `and`)
        if not LOCAL:
            g_k = _table(G_K, bi, offs_n, cols, LK, KP)
    kp0, kp1, kd0, kd1 = _corners(POS_K, DOC_K, stride_pkb, bi, pid_n * BN, LK, BN, HAS_POS,
                                  HAS_DOCS)  # fmt: skip
    cols_full = pid_n * BN + BN <= LK
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
            lse2 = tl.load(LSE + bh * LQ + offs_m, mask=rows, other=0.0) * LOG2E
            delta = tl.load(DELTA + bh * LQ + offs_m, mask=rows, other=0.0)
            a_q = a_k  # a placeholder when LOCAL
            if not LOCAL:
                a_q = _table(A_Q, bi, offs_m, rows, LQ, KA)
            qp0, qp1, qd0, qd1 = _corners(POS_Q, DOC_Q, stride_pqb, bi, start_m, LQ, BM, HAS_POS,
                                          HAS_DOCS)  # fmt: skip
            full = cols_full & (start_m + BM <= LQ)
            kind = tile_kind(
                qp0, qp1, kp0, kp1, qd0, qd1, kd0, kd1, full, window, sinks, LOCAL, HAS_DOCS
            )
            p, ds, d_aff = _tile_grads(
                q, k, v, do, a_q, a_k, lse2, delta, kind, DOC_Q, DOC_K, POS_Q, POS_K,
                stride_pqb, stride_pkb, bi, offs_m, offs_n, rows, cols, LQ, LK, scale, lam,
                window, sinks, cap, HAS_DOCS, HAS_POS, SOFTCAP, LOCAL, QK_PREC, FAST, True,
            )  # fmt: skip  # [BN, BM] each
            dv += tl.dot(p.to(do.dtype), do, input_precision=QK_PREC)
            if not LOCAL:
                g_q = _table(G_Q, bi, offs_m, rows, LQ, KP)
                dg_k += tl.dot(d_aff.to(g_q.dtype), g_q, input_precision=GRAD_PREC)  # [BN, KP]
            dk += tl.dot(ds.to(q.dtype), q, input_precision=QK_PREC)
            if ATOMIC_DQ:
                _add_query_grads(DQ_ACC, DG_Q_ACC, ds, d_aff, k, g_k, bi, bh, h, H, offs_m, rows,
                                 offs_d, LQ, scale, D, KP, LOCAL, QK_PREC, GRAD_PREC)  # fmt: skip
    kv_rows = ((bi * LK + offs_n) * HKV + hk)[:, None] * D + offs_d[None, :]  # [b, Lk, Hkv, D]
    tl.store(DK + kv_rows, (dk * scale).to(DK.dtype.element_ty), mask=cols[:, None])
    tl.store(DV + kv_rows, dv.to(DV.dtype.element_ty), mask=cols[:, None])
    if not LOCAL:
        offs_g = tl.arange(0, KP)
        dg_rows = (bhk * LK + offs_n)[:, None] * KP + offs_g[None, :]  # [b, Hkv, Lk, KP]
        tl.store(DG_K + dg_rows, dg_k, mask=cols[:, None])


@triton.jit
def soft_backward_q_kernel(  # pointers, strides, sizes and scalars, compile-time switches
    Q, K, V, A_Q, A_K, G_K, DOC_Q, DOC_K, POS_Q, POS_K, DO, LSE, DELTA, DQ, DG_Q,
    stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
    stride_vh, stride_pqb, stride_pkb,
    LQ, LK, H, GROUP, scale, lam, window, sinks, cap,
    D: tl.constexpr, KA: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_DOCS: tl.constexpr, HAS_POS: tl.constexpr, SOFTCAP: tl.constexpr, LOCAL: tl.constexpr,
    QK_PREC: tl.constexpr, GRAD_PREC: tl.constexpr, FAST: tl.constexpr, PACKED: tl.constexpr,
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
    a_q = tl.zeros([BM, KA], dtype=tl.float16)
    if not LOCAL:
        a_q = _table(A_Q, bi, offs_m, rows, LQ, KA)
    lse2 = tl.load(LSE + bh * LQ + offs_m, mask=rows, other=0.0) * LOG2E
    delta = tl.load(DELTA + bh * LQ + offs_m, mask=rows, other=0.0)
    qp0, qp1, qd0, qd1 = _corners(POS_Q, DOC_Q, stride_pqb, bi, pid_m * BM, LQ, BM, HAS_POS,
                                  HAS_DOCS)  # fmt: skip
    rows_full = pid_m * BM + BM <= LQ
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
        a_k = a_q  # a placeholder when LOCAL
        if not LOCAL:
            a_k = _table(A_K, bi, offs_n, cols, LK, KA)
        kp0, kp1, kd0, kd1 = _corners(POS_K, DOC_K, stride_pkb, bi, start_n, LK, BN, HAS_POS,
                                      HAS_DOCS)  # fmt: skip
        kind = tile_kind(qp0, qp1, kp0, kp1, qd0, qd1, kd0, kd1, rows_full & (start_n + BN <= LK),
                         window, sinks, LOCAL, HAS_DOCS)  # fmt: skip
        _, ds, d_aff = _tile_grads(
            q, k, v, do, a_q, a_k, lse2, delta, kind, DOC_Q, DOC_K, POS_Q, POS_K, stride_pqb,
            stride_pkb, bi, offs_m, offs_n, rows, cols, LQ, LK, scale, lam, window, sinks, cap,
            HAS_DOCS, HAS_POS, SOFTCAP, LOCAL, QK_PREC, FAST, False,
        )  # fmt: skip
        if not LOCAL:
            g_k = _table(G_K, bi, offs_n, cols, LK, KP)
            dg_q += tl.dot(d_aff.to(g_k.dtype), g_k, input_precision=GRAD_PREC)  # [BM, KP]
        dq += tl.dot(ds.to(k.dtype), k, input_precision=QK_PREC)
    tl.store(DQ + q_rows, (dq * scale).to(DQ.dtype.element_ty), mask=rows[:, None])
    if not LOCAL:
        offs_g = tl.arange(0, KP)
        dg_rows = (bh * LQ + offs_m)[:, None] * KP + offs_g[None, :]  # [b, H, Lq, KP]
        tl.store(DG_Q + dg_rows, dg_q, mask=rows[:, None])
