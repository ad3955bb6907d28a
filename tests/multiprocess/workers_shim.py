"""Workers for the CPU-shim tests (run in real gloo processes by tests.distributed)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def tensor_parallel_linears_and_rng(rank: int, world_size: int) -> dict:
    """ColumnParallelLinear -> RowParallelLinear at TP=world_size, and the RNG tracker."""
    from focus_pretrain.parallel import apply_cpu_shim

    assert apply_cpu_shim()
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    model_parallel_cuda_manual_seed(1234)
    config = ModelParallelConfig(tensor_model_parallel_size=world_size, use_cpu_initialization=True)

    def init(w):
        return torch.nn.init.normal_(w, std=0.2)

    col = ColumnParallelLinear(
        16, 24, config=config, init_method=init, bias=True, gather_output=False
    )
    row = RowParallelLinear(
        24,
        8,
        config=config,
        init_method=init,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
    )
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(7), requires_grad=True)
    hidden, _ = col(x)  # [5, 24 / tp]
    y, _ = row(torch.nn.functional.gelu(hidden))  # [5, 8], all-reduced
    y.square().sum().backward()

    def gather(t, dim):
        parts = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim)

    ones = torch.ones(4096)
    default_mask = torch.nn.functional.dropout(ones, 0.5)  # default (data-parallel) stream
    with get_cuda_rng_tracker().fork():
        tp_mask = torch.nn.functional.dropout(ones, 0.5)  # model-parallel stream
    after_mask = torch.nn.functional.dropout(ones, 0.5)
    return dict(
        y=y.detach(),
        x_grad=x.grad,
        col_weight_grad=gather(col.weight.grad, 0),
        row_weight_grad=gather(row.weight.grad, 1),
        col_weight=gather(col.weight.detach(), 0),
        device=str(col.weight.device),
        default_mask=default_mask,
        tp_mask=tp_mask,
        after_mask=after_mask,
    )
