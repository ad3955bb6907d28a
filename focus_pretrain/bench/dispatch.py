"""Count what a call asks of the device: operators dispatched (kernel launches) and host syncs.

A :class:`DispatchCounter` is a ``TorchDispatchMode``: every ATen operator that reaches a
device kernel passes through it, on any device, so the count is the same on a CPU as on a GPU
(where it is the number of kernel launches, give or take: a few operators launch two kernels,
views and allocations launch none and are not counted). A **host sync** is an operator whose
result the host must wait for: a tensor read as a Python number (``.item()``, ``int(t)``,
``bool(t)``: ``aten._local_scalar_dense``), an output whose shape depends on the data
(``nonzero``, boolean indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without
an output size), a CUDA-to-host copy, and the like. Each one stalls the host until the device
drains, and each one breaks CUDA-graph capture.

    with DispatchCounter() as counter:
        focus_attention(q, k, v, routing, mode="hard")
    counter.launches, counter.host_syncs, counter.sync_ops

Compiled code (``torch.compile``) runs its kernels below the dispatcher: count eager calls.
FlexAttention counts as one launch (its fused kernel): while a counter is active, eager
``flex_attention`` calls its operator directly (``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG``), as
a compiled wrapper would refuse the mode; its unfused eager maths runs below the counter, so
count FlexAttention calls at moderate lengths (the scores are materialised).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# operators that make the host wait for the device (by their overload packet's name)
HOST_SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",  # .item(), int(t), float(t), bool(t)
        "nonzero",  # also boolean-mask indexing
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "equal",
        "is_nonzero",
        "allclose",
        "bincount",  # sizes its output from the data's maximum (a sync on CUDA)
        "histc",
    }
)
# no kernel behind them: allocations, aliases, metadata
NO_KERNEL_OPS = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "detach",
        "alias",
        "lift_fresh",
        "lift_fresh_copy",
        "_has_compatible_shallow_copy_type",
        "set_",
        "resize_",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_same_size",
        "promote_types",
        "result_type",
    }
)


def _is_host_sync(name: str, args: tuple, kwargs: dict, out: Any) -> bool:
    if name in HOST_SYNC_OPS:
        return True
    if name == "repeat_interleave":  # repeats as a tensor, no output_size: sized by the data
        return (
            isinstance(args[0], torch.Tensor)
            and len(args) > 1
            and (isinstance(args[1], torch.Tensor) and kwargs.get("output_size") is None)
        )
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):  # a boolean mask
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        )
    if name in ("_to_copy", "copy_"):  # a device-to-host copy
        src = args[1] if name == "copy_" else args[0]
        dst = args[0] if name == "copy_" else out
        return (
            isinstance(src, torch.Tensor)
            and isinstance(dst, torch.Tensor)
            and src.device.type != "cpu"
            and dst.device.type == "cpu"
        )
    return False


class DispatchCounter(TorchDispatchMode):
    """Counts kernel launches (non-view ATen operators) and host syncs while active.

    Attributes:
        launches: operators dispatched that run a kernel.
        host_syncs: operators that make the host wait for the device (:data:`HOST_SYNC_OPS`).
        ops: ``Counter`` of launched operator names; sync_ops: ``Counter`` of the syncing ones.
    """

    supports_higher_order_operators = True  # FlexAttention: one fused kernel, counted as one

    def __init__(self) -> None:
        super().__init__()
        self.launches = 0
        self.host_syncs = 0
        self.ops: Counter[str] = Counter()
        self.sync_ops: Counter[str] = Counter()

    def __enter__(self) -> DispatchCounter:
        import torch.nn.attention.flex_attention as flex_module

        self._flex_debug = flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
        flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        import torch.nn.attention.flex_attention as flex_module

        flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = self._flex_debug
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(func, torch._ops.HigherOrderOperator):
            self.launches += 1
            self.ops[func.name()] += 1
            return out
        name = func.overloadpacket.__name__
        if _is_host_sync(name, args, kwargs, out):
            self.host_syncs += 1
            self.sync_ops[name] += 1
        if not func.is_view and name not in NO_KERNEL_OPS:
            self.launches += 1
            self.ops[name] += 1
        return out

    def summary(self) -> dict[str, Any]:
        """``{"launches", "host_syncs", "sync_ops"}`` (JSON-ready)."""
        return {
            "launches": self.launches,
            "host_syncs": self.host_syncs,
            "sync_ops": dict(self.sync_ops),
        }
