"""The ``dot`` gate form (focus_pretrain/focus/gate_forms.py): against the brute-force loop, its
gradients (the routers' included) against a differentiable masked-dense oracle, and in the model.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from focus_pretrain.focus import FocusConfig, focus_attention
from focus_pretrain.focus.gate_forms import dot_gate_channels
from tests.helpers import assert_close, brute_force_focus, random_probs, random_qkv

pytestmark = pytest.mark.torch  # also under the lowest supported torch


def _ids(documents: list[list[int]] | None):
    return None if documents is None else torch.tensor(documents)


@st.composite
def problems(draw):
    """A random tiny problem: shapes (GQA), K, top_k, window, mode, soft-cap, sinks, documents."""
    hkv = draw(st.integers(1, 2))
    s = draw(st.integers(1, 10))
    b = draw(st.integers(1, 2))
    k_groups = draw(st.integers(1, 9))
    docs = draw(st.booleans())
    return dict(
        b=b, s=s, hkv=hkv, h=hkv * draw(st.integers(1, 2)), d=draw(st.integers(1, 5)),
        k_groups=k_groups, top_k=draw(st.integers(1, min(2, k_groups))),
        window=draw(st.integers(0, s)), mode=draw(st.sampled_from(["soft", "hard", "hard_gated"])),
        softcap=draw(st.sampled_from([None, 3.0])), gate_lambda=draw(st.sampled_from([1.0, 10.0])),
        sinks=draw(st.sampled_from([0, 1, 2])), seed=draw(st.integers(0, 2**31 - 1)),
        documents=[draw(st.lists(st.integers(0, 2), min_size=s, max_size=s)) for _ in range(b)]
        if docs else None,
    )  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(problems())
def test_dot_gate_equals_brute_force(p):
    q, k, v = random_qkv(p["b"], p["s"], p["h"], p["hkv"], p["d"], seed=p["seed"])
    probs = random_probs(p["b"], p["s"], p["k_groups"], seed=p["seed"] + 1, sharpness=2.0)
    kwargs = dict(
        window=p["window"], mode=p["mode"], top_k=p["top_k"], gate_lambda=p["gate_lambda"],
        softcap=p["softcap"], sinks=p["sinks"],
    )  # fmt: skip
    ids = [[a for a in row] for row in p["documents"]] if p["documents"] else None
    want = brute_force_focus(q, k, v, probs, gate_form="dot", documents=ids, **kwargs)
    got = focus_attention(
        q, k, v, probs, gate_form="dot", backend="reference", documents=_ids(ids), **kwargs
    )
    assert got.shape == q.shape
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9)


def _masked_dense(q, k, v, probs, *, keep, gate_lambda, softcap):
    """A differentiable oracle: ``softmax(softcap(scale q.k + lambda g.g) + mask) v`` over a
    given ``keep [b, s, s]`` mask. ``[b, s, H, D]`` out."""
    heads = q.shape[2]
    kk = k.repeat_interleave(heads // k.shape[2], dim=2)  # [b, s, Hkv, D] -> [b, s, H, D]
    vv = v.repeat_interleave(heads // v.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * q.shape[-1] ** -0.5
    scores = scores + gate_lambda * torch.einsum("bqc,bkc->bqk", probs, probs)[:, None]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~keep[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), vv)


@pytest.mark.parametrize("mode", ["soft", "hard_gated"])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_dot_gate_gradients_reach_the_router(mode, softcap):
    """Forward and every gradient (q, k, v and the soft assignments) against the oracle, GQA,
    fp64; the routers learn through the channels (a non-zero assignment gradient)."""
    b, s, h, hkv, d, groups, window = 2, 24, 4, 2, 8, 5, 3
    q, k, v = random_qkv(b, s, h, hkv, d, seed=3, requires_grad=True)
    probs = random_probs(b, s, groups, seed=4, sharpness=2.0).requires_grad_(True)
    pos = torch.arange(s)
    causal = pos[None, :] <= pos[:, None]  # [s, s]
    if mode == "soft":
        keep = causal.expand(b, s, s)
    else:
        top = probs.argmax(-1)  # [b, s]
        same = top[:, :, None] == top[:, None, :]  # [b, s, s]
        keep = causal & ((pos[:, None] - pos[None, :] <= window) | same)
    out = focus_attention(
        q, k, v, probs, window=window, mode=mode, gate_form="dot", softcap=softcap,
        backend="reference",
    )  # fmt: skip
    want = _masked_dense(q, k, v, probs, keep=keep, gate_lambda=10.0, softcap=softcap)
    cot = torch.randn_like(want)
    got_grads = torch.autograd.grad(out, (q, k, v, probs), cot)
    want_grads = torch.autograd.grad(want, (q, k, v, probs), cot)
    assert_close([out, *got_grads], [want, *want_grads], tol=1e-9)
    assert got_grads[3].abs().max() > 1e-3


def test_dot_gate_channels_add_the_term_to_every_score():
    """``scale q'.k' = scale q.k + lambda g.g``, the channels padded to a multiple of 8, v
    padded by zeros; in bf16 too."""
    q, k, v = random_qkv(1, 6, 2, 1, 16, seed=5)
    probs = random_probs(1, 6, 3, seed=6)
    q2, k2, v2 = dot_gate_channels(q, k, v, probs, gate_lambda=7.0, scale=0.25)
    assert q2.shape == (1, 6, 2, 24) and k2.shape == v2.shape == (1, 6, 1, 24)
    got = torch.einsum("bqhd,bkd->bhqk", q2, k2[:, :, 0]) * 0.25
    want = torch.einsum("bqhd,bkd->bhqk", q, k[:, :, 0]) * 0.25 + 7.0 * (probs @ probs.mT)[:, None]
    torch.testing.assert_close(got, want)
    assert torch.equal(v2[..., 16:], torch.zeros_like(v2[..., 16:]))
    qb, kb, _ = dot_gate_channels(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), probs.float(), gate_lambda=7.0, scale=0.25
    )
    assert qb.dtype == kb.dtype == torch.bfloat16


def test_gate_form_is_validated():
    with pytest.raises(ValueError, match="gate_form"):
        FocusConfig(gate_form="linear")
    q, k, v = random_qkv(1, 4, 1, 1, 4, seed=1)
    with pytest.raises(ValueError, match="gate_form"):
        focus_attention(q, k, v, random_probs(1, 4, 2, seed=2), gate_form="cosine")
    # the dot form's soft pattern is plain causal attention, its sparse training the hard
    # pattern: a named backend must compute those
    assert FocusConfig(gate_form="dot", backend="reference").gate_form == "dot"
    assert FocusConfig(gate_form="dot", backend="segments", training_mode="hard").backend
    with pytest.raises(ValueError, match="gate_form='dot'"):
        FocusConfig(gate_form="dot", backend="segments")  # soft: segments has no causal layer
