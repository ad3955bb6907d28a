"""The attention mass a Focus pattern removes (the retrofit objective ``attention_mass``):
against a brute-force loop over queries and keys, values and gradients, on random shapes."""

from __future__ import annotations

import math

import pytest
import torch

from focus_pretrain.focus.attention_mass import removed_attention_mass

CASES = [  # b, s, heads, heads_kv, d, K, window, sinks, mode, top_k, extra settings
    (2, 23, 4, 2, 8, 4, 3, 0, "soft", 1, {}),
    (1, 31, 2, 2, 16, 8, 5, 2, "soft", 1, {"gate_lambda": 4.0}),
    (2, 19, 6, 3, 8, 4, 2, 1, "soft", 1, {"softcap": 5.0, "scale": 0.3}),
    (2, 27, 4, 1, 8, 4, 4, 2, "hard_gated", 1, {}),
    (1, 29, 2, 2, 8, 6, 3, 0, "hard_gated", 2, {"gate_lambda": 7.0}),
    (2, 21, 2, 1, 8, 4, 2, 2, "hard", 2, {}),
]


def _inputs(case, seed: int) -> tuple[torch.Tensor, ...]:
    b, s, h, hkv, d, k_groups = case[:6]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=gen, dtype=torch.float64) * 1.5
    k = torch.randn(b, s, hkv, d, generator=gen, dtype=torch.float64) * 1.5
    logits = torch.randn(b, s, k_groups, generator=gen, dtype=torch.float64) * 3
    return q, k, torch.softmax(logits, dim=-1)


def brute_force(q, k, probs, window, sinks, mode, top_k, settings, documents=None):
    """``-log(sum_j a_ij gate_ij)`` by loops: ``a`` the dense causal softmax (inside each
    document), the gate as the spec writes it (docs: focus-method.md, sections 3, 4, 7)."""
    b, s, h, d = q.shape
    lam = settings.get("gate_lambda", 10.0)
    scale = settings.get("scale", d**-0.5)
    cap = settings.get("softcap")
    top = probs.topk(top_k, dim=-1).indices  # [b, s, top_k]
    doc = torch.zeros(b, s, dtype=torch.long) if documents is None else documents
    out = torch.zeros(b, s, h, dtype=torch.float64)
    for bi in range(b):
        for i in range(s):
            keys = [j for j in range(i + 1) if doc[bi, j] == doc[bi, i]]
            first = keys[0]
            for hi in range(h):
                kh = hi // (h // k.shape[2])
                scores = torch.stack([q[bi, i, hi] @ k[bi, j, kh] * scale for j in keys])
                if cap is not None:
                    scores = cap * torch.tanh(scores / cap)
                a = torch.softmax(scores, dim=0)
                kept = 0.0
                for weight, j in zip(a, keys, strict=True):
                    local = i - j <= window or j - first < sinks
                    shared = bool(set(top[bi, i].tolist()) & set(top[bi, j].tolist()))
                    gate = 1.0
                    if not local and mode != "hard":
                        gate = torch.sigmoid(lam * (probs[bi, i] @ probs[bi, j] - 0.5))
                    if not local and mode in ("hard", "hard_gated") and not shared:
                        gate = 0.0
                    kept = kept + weight * gate
                out[bi, i, hi] = -torch.log(kept)
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{c[8]}-top{c[9]}-{i}" for i, c in enumerate(CASES)])
def test_removed_mass_matches_brute_force(case):
    s, (window, sinks, mode, top_k, settings) = case[1], case[6:]
    q, k, probs = _inputs(case, seed=len(CASES) + s)
    got_probs = probs.clone().requires_grad_(mode != "hard")
    got_q = q.clone().requires_grad_()
    got = removed_attention_mass(
        got_q, k, k, got_probs, window=window, sinks=sinks, mode=mode, top_k=top_k, **settings
    )  # [b, s, h]
    want_probs = probs.clone().requires_grad_(mode != "hard")
    want_q = q.clone().requires_grad_()
    want = brute_force(want_q, k, want_probs, window, sinks, mode, top_k, settings)
    assert want.max() > 0.05  # a pattern that removes something here
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    upstream = torch.linspace(0.5, 1.5, want.numel(), dtype=torch.float64).view_as(want)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    torch.testing.assert_close(got_q.grad, want_q.grad, rtol=1e-8, atol=1e-10)
    if mode != "hard":  # the hard pattern has no gradient in the routing
        assert want_probs.grad.abs().max() > 1e-4
        torch.testing.assert_close(got_probs.grad, want_probs.grad, rtol=1e-8, atol=1e-10)


def test_packed_documents_are_measured_each_alone():
    case = CASES[1]
    q, k, probs = _inputs(case, seed=5)
    documents = torch.tensor([[0] * 12 + [1] * 10 + [2] * 9])  # [1, 31]
    got = removed_attention_mass(q, k, k, probs, window=5, sinks=2, documents=documents)
    want = brute_force(q, k, probs, 5, 2, "soft", 1, {}, documents)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_nothing_is_removed_when_the_window_covers_the_sequence():
    q, k, probs = _inputs(CASES[0], seed=2)
    removed = removed_attention_mass(q, k, k, probs, window=q.shape[1])
    assert removed.abs().max() < 1e-12
    # fp32 inputs give fp32 shares, never negative beyond rounding
    fp32 = removed_attention_mass(q.float(), k.float(), k.float(), probs.float(), window=2)
    assert fp32.dtype == torch.float32 and fp32.min() > -1e-5 and math.isfinite(fp32.sum())


@pytest.mark.parametrize(
    "settings, error",
    [
        ({"local_only": True}, "needs a routed pattern"),
        ({"gate_form": "dot"}, "needs gate_form='sigmoid'"),
        ({"mode": "sparse"}, "mode must be one of"),
    ],
)
def test_refused_patterns_name_the_reason(settings, error):
    q, k, probs = _inputs(CASES[0], seed=3)
    with pytest.raises(ValueError, match=error):
        removed_attention_mass(q, k, k, probs, **settings)
