"""Triton kernels of the soft-gated training attention (forward, and the two backward passes).

FlashAttention-2's tiling (online softmax over key blocks; the backward split into a pass per
key block for ``dK, dV`` and a pass per query block for ``dQ``) with the Focus gate computed in
the tile: for the ``[BM, BN]`` tile of queries ``i`` and keys ``j``

    a_ij  = g_i . g_j                        (tl.dot of the [BM, KP] and [BN, KP] assignments)
    x_ij  = lambda (a_ij - 1/2)
    t_ij  = softcap(scale q_i . k_j) + [gated_ij] log sigmoid(x_ij),   gated: i - j > window
                                                                        and j is not a sink

and in the backward ``dA_ij = dT_ij [gated_ij] lambda sigmoid(-x_ij)``, reduced on tensor cores
into ``dG_q = dA G_k`` (the dQ pass) and ``dG_k = dA^T G_q`` (the dK/dV pass). Nothing
``n x n`` is stored and nothing is reduced with atomics: the assignment gradients are written
per head and summed by the caller.

Layouts: ``q, o, dq [b, n, H, D]``, ``k, v, dk, dv [b, n, Hkv, D]`` (strided: any of our
``[b, s, h, d]`` views), assignments ``g [b, n, KP]`` fp32 (``K`` groups zero-padded to ``KP``),
``lse, delta [b, H, n]`` fp32, document starts and ends ``[b, n]`` int64. GQA: query head ``h``
reads KV head ``h // GROUP``; the dK/dV pass loops over the ``GROUP`` query heads of its KV head.

Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is imported) runs these kernels on
CPU tensors with NumPy: that is how the CPU test suite checks them against the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _tile(
    q,
    k,
    g_q,
    g_k,
    offs_m,
    offs_n,
    doc_q,
    doc_k,
    n,
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
        th = 1.0 - 2.0 / (tl.exp(2.0 * raw / cap) + 1.0)  # tanh(raw / cap)
        raw = cap * th
    allowed = (offs_n[None, :] <= offs_m[:, None]) & (offs_m[:, None] < n)
    key = offs_n
    if HAS_DOCS:
        allowed = allowed & (doc_q[:, None] == doc_k[None, :])
        key = offs_n - doc_k
    beyond = (offs_m[:, None] - offs_n[None, :] > window) & (key[None, :] >= sinks)
    if LOCAL:
        return raw, allowed & ~beyond, beyond, raw, th  # (no gate: beyond and x unused)
    affinity = tl.dot(g_q, tl.trans(g_k), input_precision=GATE_PREC)  # [BM, BN]
    x = lam * (affinity - 0.5)
    gate = tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))  # log sigmoid(x)
    return raw + tl.where(beyond, gate, 0.0), allowed, beyond, x, th


@triton.jit
def soft_forward_kernel(
    Q,
    K,
    V,
    G,
    DOC,
    OUT,
    LSE,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_on,
    stride_oh,
    stride_gb,
    stride_gn,
    stride_db,
    n,
    H,
    GROUP,
    scale,
    lam,
    window,
    sinks,
    cap,
    D: tl.constexpr,
    KP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LOCAL: tl.constexpr,
    QK_PREC: tl.constexpr,
    GATE_PREC: tl.constexpr,
):
    """One program: ``BM`` queries of one (sample, head) against every key block they may see
    (``[document start of the first query, last query]``). Grid ``(cdiv(n, BM), b * H)``."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    bi = bh // H
    h = bh % H
    hk = h // GROUP
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, KP)
    rows = offs_m < n
    q = tl.load(
        Q + bi * stride_qb + offs_m[:, None] * stride_qn + h * stride_qh + offs_d[None, :],
        mask=rows[:, None],
        other=0.0,
    )
    g_q = tl.zeros([BM, KP], dtype=tl.float32)  # LOCAL: no assignments (G is not read)
    if not LOCAL:
        g_q = tl.load(
            G + bi * stride_gb + offs_m[:, None] * stride_gn + offs_g[None, :],
            mask=rows[:, None],
            other=0.0,
        )
    lo = pid_m * 0
    doc_q = offs_m
    if HAS_DOCS:  # document starts never decrease: the first query's is the block's lowest
        doc_q = tl.load(DOC + bi * stride_db + offs_m, mask=rows, other=0)
        lo = (tl.load(DOC + bi * stride_db + pid_m * BM).to(tl.int32) // BN) * BN
    if LOCAL:  # without sinks no key before the first query's window
        first = tl.maximum(pid_m * BM - window, 0) // BN * BN
        lo = tl.maximum(lo, tl.where(sinks == 0, first, 0))
    hi = (pid_m + 1) * BM  # keys past n (last block) are masked
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)  # running max, base 2
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    for start_n in range(lo, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        cols = offs_n < n
        k = tl.load(
            K + bi * stride_kb + offs_n[:, None] * stride_kn + hk * stride_kh + offs_d[None, :],
            mask=cols[:, None],
            other=0.0,
        )
        v = tl.load(
            V + bi * stride_vb + offs_n[:, None] * stride_vn + hk * stride_vh + offs_d[None, :],
            mask=cols[:, None],
            other=0.0,
        )
        g_k = tl.zeros([BN, KP], dtype=tl.float32)
        if not LOCAL:
            g_k = tl.load(
                G + bi * stride_gb + offs_n[:, None] * stride_gn + offs_g[None, :],
                mask=cols[:, None],
                other=0.0,
            )
        doc_k = offs_n
        if HAS_DOCS:
            doc_k = tl.load(DOC + bi * stride_db + offs_n, mask=cols, other=-1)
        t, allowed, _, _, _ = _tile(
            q, k, g_q, g_k, offs_m, offs_n, doc_q, doc_k, n, scale, lam, window, sinks, cap,
            HAS_DOCS, SOFTCAP, LOCAL, QK_PREC, GATE_PREC,
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
    out = acc / l_safe[:, None]
    lse = (m_i + tl.log2(l_safe)) * LN2  # natural log-sum-exp; -inf for padded rows
    tl.store(
        OUT + bi * stride_ob + offs_m[:, None] * stride_on + h * stride_oh + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=rows[:, None],
    )
    tl.store(LSE + bh * n + offs_m, lse, mask=rows)


@triton.jit
def soft_backward_kv_kernel(
    Q,
    K,
    V,
    G,
    DOC,
    DOC_END,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    DG_K,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_gb,
    stride_gn,
    stride_db,
    n,
    H,
    HKV,
    GROUP,
    scale,
    lam,
    window,
    sinks,
    cap,
    D: tl.constexpr,
    KP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LOCAL: tl.constexpr,
    QK_PREC: tl.constexpr,
    GATE_PREC: tl.constexpr,
):
    """One program: ``BN`` keys of one (sample, KV head) against every query block that may see
    them, for each of the ``GROUP`` query heads: ``dK, dV [b, n, Hkv, D]`` (contiguous, like
    ``dO``) and the key-side assignment gradient ``dG_k [b, Hkv, n, KP]``. Grid
    ``(cdiv(n, BN), b * Hkv)``."""
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    bi = bhk // HKV
    hk = bhk % HKV
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, KP)
    cols = offs_n < n
    k = tl.load(
        K + bi * stride_kb + offs_n[:, None] * stride_kn + hk * stride_kh + offs_d[None, :],
        mask=cols[:, None],
        other=0.0,
    )
    v = tl.load(
        V + bi * stride_vb + offs_n[:, None] * stride_vn + hk * stride_vh + offs_d[None, :],
        mask=cols[:, None],
        other=0.0,
    )
    g_k = tl.zeros([BN, KP], dtype=tl.float32)
    if not LOCAL:
        g_k = tl.load(
            G + bi * stride_gb + offs_n[:, None] * stride_gn + offs_g[None, :],
            mask=cols[:, None],
            other=0.0,
        )
    lo = (pid_n * BN // BM) * BM  # causal: no query before the first key
    hi = n
    doc_k = offs_n
    if HAS_DOCS:
        doc_k = tl.load(DOC + bi * stride_db + offs_n, mask=cols, other=-1)
        last = tl.minimum(pid_n * BN + BN, n) - 1
        hi = tl.load(DOC_END + bi * stride_db + last).to(tl.int32)  # its document's end
    if LOCAL:  # without sinks no query past the last key's window
        hi = tl.minimum(hi, tl.where(sinks == 0, pid_n * BN + BN + window, n))
    dk = tl.zeros([BN, D], dtype=tl.float32)
    dv = tl.zeros([BN, D], dtype=tl.float32)
    dg_k = tl.zeros([BN, KP], dtype=tl.float32)
    for hh in range(0, GROUP):
        h = hk * GROUP + hh
        for start_m in range(lo, hi, BM):
            offs_m = start_m + tl.arange(0, BM)
            rows = offs_m < n
            q = tl.load(
                Q + bi * stride_qb + offs_m[:, None] * stride_qn + h * stride_qh + offs_d[None, :],
                mask=rows[:, None],
                other=0.0,
            )
            do = tl.load(
                DO + bi * stride_qb + offs_m[:, None] * stride_qn + h * stride_qh + offs_d[None, :],
                mask=rows[:, None],
                other=0.0,
            )
            g_q = tl.zeros([BM, KP], dtype=tl.float32)
            if not LOCAL:
                g_q = tl.load(
                    G + bi * stride_gb + offs_m[:, None] * stride_gn + offs_g[None, :],
                    mask=rows[:, None],
                    other=0.0,
                )
            bh = bi * H + h
            lse = tl.load(LSE + bh * n + offs_m, mask=rows, other=0.0)
            delta = tl.load(DELTA + bh * n + offs_m, mask=rows, other=0.0)
            doc_q = offs_m
            if HAS_DOCS:
                doc_q = tl.load(DOC + bi * stride_db + offs_m, mask=rows, other=-2)
            t, allowed, gated, x, th = _tile(
                q, k, g_q, g_k, offs_m, offs_n, doc_q, doc_k, n, scale, lam, window, sinks, cap,
                HAS_DOCS, SOFTCAP, LOCAL, QK_PREC, GATE_PREC,
            )  # fmt: skip
            p = tl.where(allowed, tl.exp2(t * LOG2E - lse[:, None] * LOG2E), 0.0)  # [BM, BN]
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=QK_PREC)
            dp = tl.dot(do, tl.trans(v), input_precision=QK_PREC)  # [BM, BN]
            ds = p * (dp - delta[:, None])  # gradient of the score t
            if not LOCAL:
                d_aff = tl.where(gated & allowed, ds * lam * tl.sigmoid(-x), 0.0)
                dg_k += tl.dot(tl.trans(d_aff), g_q, input_precision=GATE_PREC)  # [BN, KP]
            if SOFTCAP:
                ds = ds * (1.0 - th * th)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=QK_PREC)
    kv_rows = ((bi * n + offs_n) * HKV + hk)[:, None] * D + offs_d[None, :]  # [b, n, Hkv, D]
    tl.store(DK + kv_rows, (dk * scale).to(DK.dtype.element_ty), mask=cols[:, None])
    tl.store(DV + kv_rows, dv.to(DV.dtype.element_ty), mask=cols[:, None])
    if not LOCAL:
        dg_rows = (bhk * n + offs_n)[:, None] * KP + offs_g[None, :]  # [b, Hkv, n, KP]
        tl.store(DG_K + dg_rows, dg_k, mask=cols[:, None])


