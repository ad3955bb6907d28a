"""The reference backend against a brute-force loop and against dense attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from focus_pretrain.focus import Routing, focus_attention
from tests.helpers import brute_force_focus, random_probs, random_qkv
from tests.helpers import reference_call as reference_attention

pytestmark = pytest.mark.torch  # also under the lowest supported torch


@st.composite
def problems(draw):
    """A random tiny Focus problem: shapes, K, top_k, window, mode, soft-cap, block size, sinks."""
    hkv = draw(st.integers(1, 2))
    s = draw(st.integers(1, 11))
    k_groups = draw(st.integers(1, 5))
    return dict(
        b=draw(st.integers(1, 2)),
        s=s,
        hkv=hkv,
        h=hkv * draw(st.integers(1, 3)),
        d=draw(st.integers(1, 4)),
        k_groups=k_groups,
        top_k=draw(st.integers(1, min(2, k_groups))),
        window=draw(st.integers(0, s + 1)),
        mode=draw(st.sampled_from(["soft", "hard", "hard_gated"])),
        local_only=draw(st.booleans()),
        softcap=draw(st.sampled_from([None, 0.7, 5.0])),
        gate_lambda=draw(st.sampled_from([1.0, 10.0, 40.0])),
        q_block=draw(st.integers(1, 12)),
        sinks=draw(st.sampled_from([0, 0, 1, 3, s + 1])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@given(problems())
def test_reference_equals_brute_force(p):
    q, k, v = random_qkv(p["b"], p["s"], p["h"], p["hkv"], p["d"], seed=p["seed"])
    probs = random_probs(p["b"], p["s"], p["k_groups"], seed=p["seed"] + 1, sharpness=2.0)
    kwargs = dict(
        window=p["window"],
        mode=p["mode"],
        gate_lambda=p["gate_lambda"],
        softcap=p["softcap"],
        local_only=p["local_only"],
        sinks=p["sinks"],
    )
    expected = brute_force_focus(q, k, v, probs, top_k=p["top_k"], **kwargs)
    member = Routing(probs).membership(p["top_k"]) if p["mode"] != "soft" else None
    got, lse = reference_attention(
        q,
        k,
        v,
        probs=None if p["mode"] == "hard" or p["local_only"] else probs,
        member=None if p["local_only"] else member,
        scale=p["d"] ** -0.5,
        q_block=p["q_block"],
        **kwargs,
    )
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert torch.isfinite(lse).all()
    public = focus_attention(q, k, v, Routing(probs), top_k=p["top_k"], **kwargs)
    torch.testing.assert_close(public, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "mode, top_k", [("soft", 1), ("hard", 1), ("hard", 2), ("hard_gated", 1), ("hard_gated", 3)]
)
@pytest.mark.parametrize("heads, heads_kv", [(2, 2), (4, 2), (3, 1)])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("window", [0, 2, 5])
def test_reference_equals_brute_force_grid(mode, top_k, heads, heads_kv, softcap, window):
    """Every combination the issue names, explicitly (the hypothesis test adds random shapes)."""
    q, k, v = random_qkv(2, 9, heads, heads_kv, 3, seed=window + 10 * heads)
    probs = random_probs(2, 9, 4, seed=window + 1, sharpness=2.0)
    kwargs = dict(window=window, mode=mode, top_k=top_k, softcap=softcap, gate_lambda=6.0)
    expected = brute_force_focus(q, k, v, probs, **kwargs)
    got = focus_attention(q, k, v, Routing(probs), **kwargs)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("sinks", [1, 3, 7])  # 7: more sinks than the window
@pytest.mark.parametrize(
    "mode, top_k, local_only", [("soft", 1, False), ("hard", 1, False), ("hard", 2, False),
                                ("hard", 1, True), ("hard_gated", 1, False),
                                ("hard_gated", 2, False)]
)  # fmt: skip
@pytest.mark.parametrize("window", [0, 2])
def test_reference_with_sinks_equals_brute_force(sinks, mode, top_k, local_only, window):
    q, k, v = random_qkv(2, 12, 4, 2, 3, seed=sinks + 10 * window)
    probs = random_probs(2, 12, 4, seed=sinks + 1, sharpness=2.0)
    kwargs = dict(window=window, mode=mode, top_k=top_k, local_only=local_only, gate_lambda=6.0)
    expected = brute_force_focus(q, k, v, probs, sinks=sinks, **kwargs)
    assert (expected - brute_force_focus(q, k, v, probs, **kwargs)).abs().max() > 1e-2  # matters
    got = focus_attention(q, k, v, Routing(probs), sinks=sinks, backend="reference", **kwargs)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("local_only", [False, True])
@pytest.mark.parametrize("q_block", [1, 16, 100, 1000])
def test_sinks_equal_masked_sdpa_at_any_block_size(local_only, q_block):
    """Larger than the brute force can afford (query blocks far past the sinks, whose local-only
    key set is the sinks plus the window): SDPA with the explicit mask."""
    b, s, h, d, w, k_groups, sinks = 2, 230, 2, 8, 9, 5, 4
    q, k, v = random_qkv(b, s, h, h, d, seed=19)
    probs = random_probs(b, s, k_groups, seed=20)
    member = Routing(probs).membership(1)
    pos = torch.arange(s)
    causal = pos[:, None] >= pos[None, :]
    near = causal & ((pos[:, None] - pos[None, :] <= w) | (pos[None, :] < sinks))  # [s, s]
    share = (member[:, :, None] & member[:, None, :]) != 0  # [b, s, s]
    mask = near[None] if local_only else near | (causal & share)
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None]
    ).transpose(1, 2)  # [b, h, s, d] -> [b, s, h, d]
    got, _ = reference_attention(
        q, k, v, probs=None, member=None if local_only else member, window=w, mode="hard",
        gate_lambda=10.0, softcap=None, scale=d**-0.5, local_only=local_only, sinks=sinks,
        q_block=q_block,
    )  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["soft", "hard"])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_window_covering_sequence_equals_dense_sdpa(mode, softcap):
    """With w >= s - 1 nothing is beyond the window: Focus is plain causal attention."""
    b, s, h, hkv, d = 2, 70, 4, 2, 8
    q, k, v = random_qkv(b, s, h, hkv, d, seed=3)
    probs = random_probs(b, s, 4, seed=4)
    got = focus_attention(q, k, v, probs, window=s - 1, mode=mode, softcap=softcap)
    expected = dense_causal(q, k, v, softcap=softcap)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_single_group_hard_equals_dense():
    """K = 1: every pair shares the group, so the hard pattern is full causal attention."""
    q, k, v = random_qkv(1, 90, 2, 1, 4, seed=5)
    probs = torch.ones(1, 90, 1, dtype=torch.float64)
    got = focus_attention(q, k, v, probs, window=3, mode="hard")
    torch.testing.assert_close(got, dense_causal(q, k, v), rtol=1e-10, atol=1e-10)


def test_local_only_equals_sliding_window_sdpa():
    b, s, h, hkv, d, w = 2, 150, 4, 4, 8, 17
    q, k, v = random_qkv(b, s, h, hkv, d, seed=6)
    pos = torch.arange(s)
    band = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] <= w)  # [s, s]
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=band
    ).transpose(1, 2)  # [b, h, s, d] -> [b, s, h, d]
    got = focus_attention(q, k, v, None, window=w, local_only=True)  # 2 query blocks
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_hard_pattern_equals_masked_sdpa():
    """Larger than the brute force can afford: hard mode = SDPA with the explicit mask."""
    b, s, h, hkv, d, w, k_groups, top_k = 2, 200, 4, 2, 8, 9, 5, 2
    q, k, v = random_qkv(b, s, h, hkv, d, seed=7)
    probs = random_probs(b, s, k_groups, seed=8)
    top = probs.topk(top_k, dim=-1).indices  # [b, s, top_k]
    onehot = F.one_hot(top, k_groups).sum(2)  # [b, s, K]
    share = torch.einsum("bik,bjk->bij", onehot, onehot) > 0  # [b, s, s]
    pos = torch.arange(s)
    causal = pos[:, None] >= pos[None, :]
    mask = causal & ((pos[:, None] - pos[None, :] <= w) | share)  # [b, s, s]
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(2, 2).transpose(1, 2),
        v.repeat_interleave(2, 2).transpose(1, 2),
        attn_mask=mask[:, None],
    ).transpose(1, 2)
    got = focus_attention(q, k, v, probs, window=w, mode="hard", top_k=top_k)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_block_size_does_not_change_result(mode):
    b, s, h, hkv, d = 1, 257, 2, 1, 4
    q, k, v = random_qkv(b, s, h, hkv, d, seed=9)
    probs = random_probs(b, s, 3, seed=10)
    member = Routing(probs).membership(1) if mode == "hard" else None
    kw = dict(
        probs=None if member is not None else probs,
        member=member,
        window=5,
        mode=mode,
        gate_lambda=10.0,
        softcap=None,
        scale=0.5,
        local_only=False,
    )
    outs = [reference_attention(q, k, v, q_block=blk, **kw) for blk in (1, 16, 100, 257, 1000)]
    for out, lse in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, outs[0][1], rtol=1e-12, atol=1e-12)


def test_lse_is_the_log_partition():
    """``return_lse``: lse equals log sum_j exp(score_ij + bias_ij) from the brute definition."""
    q, k, v = random_qkv(1, 6, 1, 1, 3, seed=11)
    probs = random_probs(1, 6, 2, seed=12)
    _, lse = focus_attention(q, k, v, probs, window=1, mode="soft", return_lse=True)
    i = 5
    scores = (q[0, i, 0] @ k[0, : i + 1, 0].T) / math.sqrt(3)  # [i + 1]
    affinity = probs[0, : i + 1] @ probs[0, i]  # [i + 1]
    gate = F.logsigmoid(10.0 * (affinity - 0.5))
    gate[i - 1 :] = 0.0  # keys i-1 and i are inside the window
    torch.testing.assert_close(lse[0, i, 0], torch.logsumexp(scores + gate, 0))


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_bf16_matches_fp32_within_bf16_tolerance(mode):
    b, s, h, hkv, d = 2, 160, 4, 2, 16
    q, k, v = random_qkv(b, s, h, hkv, d, seed=13, dtype=torch.bfloat16)
    probs = random_probs(b, s, 4, seed=14).float()
    got = focus_attention(q, k, v, probs, window=8, mode=mode, top_k=2)
    assert got.dtype == torch.bfloat16
    expected = focus_attention(q.float(), k.float(), v.float(), probs, window=8, mode=mode, top_k=2)
    torch.testing.assert_close(got.float(), expected, rtol=1.6e-2, atol=1e-2)
    # and against the float64 brute force on a small slice (bf16 end to end)
    small = [t[:1, :12] for t in (q, k, v)]
    brute = brute_force_focus(*small, probs[:1, :12], window=3, mode=mode, top_k=2)
    mine = focus_attention(*small, probs[:1, :12], window=3, mode=mode, top_k=2)
    torch.testing.assert_close(mine.double(), brute, rtol=1.6e-2, atol=1e-2)


def test_memory_kept_for_backward_is_linear_in_seq():
    """Blockwise + checkpointed: what autograd keeps is far below seq^2 per head."""
    b, s, h, d = 1, 2048, 2, 16
    q, k, v = random_qkv(b, s, h, h, d, seed=15, dtype=torch.float32, requires_grad=True)
    probs = random_probs(b, s, 8, seed=16).float().requires_grad_(True)
    saved = {}  # storage address -> bytes (slices of one tensor share a storage)

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = focus_attention(q, k, v, probs, window=128, mode="soft")
    quadratic = b * h * s * s * 4  # one fp32 score matrix per head
    assert sum(saved.values()) < 0.05 * quadratic, (sum(saved.values()), quadratic)
    out.square().sum().backward()  # and the backward still works
    assert q.grad is not None and probs.grad is not None and probs.grad.abs().sum() > 0


def dense_causal(q, k, v, softcap=None):
    """Plain causal attention ``[b, s, H, D]`` with GQA expansion and optional soft-capping."""
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)  # [b, H, s, D]
    kh = k.repeat_interleave(group, 2).transpose(1, 2)
    vh = v.repeat_interleave(group, 2).transpose(1, 2)
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [b, H, s, s]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    s = q.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return (scores.softmax(-1) @ vh).transpose(1, 2)  # [b, s, H, D]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_reference_on_cuda_equals_cpu(mode):
    q, k, v = random_qkv(2, 300, 8, 2, 32, seed=17, dtype=torch.float32)
    probs = random_probs(2, 300, 8, seed=18).float()
    cpu = focus_attention(q, k, v, probs, window=16, mode=mode, top_k=2, softcap=20.0)
    cuda = focus_attention(
        q.cuda(), k.cuda(), v.cuda(), probs.cuda(), window=16, mode=mode, top_k=2, softcap=20.0
    )
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-4, atol=1e-5)
