"""Gradients of sequence-parallel parameters: summed over the tensor-parallel group.

Under Megatron sequence parallelism (``parallel.sequence_parallel``) each tensor-parallel rank
holds ``1 / tp`` of the tokens ``[s / tp, b, h]`` between the tensor-parallel regions. The
parameters used there are replicated over the TP ranks but see only their rank's tokens, so
each rank's gradient is a partial sum over the sequence: the norms' weights and biases
(:class:`~focus_pretrain.model.layers.TorchNorm`), the row-parallel linears' biases (GPT-2)
and the Focus routers' projections. Megatron tags them ``param.sequence_parallel = True``
and its own ``finalize_model_grads`` all-reduces them; DeepSpeed never calls that, so without
:func:`reduce_sequence_parallel_grads` every rank would step with its own partial gradient
(wrong, and the replicas drift apart).

The sum happens in a tensor hook on each tagged parameter (``param.register_hook``): autograd
runs it on the gradient as it is produced, before the parameter's ``AccumulateGrad`` and so
before DeepSpeed's hooks, which under ZeRO-2 move the gradient into a partitioned buffer and
free ``param.grad``. It therefore works alike for ZeRO 0-3, gradient accumulation (each
micro-batch's gradient is summed once) and activation recompute (the hook fires inside the
recomputed backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle


def sequence_parallel_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every parameter tagged ``sequence_parallel = True``."""
    return [
        (name, param)
        for name, param in model.named_parameters()
        if getattr(param, "sequence_parallel", False)
    ]


def reduce_sequence_parallel_grads(model: nn.Module) -> list[RemovableHandle]:
    """Sum the gradients of ``model``'s sequence-parallel parameters over the tensor-parallel
    group, whoever runs the backward (DeepSpeed ZeRO or plain autograd).

    Call once after building the model, before freezing parameters (a hook cannot be put on a
    tensor that does not require a gradient; a frozen parameter's hook simply never fires) and
    before ``deepspeed.initialize``. Does nothing for a model without sequence parallelism.

    Returns:
        The hooks' handles (``handle.remove()`` undoes them).
    """
    params = sequence_parallel_parameters(model)
    if not params:
        return []
    group = parallel_state.get_tensor_model_parallel_group()
    frozen = [name for name, param in params if not param.requires_grad]
    if frozen:
        raise ValueError(
            f"reduce_sequence_parallel_grads must run before parameters are frozen; "
            f"{frozen[0]} does not require a gradient"
        )

    def hook(grad: Tensor) -> Tensor:
        summed = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(summed, group=group)
        return summed

    return [param.register_hook(hook) for _, param in params]
