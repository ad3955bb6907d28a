"""The Focus model on one GPU (NCCL, megatron-core on CUDA, no CPU shim): every training and
inference backend gives the reference's loss, gradients and logits, in fp32 and bf16.

Skipped without CUDA; run by ``tools/gpu_check.sh`` on the GPU machine."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_workers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WORKER = "tests.gpu.workers_cuda:model_on_cuda"
FOCUS = dict(num_groups=4, window=32)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_agree_in_the_model_on_cuda(dtype):
    """Training through ``flex`` (compiled FlexAttention, soft gate) and ``triton`` (the fused
    kernels) and eval through ``flex``/``decomposed`` (hard top-1) against the reference
    backend, same weights."""
    cases = [
        dict(dtype=dtype, backend="reference", inference_backend="reference", **FOCUS),
        dict(dtype=dtype, backend="flex", inference_backend="flex", **FOCUS),
        dict(dtype=dtype, backend="flex", inference_backend="decomposed", **FOCUS),
        dict(dtype=dtype, backend="triton", inference_backend="flex", **FOCUS),
    ]
    ref, flex, decomposed, fused = run_workers(WORKER, 1, cases, backend="nccl")[0]
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # relative L2: fp32 rounding; bf16 operands
    for fast in (flex, decomposed):
        assert fast["devices"] == {"cuda"}
        assert torch.isfinite(fast["logits"]).all()
        assert _relative(fast["logits"], ref["logits"]) < tol
        assert abs(fast["loss"] - ref["loss"]) < tol * ref["loss"].abs()
    assert abs(fused["loss"] - ref["loss"]) < tol * ref["loss"].abs()  # the triton kernels
    for train in (flex, fused):
        for name, grad in ref["grads"].items():
            assert torch.isfinite(train["grads"][name]).all(), name
            assert _relative(train["grads"][name], grad) < 5 * tol, name
        assert any(".router." in n and g.abs().sum() > 0 for n, g in train["grads"].items())