@triton.jit
def soft_backward_q_kernel(
    Q,
    K,
    V,
    G,
    DOC,
    DO,
    LSE,
    DELTA,
    DQ,
    DG_Q,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_gb,
    stride_gn,
    stride_db,
    n,
    H,
    GROUP,
    scale,
    lam,
    window,
    sinks,
    cap,
    D: tl.constexpr,
    KP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    LOCAL: tl.constexpr,
    QK_PREC: tl.constexpr,
    GATE_PREC: tl.constexpr,
):
    """One program: ``BM`` queries of one (sample, head): ``dQ [b, n, H, D]`` (``dO``'s strides)
    and the query-side assignment gradient ``dG_q [b, H, n, KP]``. Grid ``(cdiv(n, BM), b * H)``.
    """
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    bi = bh // H
    h = bh % H
    hk = h // GROUP
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, KP)
    rows = offs_m < n
    q_rows = bi * stride_qb + offs_m[:, None] * stride_qn + h * stride_qh + offs_d[None, :]
    q = tl.load(Q + q_rows, mask=rows[:, None], other=0.0)
    do = tl.load(DO + q_rows, mask=rows[:, None], other=0.0)
    g_q = tl.zeros([BM, KP], dtype=tl.float32)  # LOCAL: no assignments (G is not read)
    if not LOCAL:
        g_q = tl.load(
            G + bi * stride_gb + offs_m[:, None] * stride_gn + offs_g[None, :],
            mask=rows[:, None],
            other=0.0,
        )
    lse = tl.load(LSE + bh * n + offs_m, mask=rows, other=0.0)
    delta = tl.load(DELTA + bh * n + offs_m, mask=rows, other=0.0)
    lo = pid_m * 0
    doc_q = offs_m
    if HAS_DOCS:  # document starts never decrease: the first query's is the block's lowest
        doc_q = tl.load(DOC + bi * stride_db + offs_m, mask=rows, other=0)
        lo = (tl.load(DOC + bi * stride_db + pid_m * BM).to(tl.int32) // BN) * BN
    if LOCAL:  # without sinks no key before the first query's window
        first = tl.maximum(pid_m * BM - window, 0) // BN * BN
        lo = tl.maximum(lo, tl.where(sinks == 0, first, 0))
    hi = (pid_m + 1) * BM  # keys past n (last block) are masked
    dq = tl.zeros([BM, D], dtype=tl.float32)
    dg_q = tl.zeros([BM, KP], dtype=tl.float32)
    for start_n in range(lo, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        cols = offs_n < n
        k = tl.load(
            K + bi * stride_kb + offs_n[:, None] * stride_kn + hk * stride_kh + offs_d[None, :],
            mask=cols[:, None],
            other=0.0,
        )
        v = tl.load(
            V + bi * stride_vb + offs_n[:, None] * stride_vn + hk * stride_vh + offs_d[None, :],
            mask=cols[:, None],
            other=0.0,
        )
        g_k = tl.zeros([BN, KP], dtype=tl.float32)
        if not LOCAL:
            g_k = tl.load(
                G + bi * stride_gb + offs_n[:, None] * stride_gn + offs_g[None, :],
                mask=cols[:, None],
                other=0.0,
            )
        doc_k = offs_n
        if HAS_DOCS:
            doc_k = tl.load(DOC + bi * stride_db + offs_n, mask=cols, other=-1)
        t, allowed, gated, x, th = _tile(
            q, k, g_q, g_k, offs_m, offs_n, doc_q, doc_k, n, scale, lam, window, sinks, cap,
            HAS_DOCS, SOFTCAP, LOCAL, QK_PREC, GATE_PREC,
        )  # fmt: skip
        p = tl.where(allowed, tl.exp2(t * LOG2E - lse[:, None] * LOG2E), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=QK_PREC)
        ds = p * (dp - delta[:, None])
        if not LOCAL:
            d_aff = tl.where(gated & allowed, ds * lam * tl.sigmoid(-x), 0.0)
            dg_q += tl.dot(d_aff, g_k, input_precision=GATE_PREC)  # [BM, KP]
        if SOFTCAP:
            ds = ds * (1.0 - th * th)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=QK_PREC)
    tl.store(DQ + q_rows, (dq * scale).to(DQ.dtype.element_ty), mask=rows[:, None])
    if not LOCAL:
        dg_rows = (bh * n + offs_m)[:, None] * KP + offs_g[None, :]  # [b, H, n, KP]
        tl.store(DG_Q + dg_rows, dg_q, mask=rows[:, None])
