"""The Triton rules (``focus/pattern_triton.py``: gate, soft-capping, pair masks), which the
fused kernels share, equal the torch spec (``focus/pattern.py``) on random tiles: compiled on
CUDA, else in Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest
import torch

from focus_pretrain.focus import pattern
from tests.helpers import needs_triton

pytestmark = needs_triton
triton = pytest.importorskip("triton", reason="needs Triton (make setup installs it)")
tl = pytest.importorskip("triton.language")
rules = pytest.importorskip("focus_pretrain.focus.pattern_triton")


@triton.jit
def rules_kernel(AFF, RAW, POS_Q, POS_K, DOC_Q, DOC_K, OUT, lam, cap, window, sinks,
                 BM: tl.constexpr, BN: tl.constexpr, HAS_DOCS: tl.constexpr):  # fmt: skip
    """Every rule on one ``[BM, BN]`` tile, written to ``OUT [6, BM, BN]``."""
    rows_i, cols_i = tl.arange(0, BM), tl.arange(0, BN)
    tile = rows_i[:, None] * BN + cols_i[None, :]
    gate, x = rules.soft_gate(tl.load(AFF + tile), lam)
    capped, th = rules.soft_cap(tl.load(RAW + tile), cap)
    pos_q, pos_k = tl.load(POS_Q + rows_i), tl.load(POS_K + cols_i)
    doc_q, doc_k = tl.load(DOC_Q + rows_i), tl.load(DOC_K + cols_i)
    rows, cols = rows_i < BM, cols_i < BN
    allowed, beyond = rules.pair_masks(
        pos_q, pos_k, rows, cols, doc_q, doc_k, window, sinks, HAS_DOCS
    )
    size = BM * BN
    tl.store(OUT + tile, gate)
    tl.store(OUT + size + tile, rules.soft_gate_grad(x, lam))
    tl.store(OUT + 2 * size + tile, capped)
    tl.store(OUT + 3 * size + tile, rules.soft_cap_grad(th))
    tl.store(OUT + 4 * size + tile, allowed.to(tl.float32))
    tl.store(OUT + 5 * size + tile, beyond.to(tl.float32))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("has_docs", [False, True])
def test_triton_rules_equal_the_spec(seed, has_docs):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    bm, bn = 16, 32
    affinity = torch.rand(bm, bn, generator=g)
    affinity[0, 0] = 0.5  # x = 0
    raw = torch.randn(bm, bn, generator=g) * 20
    pos_q = torch.randint(0, 200, (bm,), generator=g).sort().values
    pos_k = torch.randint(0, 200, (bn,), generator=g).sort().values
    doc_q = (pos_q // 50) * 50 if has_docs else pos_q  # document starts every 50 positions
    doc_k = (pos_k // 50) * 50 if has_docs else pos_k
    lam, cap, window, sinks = 9.0, 15.0, int(torch.randint(0, 60, (), generator=g)), 3
    out = torch.empty(6, bm, bn, device=device)
    args = [t.to(device) for t in (affinity, raw, pos_q, pos_k, doc_q, doc_k)]
    rules_kernel[(1,)](*args, out, lam, cap, window, sinks, BM=bm, BN=bn, HAS_DOCS=has_docs)
    out = out.cpu()
    torch.testing.assert_close(out[0], pattern.soft_gate(affinity, lam), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1], lam * torch.sigmoid(-lam * (affinity - 0.5)))
    torch.testing.assert_close(out[2], pattern.soft_cap(raw, cap), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[3], 1 - torch.tanh(raw / cap) ** 2, rtol=1e-5, atol=1e-5)
    docs = dict(q_doc=doc_q[:, None], k_doc=doc_k[None, :]) if has_docs else {}
    causal, near = pattern.pair_rule(
        pos_q[:, None], pos_k[None, :], window=window, sinks=sinks, **docs
    )
    assert causal.any() and (~causal).any() and near.any() and (~near).any()  # both sides seen
    assert torch.equal(out[4].bool(), causal)
    assert torch.equal(out[5].bool(), ~near)


@triton.jit
def tile_kind_kernel(POS_Q, POS_K, DOC_Q, DOC_K, OUT, window, sinks, full, BM: tl.constexpr,
                     BN: tl.constexpr, HAS_DOCS: tl.constexpr, LOCAL: tl.constexpr):  # fmt: skip
    """:func:`tile_kind` of one tile from its corners."""
    kind = rules.tile_kind(
        tl.load(POS_Q), tl.load(POS_Q + BM - 1), tl.load(POS_K), tl.load(POS_K + BN - 1),
        tl.load(DOC_Q), tl.load(DOC_Q + BM - 1), tl.load(DOC_K), tl.load(DOC_K + BN - 1),
        full != 0, window, sinks, LOCAL, HAS_DOCS,
    )  # fmt: skip
    tl.store(OUT, kind)


@pytest.mark.parametrize("local", [False, True])
def test_tile_kind_agrees_with_every_pair(local):
    """A tile said ``PLAIN`` has every pair allowed and inside the window (or a sink); one said
    ``GATED`` every pair allowed and gated; the rest are ``MASKED``. On random tiles of sorted
    positions and documents (a brute force over the tile's pairs), each kind seen."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(7)
    bm, bn = 16, 16
    seen = set()
    out = torch.zeros(1, dtype=torch.int32, device=device)
    for trial in range(120):
        has_docs, full = trial % 2 == 1, trial % 7 != 0
        start_q = int(torch.randint(0, 300, (), generator=g))
        start_k = start_q - int(torch.randint(-20, 260, (), generator=g))
        pos_q = start_q + torch.arange(bm)
        pos_k = start_k + torch.arange(bn)
        period = int(torch.randint(40, 400, (), generator=g))
        doc_q = (pos_q // period) * period if has_docs else torch.zeros(bm, dtype=torch.int64)
        doc_k = (pos_k // period) * period if has_docs else torch.zeros(bn, dtype=torch.int64)
        window, sinks = int(torch.randint(0, 120, (), generator=g)), int(trial % 3 == 0) * 4
        args = [t.to(device) for t in (pos_q, pos_k, doc_q, doc_k)]
        tile_kind_kernel[(1,)](*args, out, window, sinks, int(full), BM=bm, BN=bn,
                               HAS_DOCS=has_docs, LOCAL=local)  # fmt: skip
        kind = int(out.item())
        seen.add(kind)
        allowed, near = pattern.pair_rule(
            pos_q[:, None], pos_k[None, :], window=window, sinks=sinks,
            q_doc=doc_q[:, None], k_doc=doc_k[None, :],
        )  # fmt: skip
        inside = (pos_q[:, None] - pos_k[None, :]) <= window
        if kind == rules.PLAIN:
            assert full and allowed.all() and inside.all(), trial
        elif kind == rules.GATED:
            assert full and not local and allowed.all() and not near.any(), trial
        else:
            assert kind == rules.MASKED, kind
    assert seen == ({0, 1} if local else {0, 1, 2})
