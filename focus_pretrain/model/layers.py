"""Layer pieces megatron-core lacks for some attention families, and the norm of every family.

* :class:`TorchNorm`: PyTorch's ``RMSNorm``/``LayerNorm`` as Megatron's local spec builds them
  (``WrappedTorchNorm``), which also works under sequence parallelism: it tags its parameters
  ``sequence_parallel`` (each tensor-parallel rank normalises only its slice of the tokens, so
  their gradients are partial sums; :mod:`focus_pretrain.parallel.sequence_parallel` sums
  them). Megatron's wrapper refuses sequence parallelism without apex.
* :class:`PostNormMLP`: an MLP whose output is normalised before the residual add (OLMo-2's
  ``post_feedforward_layernorm``, Gemma-2's sandwich norm).
* :class:`FullWidthQKNorm`: OLMo-2 normalises the *whole* query (key) projection, all heads
  together, not each head (Megatron's ``qk_layernorm`` is per head). Under tensor parallelism a
  rank holds only its heads, so the sum of squares is all-reduced over the TP group, forward and
  backward.
* :class:`PerHeadQKNorm`: Qwen3 and Gemma-3 normalise each query (key) head over its
  ``head_dim`` with one weight shared by all heads. Megatron's ``qk_layernorm`` does the same
  but leaves the weight's gradient per TP rank (each rank sees only its heads; Megatron's own
  DDP sums it later, our DeepSpeed engine does not), so here the weight enters the forward
  through ``copy_to_tensor_model_parallel_region``, whose backward sums it over TP.

Layout: Megatron's ``[s, b, ...]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from torch import Tensor, nn


class _AllReduceSum(torch.autograd.Function):
    """Sum over the tensor-parallel group in forward *and* backward.

    Every rank's output depends on every rank's input through the sum, so the gradient of the
    local input is the sum of all ranks' output gradients.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        x = x.clone()
        dist.all_reduce(x, group=parallel_state.get_tensor_model_parallel_group())
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        return grad


class TorchNorm:
    """``torch.nn.RMSNorm`` or ``torch.nn.LayerNorm`` (``config.normalization``) over
    ``hidden_size`` (the last dim of ``[s, b, h]`` or ``[s / tp, b, h]``), built like
    Megatron's ``WrappedTorchNorm`` (fp32 weights whatever ``params_dtype``: the same numbers),
    with its parameters tagged ``sequence_parallel = config.sequence_parallel``.

    Only used for norms between the tensor-parallel regions (a layer's input, pre-MLP and
    post norms, the final norm), which run on the sequence-parallel region under sequence
    parallelism. A class whose ``__new__`` returns the PyTorch module, as Megatron's wrapper,
    so that ``build_module`` calls it with ``(config, hidden_size, eps)``.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused) -> nn.Module:
        if config.normalization == "RMSNorm":
            norm: nn.Module = nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(
                f"normalization must be RMSNorm or LayerNorm, got {config.normalization!r}"
            )
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class FullWidthQKNorm(MegatronModule):
    """RMSNorm over all heads of the query (or key) projection, TP-aware.

    Megatron builds q/k norms with ``hidden_size = head_dim``; this module ignores that and
    normalises ``[s, b, n_local, d]`` over ``n * d`` (all ranks' heads). Its weight
    ``[n_local * d]`` is the rank's slice of the full ``[n * d]`` weight (``partition_dim = 0``).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, *, which: str) -> None:
        super().__init__(config=config)
        tp = config.tensor_model_parallel_size
        heads = config.num_attention_heads if which == "q" else config.num_query_groups
        self.local_heads, self.head_dim, self.eps = heads // tp, config.kv_channels, eps
        self.full_width = heads * config.kv_channels
        self.weight = nn.Parameter(
            torch.ones(self.local_heads * self.head_dim, dtype=config.params_dtype)
        )
        self.weight.tensor_model_parallel = tp > 1
        self.weight.partition_dim = 0
        self.weight.partition_stride = 1

    def forward(self, x: Tensor) -> Tensor:
        """``[s, b, n_local, d]`` -> same shape, normalised over the full projection width."""
        x32 = x.float()
        squares = x32.square().sum(dim=(-2, -1), keepdim=True)  # [s, b, 1, 1] local heads
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            squares = _AllReduceSum.apply(squares)
        normed = x32 * torch.rsqrt(squares / self.full_width + self.eps)
        weight = self.weight.view(self.local_heads, self.head_dim)  # [n_local * d] -> [n_local, d]
        return weight * normed.to(x.dtype)


class PerHeadQKNorm(MegatronModule):
    """RMSNorm of every head ``[s, b, n_local, d]`` over ``d``; weight ``[d]`` replicated on
    TP ranks, its gradient summed over them (every rank holds other heads)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(config=config)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: Tensor) -> Tensor:
        """``[s, b, n_local, d]`` -> same shape (HF's ``Qwen3RMSNorm`` arithmetic)."""
        weight = self.weight
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            weight = copy_to_tensor_model_parallel_region(weight)  # backward: sum over TP
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)
        return weight * normed.to(x.dtype)


class PostNormMLP(MLP):
    """Megatron ``MLP`` followed by a norm on its output (no output bias allowed)."""

    def __init__(self, config, submodules, *args, post_norm: type, **kwargs) -> None:
        super().__init__(config, submodules, *args, **kwargs)
        self.post_norm = build_module(
            post_norm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
        )

    def forward(self, hidden_states: Tensor, *args, **kwargs) -> tuple[Tensor, None]:
        """``[s, b, hidden]`` -> ``(norm(mlp(x)) [s, b, hidden], None)``."""
        out, bias = super().forward(hidden_states, *args, **kwargs)
        if bias is not None:
            raise ValueError("a post-normed MLP cannot have an output bias (add_bias_linear)")
        return self.post_norm(out), None
