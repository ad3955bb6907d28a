"""The ``sdpa`` backend (plain causal attention through PyTorch's SDPA) against the reference,
its refusals, and ``auto``'s choice of it."""

from __future__ import annotations

import pytest
import torch

from focus_pretrain.focus import focus_attention
from focus_pretrain.focus.backends import AttentionRequest, select_backend
from tests.helpers import assert_close, random_probs, random_qkv

pytestmark = pytest.mark.torch  # also under the lowest supported torch

UNLIMITED = 2**62  # the dense model's window


def _request(**overrides) -> AttentionRequest:
    base = dict(device="cuda", dtype=torch.bfloat16, batch=1, seq=4096, heads=16, heads_kv=4,
                head_dim=128, mode="soft", top_k=1, local_only=True, window=UNLIMITED,
                softcap=False, needs_grad=True, needs_lse=False)  # fmt: skip
    return AttentionRequest(**{**base, **overrides})


@pytest.mark.parametrize("heads, heads_kv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("window", [UNLIMITED, 36])  # 36: exactly the sequence (37 tokens)
def test_sdpa_equals_the_reference_with_gradients(heads, heads_kv, window):
    q, k, v = random_qkv(2, 37, heads, heads_kv, 16, seed=heads, requires_grad=True)
    cot = torch.randn(q.shape, dtype=q.dtype)
    results = []
    for backend in ("reference", "sdpa"):
        out = focus_attention(
            q, k, v, None, window=window, local_only=True, scale=0.3, sinks=2, backend=backend
        )
        results.append([out, *torch.autograd.grad(out, (q, k, v), cot)])
    assert_close(results[1], results[0], tol=1e-10)


def test_the_dot_gate_soft_pattern_trains_through_sdpa():
    """The dot form's soft pattern is plain causal attention: sdpa (named) equals the
    reference, the routers' gradient included, in fp32 and bf16."""
    q, k, v = random_qkv(2, 40, 4, 2, 16, seed=9, requires_grad=True)
    probs = random_probs(2, 40, 6, seed=10, sharpness=2.0).requires_grad_(True)
    cot = torch.randn(q.shape, dtype=q.dtype)
    results = []
    for backend in ("reference", "sdpa"):
        out = focus_attention(q, k, v, probs, gate_form="dot", backend=backend, window=5)
        results.append([out, *torch.autograd.grad(out, (q, k, v, probs), cot)])
    assert_close(results[1], results[0], tol=1e-10)
    bf16 = [t.detach().bfloat16() for t in (q, k, v)]
    got = focus_attention(*bf16, probs.float().detach(), gate_form="dot", backend="sdpa")
    want = focus_attention(*bf16, probs.float().detach(), gate_form="dot", backend="reference")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(window=10), "shorter than the sequence"),
        (dict(return_lse=True), "log-sum-exp"),
        (dict(softcap=5.0), "soft-capping"),
        (dict(documents=torch.tensor([[0] * 20 + [1] * 20])), "packed documents"),
        (dict(local_only=False, mode="hard"), "mode 'hard'"),
    ],
)
def test_sdpa_refuses_what_it_does_not_compute(kwargs, reason):
    q, k, v = random_qkv(1, 40, 2, 2, 8, seed=1)
    call = {**dict(window=UNLIMITED, local_only=True, backend="sdpa"), **kwargs}
    probs = random_probs(1, 40, 3, seed=2)
    with pytest.raises(ValueError, match=reason):
        focus_attention(q, k, v, probs, **call)


def test_auto_picks_sdpa_for_plain_causal_attention_on_cuda_only():
    assert select_backend("auto", _request()).name == "sdpa"
    assert select_backend("auto", _request(needs_lse=True)).name != "sdpa"
    assert select_backend("auto", _request(window=128)).name != "sdpa"  # a sliding window
    assert select_backend("auto", _request(documents=True)).name != "sdpa"
    # the CPU keeps the reference (bit-identical CPU runs); sdpa by name only
    cpu = _request(device="cpu", dtype=torch.float32)
    assert select_backend("auto", cpu).name == "reference"
    assert select_backend("sdpa", cpu).name == "sdpa"
