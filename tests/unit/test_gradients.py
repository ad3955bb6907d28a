"""Gradients of the soft path (gradcheck in float64) and the soft-to-hard limit."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from focus_pretrain.focus import FocusRouter, Routing, focus_attention
from tests.helpers import random_probs, random_qkv
from tests.helpers import reference_call as reference_attention


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


@pytest.mark.parametrize("sinks", [1, 3, 9])  # 9: more sinks than the window, past the sequence
@pytest.mark.parametrize(
    "mode, top_k, local_only",
    [("soft", 1, False), ("hard", 1, False), ("hard", 2, False), ("hard", 1, True)],
)
def test_gradcheck_with_sinks(sinks, mode, top_k, local_only):
    """With attention sinks: q, k, v (and, soft, the assignments) in float64, small query
    blocks (a local-only block's keys are the sinks plus its window), output and lse."""
    q, k, v = random_qkv(1, 8, 2, 1, 3, seed=sinks, requires_grad=True)
    probs = random_probs(1, 8, 4, seed=sinks + 1, sharpness=2.0)
    member = None if mode == "soft" or local_only else Routing(probs).membership(top_k)
    soft = mode == "soft" and not local_only

    def attention(q, k, v, *assignments):
        return reference_attention(
            q, k, v, probs=assignments[0] if assignments else None, member=member, window=1,
            mode=mode, gate_lambda=4.0, softcap=1.5, scale=0.7, local_only=local_only,
            sinks=sinks, q_block=3,
        )  # fmt: skip

    inputs = (q, k, v) + ((probs.requires_grad_(True),) if soft else ())
    assert torch.autograd.gradcheck(attention, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
    # the public API (default query blocks) has the same gradients, which the sinks change
    upstream = torch.linspace(-1, 1, 3, dtype=torch.float64)
    grads = []
    for n_sinks in (sinks, 0, None):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        if n_sinks is None:  # the block-wise reference above
            out = attention(*leaves)[0]
        else:
            out = focus_attention(
                *leaves[:3], leaves[3] if soft else probs, window=1, mode=mode, top_k=top_k,
                gate_lambda=4.0, softcap=1.5, scale=0.7, local_only=local_only, sinks=n_sinks,
            )  # fmt: skip
        (out * upstream).sum().backward()
        grads.append([t.grad for t in leaves])
    with_sinks, without, blockwise = grads
    for a, b in zip(with_sinks, blockwise, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert max((a - b).abs().max() for a, b in zip(with_sinks, without, strict=True)) > 1e-3


@pytest.mark.parametrize(
    "top_k, heads, heads_kv, softcap, sinks, packed",
    [(1, 2, 1, None, 0, False), (2, 3, 3, 1.5, 2, False), (3, 4, 2, None, 1, True),
     (1, 2, 2, 2.0, 3, True)],
)  # fmt: skip
def test_gradcheck_hard_gated_through_qkv_and_router(
    top_k, heads, heads_kv, softcap, sinks, packed
):
    """Sparse training (mode ``hard_gated``): float64 gradcheck through q, k, v and the router's
    weights (the gate on the kept routed pairs), GQA, sinks, packed documents; the router's
    gradient is non-zero, and the output equals a dense masked softmax written here."""
    b, s, d_model, d = 2, 10, 5, 3
    router = FocusRouter(d_model, num_groups=4, group_dim=4, tau=0.5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(top_k)
    hidden = torch.randn(b, s, d_model, generator=gen, dtype=torch.float64)
    q, k, v = random_qkv(b, s, heads, heads_kv, d, seed=top_k, requires_grad=True)
    weight = router.proj.weight.detach().clone().requires_grad_(True)
    centroids = router.centroids.detach().clone().requires_grad_(True)
    documents = torch.tensor([[0] * 6 + [1] * 4, [0] * 3 + [1] * 7]) if packed else None
    kwargs = dict(window=1, mode="hard_gated", top_k=top_k, gate_lambda=4.0, softcap=softcap,
                  sinks=sinks, documents=documents)  # fmt: skip

    def attention(q, k, v, weight, centroids):
        params = {"proj.weight": weight, "centroids": centroids}
        return focus_attention(q, k, v, functional_call(router, params, (hidden,)), **kwargs)

    inputs = (q, k, v, weight, centroids)
    assert torch.autograd.gradcheck(attention, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
    out = attention(*inputs)
    grads = torch.autograd.grad(out.pow(2).sum(), (weight, centroids))
    assert all(g.abs().max() > 1e-6 for g in grads)  # the routers learn from the kept pairs
    probs = functional_call(router, {"proj.weight": weight, "centroids": centroids}, (hidden,))
    torch.testing.assert_close(out, _dense_hard_gated(q, k, v, probs.probs, **kwargs))


def _dense_hard_gated(q, k, v, probs, *, window, top_k, gate_lambda, softcap, sinks, documents,
                      mode):  # fmt: skip
    """Dense ``[s, s]`` masked softmax of the hard_gated pattern, from the spec (no package
    code): kept = causal, one document, and (local, a sink, or sharing a top-k group); the gate
    ``log sigmoid(lambda (g_i . g_j - 1/2))`` on kept pairs beyond the window that are not
    sinks."""
    assert mode == "hard_gated"
    b, s, h, d = q.shape
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    ids = torch.zeros(b, s, dtype=torch.long) if documents is None else documents
    start = torch.stack([torch.tensor([list(r).index(x) for x in r]) for r in ids.tolist()])
    one_doc = ids[:, :, None] == ids[:, None, :]  # [b, s, s]
    near = (i - j <= window) | (j - start[:, None, :] < sinks)  # [b, s, s]
    top = probs.detach().topk(top_k, dim=-1).indices  # [b, s, top_k]
    onehot = torch.zeros(b, s, probs.shape[-1]).scatter_(-1, top, 1.0)
    shares = (onehot @ onehot.transpose(1, 2)) > 0  # [b, s, s]
    kept = (j <= i) & one_doc & (near | shares)
    gate = F.logsigmoid(gate_lambda * (probs @ probs.transpose(1, 2) - 0.5))  # [b, s, s]
    bias = torch.where(near, 0.0, gate).masked_fill(~kept, float("-inf"))
    kv = k.repeat_interleave(h // k.shape[2], dim=2), v.repeat_interleave(h // v.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kv[0]) * d**-0.5  # [b, h, s, s]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    weights = torch.softmax(scores + bias[:, None], dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", weights, kv[1])  # [b, s, h, d]


@pytest.mark.parametrize("seed", range(8))
def test_segments_backend_gradients_equal_the_reference(seed):
    """The ``segments`` backend (top-1 on the group-sorted layout, CPU sparse training): output,
    log-sum-exp and the gradients of q, k, v and (hard_gated) the soft assignments equal the
    reference's on random shapes, windows, sinks, soft-capping, GQA, documents, query blocks."""
    from focus_pretrain.focus.segments import segments_attention

    gen = torch.Generator().manual_seed(seed)
    b, n = 1 + seed % 2, int(torch.randint(1, 90, (), generator=gen))
    hkv = 1 + seed % 2
    h, d, groups = hkv * (1 + seed % 3), 4, int(torch.randint(1, 7, (), generator=gen))
    mode = ("hard", "hard_gated")[seed % 2]
    ids = torch.cumsum(torch.rand(b, n, generator=gen) < 0.08, dim=1) if seed % 4 >= 2 else None
    kwargs = dict(window=int(torch.randint(0, n + 2, (), generator=gen)), mode=mode, top_k=1,
                  gate_lambda=5.0, softcap=(None, 2.0)[seed % 3 == 0], sinks=(0, 2, 30)[seed % 3],
                  documents=ids, return_lse=True)  # fmt: skip
    q, k, v = random_qkv(b, n, h, hkv, d, seed=seed, requires_grad=True)
    probs = random_probs(b, n, groups, seed=seed + 1, sharpness=2.0).requires_grad_(True)
    upstream = torch.randn(b, n, h, d, generator=gen, dtype=torch.float64)
    results = {}
    for name in ("reference", "segments"):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, probs)]
        out, lse = focus_attention(*leaves[:3], Routing(leaves[3]), backend=name, **kwargs)
        ((out * upstream).sum() + lse.sum()).backward()
        results[name] = [out, lse, *(t.grad for t in leaves[: 4 if mode == "hard_gated" else 3])]
    for want, got in zip(results["reference"], results["segments"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # tiny query blocks (segments spanning several, blocks spanning segments): the same result
    from focus_pretrain.focus.backends import AttentionPattern
    from focus_pretrain.focus.pattern import document_starts

    member = Routing(probs).membership(1)
    pattern = AttentionPattern(
        window=kwargs["window"], mode=mode, local_only=False, gate_lambda=5.0,
        softcap=kwargs["softcap"], scale=d**-0.5, sinks=kwargs["sinks"], probs=probs.detach(),
        member=member, documents=None if ids is None else document_starts(ids), groups=groups,
    )  # fmt: skip
    with torch.no_grad():
        blocked, blocked_lse = segments_attention(q, k, v, pattern, q_block=3)
    torch.testing.assert_close(blocked, results["reference"][0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(blocked_lse, results["reference"][1], rtol=1e-10, atol=1e-10)
