"""Packed documents: a sequence of documents A|B|C attends exactly like each document alone.

The reference with documents is checked against the brute-force loop; then every backend's
output (and, where it is differentiable, the gradients of q, k, v and the soft assignments) on a
packed batch must equal the per-document runs, including documents shorter than the window, a
document of one token, attention sinks (counted from each document's start) and GQA.
"""

from __future__ import annotations

import pytest
import torch

from focus_pretrain.focus import Routing, focus_attention
from focus_pretrain.focus.pattern import allowed_pairs, document_starts
from tests.helpers import (
    brute_force_focus,
    document_spans,
    packed_documents,
    random_probs,
    random_qkv,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # eager CPU FlexAttention notice

LONG_DOCS = [13, 40, 27]  # every document longer than the window
SHORT_DOCS = [3, 1, 5, 30, 2, 9]  # shorter than the window, and one of a single token


def forward_backends(mode: str, top_k: int, local_only: bool) -> list[str]:
    """The backends that must compute packed documents for this request (forward)."""
    names = ["reference", "flex"]
    if local_only or (mode == "hard" and top_k == 1):
        names.append("decomposed")
    return names


def test_document_starts_from_any_ids():
    ids = torch.tensor([[7, 7, 3, 3, 3, 7, 9], [0, 1, 2, 2, 2, 2, 2]])
    starts = document_starts(ids)
    assert starts.tolist() == [[0, 0, 2, 2, 2, 5, 6], [0, 1, 2, 2, 2, 2, 2]]
    assert torch.equal(document_starts(starts), starts)  # start positions are valid ids


def test_pattern_never_crosses_documents():
    ids = packed_documents(1, SHORT_DOCS, seed=0)
    starts = document_starts(ids)
    pos = torch.arange(ids.shape[1])
    member = torch.randint(1, 16, ids.shape)
    allowed = allowed_pairs(
        pos, pos, 4, member_q=member, member_k=member, sinks=2, q_doc=starts, k_doc=starts
    )[0]
    same = starts[0][:, None] == starts[0][None, :]
    assert not (allowed & ~same).any()
    first = pos - starts[0] < 2  # each document's first two tokens are sinks
    assert (allowed | ~(same & first[None, :] & (pos[:, None] >= pos[None, :]))).all()


@pytest.mark.parametrize(
    ("mode", "top_k", "local_only", "sinks", "hkv"),
    [("hard", 1, False, 0, 1), ("hard", 2, False, 2, 2), ("soft", 1, False, 1, 1),
     ("soft", 1, True, 2, 2)],
)  # fmt: skip
def test_reference_with_documents_equals_brute_force(mode, top_k, local_only, sinks, hkv):
    lengths = [4, 1, 9, 2, 6]
    ids = packed_documents(2, lengths, seed=3)
    q, k, v = random_qkv(2, ids.shape[1], 2, hkv, 4, seed=5)
    probs = random_probs(2, ids.shape[1], 3, seed=6)
    kwargs = dict(window=3, mode=mode, top_k=top_k, local_only=local_only, sinks=sinks)
    got = focus_attention(q, k, v, Routing(probs), documents=ids, backend="reference", **kwargs)
    want = brute_force_focus(q, k, v, probs, documents=ids.tolist(), **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def run_packed_and_alone(backend, ids, *, grads: bool, dtype=torch.float64, **kwargs):
    """``(packed, alone)`` outputs ``[b, s, H, D]`` (and the input gradients of a random
    weighted sum when ``grads``): one call on the packed batch, one call per document."""
    b, s = ids.shape
    q, k, v = random_qkv(b, s, 4, kwargs.pop("hkv"), 8, seed=11, dtype=dtype, requires_grad=grads)
    probs = random_probs(b, s, 4, seed=12, sharpness=2.0).to(dtype).requires_grad_(grads)
    weight = torch.randn(b, s, 4, 8, generator=torch.Generator().manual_seed(13), dtype=dtype)
    packed = focus_attention(q, k, v, Routing(probs), documents=ids, backend=backend, **kwargs)
    alone = torch.zeros_like(packed)
    for r, spans in enumerate(document_spans(ids)):
        for start, end in spans:
            rows = (slice(r, r + 1), slice(start, end))
            alone[rows] = focus_attention(
                q[rows], k[rows], v[rows], Routing(probs[rows]), backend=backend, **kwargs
            )
    results = [packed, alone]
    if grads:
        for out in (packed, alone):
            inputs = (q, k, v, probs)  # probs are unused in hard mode: zero gradient
            found = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)
            for g, t in zip(found, inputs, strict=True):
                results.append(torch.zeros_like(t) if g is None else g)
    return results


CASES = [
    ("hard", 1, False, 0),
    ("hard", 2, False, 0),
    ("hard", 1, False, 2),
    ("soft", 1, False, 0),
    ("soft", 1, False, 2),
    ("hard", 1, True, 0),
    ("hard", 1, True, 2),
]


@pytest.mark.parametrize("lengths", [LONG_DOCS, SHORT_DOCS], ids=["long", "short"])
@pytest.mark.parametrize(("mode", "top_k", "local_only", "sinks"), CASES)
@pytest.mark.parametrize("hkv", [1, 2], ids=["gqa", "mha"])
def test_packed_documents_equal_each_document_alone(lengths, mode, top_k, local_only, sinks, hkv):
    ids = packed_documents(2, lengths, seed=1)
    kwargs = dict(window=6, mode=mode, top_k=top_k, local_only=local_only, sinks=sinks, hkv=hkv)
    for backend in forward_backends(mode, top_k, local_only):
        with torch.no_grad():
            packed, alone = run_packed_and_alone(backend, ids, grads=False, **dict(kwargs))
        torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5, msg=backend)
    packed, alone, *grads = run_packed_and_alone("reference", ids, grads=True, **dict(kwargs))
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads[:4], grads[4:], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_documents_are_validated():
    q, k, v = random_qkv(1, 6, 2, 2, 4, seed=0)
    probs = random_probs(1, 6, 2, seed=1)
    with pytest.raises(ValueError, match=r"documents must be \[batch=1, seq=6\]"):
        focus_attention(q, k, v, Routing(probs), documents=torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        focus_attention(q, k, v, Routing(probs), documents=torch.zeros(1, 6))


def test_pattern_density_counts_each_document_alone():
    """Kept pairs of packed documents: the sum of each document's count alone (brute force
    over the allowed pairs), over the causal pairs inside documents."""
    from focus_pretrain.focus.pattern import count_allowed_pairs, pattern_density

    ids = packed_documents(2, SHORT_DOCS, seed=2)
    starts = document_starts(ids)
    member = torch.randint(1, 16, ids.shape, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(ids.shape[1])
    allowed = allowed_pairs(
        pos, pos, 4, member_q=member, member_k=member, sinks=2, q_doc=starts, k_doc=starts
    )  # [b, s, s]
    counts = count_allowed_pairs(member, 4, 2, starts)
    assert counts.tolist() == allowed.flatten(1).sum(1).tolist()
    causal = (starts[:, :, None] == starts[:, None, :]) & (pos[:, None] >= pos[None, :])
    want = allowed.flatten(1).sum(1).double() / causal.flatten(1).sum(1).double()
    torch.testing.assert_close(pattern_density(member, 4, 2, starts), want)
