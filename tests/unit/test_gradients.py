"""Gradients of the soft path (gradcheck in float64) and the soft-to-hard limit."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from focus_pretrain.focus import FocusRouter, focus_attention
from tests.helpers import random_probs, random_qkv


@pytest.mark.parametrize(
    "balance, heads, heads_kv, softcap, window",
    [
        ("causal", 2, 1, None, 2),
        ("causal", 3, 3, 1.5, 1),
        ("sinkhorn", 4, 2, None, 0),
    ],
)
def test_gradcheck_soft_mode_through_qkv_and_router(balance, heads, heads_kv, softcap, window):
    b, s, d_model, d = 1, 7, 5, 3
    router = FocusRouter(
        d_model,
        num_groups=3,
        group_dim=4,
        tau=0.5,
        balance=balance,
        sinkhorn_iters=4,
        dtype=torch.float64,
    )
    router.balance_offsets.copy_(torch.tensor([0.3, -0.1, -0.2]))
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, s, d_model, generator=gen, dtype=torch.float64)
    q, k, v = random_qkv(b, s, heads, heads_kv, d, seed=1, requires_grad=True)
    weight = router.proj.weight.detach().clone().requires_grad_(True)
    centroids = router.centroids.detach().clone().requires_grad_(True)

    def attention(q, k, v, weight, centroids):
        routing = functional_call(
            router, {"proj.weight": weight, "centroids": centroids}, (hidden,)
        )
        return focus_attention(
            q, k, v, routing, window=window, mode="soft", gate_lambda=4.0, softcap=softcap
        )

    assert torch.autograd.gradcheck(
        attention, (q, k, v, weight, centroids), eps=1e-6, atol=1e-7, rtol=1e-5
    )


def test_gradcheck_through_soft_assignments_directly():
    """The gate's gradient with respect to g itself (both the query and the key side)."""
    q, k, v = random_qkv(2, 6, 2, 2, 2, seed=2, requires_grad=True)
    probs = random_probs(2, 6, 3, seed=3).requires_grad_(True)

    def attention(q, k, v, probs):
        return focus_attention(q, k, v, probs, window=1, mode="soft", gate_lambda=6.0)

    assert torch.autograd.gradcheck(attention, (q, k, v, probs), eps=1e-6, atol=1e-7)


def test_soft_mode_converges_to_hard_top1_as_lambda_grows():
    b, s, h, hkv, d, k_groups = 2, 48, 4, 2, 8, 4
    q, k, v = random_qkv(b, s, h, hkv, d, seed=4)
    gen = torch.Generator().manual_seed(5)
    top1 = torch.randint(0, k_groups, (b, s), generator=gen)  # [b, s]
    logits = 12.0 * F.one_hot(top1, k_groups) + 0.5 * torch.randn(b, s, k_groups, generator=gen)
    probs = torch.softmax(logits.double(), -1)  # near one-hot, [b, s, K]
    affinity = probs @ probs.transpose(1, 2)  # [b, s, s]
    same = top1[:, :, None] == top1[:, None, :]
    # the limit is the hard mask exactly when "same group" <=> affinity > 1/2
    assert bool((affinity[same] > 0.5).all()) and bool((affinity[~same] < 0.5).all())
    hard = focus_attention(q, k, v, probs, window=3, mode="hard", top_k=1)
    errors = [
        (focus_attention(q, k, v, probs, window=3, mode="soft", gate_lambda=lam) - hard)
        .abs()
        .max()
        .item()
        for lam in (1.0, 4.0, 16.0, 64.0, 1000.0)
    ]
    assert errors[0] > 1e-2  # the soft gate at small lambda is really different
    assert all(a > b for a, b in itertools.pairwise(errors[:4])), errors
    assert errors[3] < 1e-6 and errors[-1] < 1e-12, errors
