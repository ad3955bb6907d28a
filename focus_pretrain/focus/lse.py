"""Merging partial attention results by their log-sum-exp.

Attention over disjoint key sets (a window band and the sinks, the local part and the group
part, the blocks of a ring) combines exactly from each part's output and log-sum-exp: every
backend and the ring use :func:`merge_by_lse`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from focus_pretrain.focus.compiled import fused_on_cuda
from focus_pretrain.focus.pattern import at_least_fp32


def merge_by_lse(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Attention over the union of two disjoint key sets from each one's ``(out, lse)``.

    ``out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b)``; a part with ``lse = -inf``
    (no key) contributes nothing. Shapes: ``out [b, n, H, D]``, ``lse [b, n, H]``; the result is
    in ``out_a``'s dtype with an at-least-fp32 ``lse``. On CUDA without autograd the same
    arithmetic runs as one compiled kernel (one pass over the outputs instead of six).
    """
    tensors = (*a, *b)
    if not any(t.requires_grad for t in tensors):
        return _merge(*tensors)  # compiled on CUDA
    return _merge.eager(*tensors)


@fused_on_cuda(dynamic=True)
def _merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    lse_a, lse_b = at_least_fp32(lse_a), at_least_fp32(lse_b)
    lse = torch.logaddexp(lse_a, lse_b)  # [b, n, H]
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe)[..., None]  # [b, n, H, 1]; 0 where lse_a = -inf
    w_b = torch.exp(lse_b - safe)[..., None]
    out = w_a * at_least_fp32(out_a) + w_b * at_least_fp32(out_b)
    return out.to(out_a.dtype), lse
