"""The ``triton`` backend's hard top-1 path (:mod:`focus_pretrain.focus.sorted_triton`): sparse
training (``hard_gated``) and hard attention through the fused kernels on the group-sorted
layout, against the reference: output, log-sum-exp and every gradient (``q``, ``k``, ``v``
and, gated, the soft assignments) on random shapes with GQA, documents, sinks and
soft-capping; and the loops skip the tiles of other segments (``packed=True``).

Without CUDA the kernels run in Triton's interpreter (``tests/conftest.py``); the GPU test at
the end runs them compiled in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch

from focus_pretrain.focus import Routing, focus_attention
from focus_pretrain.focus.pattern_settings import FocusPattern
from focus_pretrain.focus.soft_triton import (
    attend,
    cuda_refusal,
)
from tests.helpers import (
    ON_GPU,
    assert_close,
    needs_triton,
    random_documents,
    random_probs,
    random_qkv,
)

pytestmark = needs_triton


def run_both(p: dict, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """``(got, want)``: ``[out, lse, dq, dk, dv(, dprobs)]`` of the triton backend and of the
    reference (fp32, the same rounded inputs) on one random top-1 call, in fp32 on the CPU."""
    b, n, h, hkv, d = p["b"], p["n"], p["h"], p["hkv"], p["d"]
    q, k, v = random_qkv(b, n, h, hkv, d, seed=p["seed"], dtype=torch.float32)
    probs = random_probs(b, n, p["groups"], seed=p["seed"] + 1, sharpness=2.0).float()
    documents = random_documents(b, n, p["seed"] + 2, 0.03) if p.get("documents") else None
    gen = torch.Generator().manual_seed(p["seed"] + 3)
    d_out, d_lse = torch.randn(b, n, h, d, generator=gen), torch.randn(b, n, h, generator=gen)
    gated = p["mode"] == "hard_gated"
    results = []
    for name in ("triton", "reference"):
        low = dtype if name == "triton" else torch.float32
        leaves = [t.to(device, dtype).to(low).requires_grad_(True) for t in (q, k, v)]
        leaves.append(probs.to(device).requires_grad_(gated))
        out, lse = focus_attention(
            *leaves[:3], Routing(leaves[3]), window=p["window"], mode=p["mode"], top_k=1,
            backend=name, sinks=p.get("sinks", 0), softcap=p.get("softcap"), return_lse=True,
            documents=None if documents is None else documents.to(device), check_finite=False,
        )  # fmt: skip
        loss = (out.float() * d_out.to(device)).sum() + (lse * d_lse.to(device)).sum()
        grads = torch.autograd.grad(loss, leaves if gated else leaves[:3])
        results.append([t.detach().float().cpu() for t in (out, lse, *grads)])
    return results


CASES = [
    dict(mode="hard_gated", b=2, n=90, h=4, hkv=2, d=16, groups=4, window=6),  # GQA
    dict(mode="hard_gated", b=1, n=120, h=2, hkv=1, d=32, groups=3, window=0)
    | dict(sinks=3, softcap=3.0, documents=True),
    dict(mode="hard_gated", b=1, n=70, h=2, hkv=2, d=16, groups=1, window=4),  # one group
    dict(mode="hard_gated", b=1, n=1, h=2, hkv=2, d=16, groups=4, window=3),  # one token
    dict(mode="hard", b=2, n=77, h=2, hkv=2, d=16, groups=8, window=10, sinks=2, documents=True),
    dict(mode="hard", b=1, n=64, h=4, hkv=1, d=16, groups=5, window=3, softcap=2.0),
]


def _case_id(p: dict) -> str:
    extras = [key for key in ("sinks", "softcap", "documents") if p.get(key)]
    return "-".join([p["mode"], f"n{p['n']}", f"K{p['groups']}", *extras])


@pytest.mark.parametrize("p", CASES, ids=_case_id)
def test_sorted_top1_equals_reference(p):
    """Exact in fp32 (interpreter on CPU, compiled on CUDA), gradients included."""
    got, want = run_both({**p, "seed": 5}, device="cuda" if ON_GPU else "cpu")
    assert len(got) == (6 if p["mode"] == "hard_gated" else 5)
    if p["n"] > p["window"] + 1:  # pairs beyond the window exist
        assert want[-1].abs().max() > 0  # real gradients (the assignments' when gated)
    assert_close(got, want, 1e-4)


def _two_segments(nan_at: str, packed: bool) -> tuple[torch.Tensor, ...]:
    """One packed call of two segments of 64 tokens (tile-aligned), with NaN in ``v`` of the
    first (``nan_at="v"``) or in ``q`` of the second (``"q"``): ``(out, dk, dv)``."""
    n, h, d = 128, 1, 16
    q, k, v = random_qkv(1, n, h, h, d, seed=9, dtype=torch.float32)
    probs = random_probs(1, n, 4, seed=10, sharpness=2.0).float()
    if nan_at == "v":
        v[:, :64] = float("nan")
    else:
        q[:, 64:] = float("nan")
    start = torch.zeros(1, n, dtype=torch.int64)  # [1, T] segment starts (indices)
    start[:, 64:] = 64
    rule = start + torch.arange(n)[None] % 64 * 2  # [1, T] spread-out positions
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    out, lse = attend(
        *leaves, probs, probs, FocusPattern(window=16, gate_lambda=10.0, scale=d**-0.5),
        doc_q=start, doc_k=start, pos_q=rule, pos_k=rule, packed=packed,
    )  # fmt: skip
    grads = torch.autograd.grad(out.sum() + lse.sum(), leaves[1:])
    return out, *grads


def test_packed_loops_skip_the_tiles_of_other_segments():
    """The loops visit, per query tile, the key tiles from its segment's start to the diagonal
    (forward and dQ) and, per key tile, the query tiles to its segment's end (dK/dV): NaN in
    tiles that are skipped reaches nothing, while the all-keys loops of a ring step's positions
    (``packed=False``, the control) read them."""
    out, dk, dv = _two_segments("v", packed=True)
    assert out[:, 64:].isfinite().all()  # the second segment's queries never load the first's
    out, dk, dv = _two_segments("q", packed=True)
    assert dk[:, :64].isfinite().all() and dv[:, :64].isfinite().all()
    control = _two_segments("v", packed=False)[0]
    assert not control[:, 64:].isfinite().all()
    control = _two_segments("q", packed=False)[1]
    assert not control[:, :64].isfinite().all()


def test_fp32_at_head_dim_256_is_refused_on_cuda_with_the_reason():
    """Its dQ kernel spills registers at every tile on sm_90 (tests/unit/test_triton_registers.py
    reads the compiler's report); bf16 is launched."""
    reason = cuda_refusal(torch.float32, 256, packed=True)
    assert "spills registers" in reason and "bf16/fp16 or use backend 'flex'" in reason
    assert cuda_refusal(torch.bfloat16, 256, packed=True) is None
    assert cuda_refusal(torch.bfloat16, 128, packed=True) is None


def test_packed_needs_positions_and_document_starts():
    q, k, v = random_qkv(1, 8, 2, 2, 16, seed=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="packed=True needs positions, document starts"):
        attend(q, k, v, None, None, FocusPattern(window=4, scale=0.25), packed=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "p",
    [
        dict(mode="hard_gated", b=2, n=1500, h=8, hkv=2, d=64, groups=8, window=64, sinks=4),
        dict(mode="hard_gated", b=1, n=2100, h=4, hkv=4, d=128, groups=8, window=128)
        | dict(documents=True, softcap=30.0),
        dict(mode="hard", b=1, n=1800, h=4, hkv=1, d=128, groups=4, window=32),
    ],
    ids=["gqa-sinks", "d128-documents-softcap", "hard"],
)
def test_sorted_top1_on_gpu(dtype, p):
    """Compiled kernels at longer lengths: bf16 (bf16-rounded reference inputs) and fp32."""
    if dtype == torch.float32 and p["d"] > 64:
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 at D > 64 runs on TF32 products
    try:
        got, want = run_both({**p, "seed": 31}, device="cuda", dtype=dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    assert_close(got, want, 2e-2 if dtype == torch.bfloat16 else 5e-3)
