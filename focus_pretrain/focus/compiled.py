"""Small tensor programs run compiled on CUDA: many tiny operators fused into a few kernels.

The Focus bookkeeping around the attention kernels (the group-sorted layout, the block masks,
the log-sum-exp merge) is dozens of small element-wise and scan operators; eagerly each one is
a kernel launch and their launch cost, not their work, dominates at 4K-32K tokens. Every one of
them has fixed shapes and no host sync (``tests/unit/test_capture.py``), so
``torch.compile(fullgraph=True, dynamic=False)`` fuses each program into a few kernels.

:func:`fused_on_cuda` wraps such a program: on CUDA tensors it runs compiled, except

* inside a caller's compiled graph (it is traced into that graph instead),
* under a ``TorchDispatchMode`` (a launch counter: compiled code refuses the mode),

and on CPU it runs eagerly. A compile failure is an optimisation lost, not an error: the
program then runs eagerly, with one warning naming it.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

F = TypeVar("F", bound=Callable)
RECOMPILE_LIMIT = 64  # one specialisation per (length, block, ...) a run meets


def raise_recompile_limit() -> None:
    """Let dynamo keep :data:`RECOMPILE_LIMIT` specialisations per function (default 8: past
    it, a compiled function falls back to eager)."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))


def dispatch_mode_on() -> bool:
    """A ``TorchDispatchMode`` is active (e.g. a launch counter)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


def _first_tensor(args: tuple) -> Tensor | None:
    """The first tensor among ``args`` or inside a tuple argument (a NamedTuple of tensors)."""
    for arg in args:
        inner = arg if isinstance(arg, tuple) else (arg,)
        found = next((t for t in inner if isinstance(t, Tensor)), None)
        if found is not None:
            return found
    return None


def fused_on_cuda(fn: F | None = None, *, dynamic: bool = False) -> F:
    """``fn`` run through ``torch.compile(fullgraph=True, dynamic=dynamic)`` when its first
    tensor argument (or a tuple argument's first tensor) is on CUDA (see the module
    docstring); ``wrapper.eager`` is ``fn`` itself.
    Use as ``@fused_on_cuda`` or ``@fused_on_cuda(dynamic=True)``."""
    if fn is None:
        return functools.partial(fused_on_cuda, dynamic=dynamic)
    state: dict = {}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = _first_tensor(args)
        eager = (
            first is None
            or not first.is_cuda
            or torch.compiler.is_compiling()
            or dispatch_mode_on()
            or state.get("failed")
        )
        if eager:
            return fn(*args, **kwargs)
        if "compiled" not in state:
            raise_recompile_limit()
            state["compiled"] = torch.compile(fn, fullgraph=True, dynamic=dynamic)
        try:
            return state["compiled"](*args, **kwargs)
        except Exception as error:  # an optimisation lost: run eagerly from now on
            state["failed"] = True
            warnings.warn(
                f"{fn.__qualname__} could not run compiled ({type(error).__name__}: "
                f"{str(error)[:200]}); it runs eagerly (more kernel launches, same result)",
                stacklevel=2,
            )
            return fn(*args, **kwargs)

    wrapper.eager = fn
    return wrapper
