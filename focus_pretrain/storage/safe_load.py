"""Checkpoint files read without running pickled code.

``torch.load(weights_only=False)`` unpickles whatever a file holds, so opening a checkpoint from
elsewhere could run any code it carries. Every checkpoint read goes through here instead:

* :func:`load_checkpoint_file`: ``torch.load(weights_only=True)`` with :func:`allowed_globals`,
  the few Python objects DeepSpeed's checkpoint files hold besides tensors and plain data;
* :func:`weights_only_loading`: a context for third-party code that calls
  ``torch.load(..., weights_only=False)`` itself (DeepSpeed's ``engine.load_checkpoint``,
  ``zero_to_fp32``, ``ds_to_universal``): torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` overrides
  that argument (read in the sources of torch 2.11 and 2.13), and the allowlist is in force.

A file that needs any other global is refused with :class:`UnsafeCheckpointError` (an
:class:`~focus_pretrain.errors.InputError`: the tools print one line and exit with status 2)
naming the file, the globals and the way out for a file you trust:
``FOCUS_TRUST_CHECKPOINTS=1`` loads it with ``weights_only=False``, pickled code included.
"""

from __future__ import annotations

import os
import pickle
import re
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from functools import cache
from pathlib import Path
from typing import Any

import torch

from focus_pretrain.environment import environment
from focus_pretrain.errors import InputError

TRUST_ENV = "FOCUS_TRUST_CHECKPOINTS"
FORCE_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch.load: weights_only=True whatever the call says
_NO_FORCE_ENV = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # torch refuses both at once: cleared inside
_TRUE = ("1", "true", "yes", "y")
_NAMED = re.compile(r"GLOBAL ([\w.]+)|<class '([\w.]+)'>")


class UnsafeCheckpointError(InputError):
    """A checkpoint file needs a Python global outside :func:`allowed_globals` to load."""


def trusted() -> bool:
    """Whether ``FOCUS_TRUST_CHECKPOINTS`` is set: every checkpoint is loaded in full trust."""
    return os.environ.get(TRUST_ENV, "").strip().lower() in _TRUE


@cache
def allowed_globals() -> tuple[Any, ...]:
    """What a checkpoint of ours may hold besides tensors and plain data (found by listing
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` over every ``.pt`` file of runs at
    ZeRO 0-3, CPU offload, bf16, TP=2, TP=2 x ZeRO-3, retrofit freezing and their universal
    forms). Each is data: a class whose instances only hold numbers, or a constructor of
    arrays; none runs code of the file's choosing."""
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    reconstruct = np.zeros(0).__reduce__()[0]  # numpy's array constructor (_reconstruct)
    return (
        # the ZeRO stage in every ZeRO optimizer file (and universal optimizer_state.pt):
        # an int Enum, looked up by value
        ZeroStageEnum,
        # ZeRO optimizer files' loss scaler at bf16/fp32 (a static scale): numbers only
        LossScaler,
        # the same at fp16 (GPU runs): scale, counters, window, torch.float16; numbers only
        DynamicLossScaler,
        # ZeRO-1/2 optimizer files' param_slice_mappings: a dataclass of two ints (numel, start)
        fragment_address,
        # numpy's RNG state (a uint32 array) in the client state of checkpoints saved before
        # the trainer stored it as a list: array construction (numpy 2's and numpy 1's name),
        # the array and dtype classes, the uint32 dtype's class
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
    )


@contextmanager
def _allowlist() -> Iterator[None]:
    """Exactly :func:`allowed_globals` marked safe inside: what other libraries mark safe for
    the whole process is set aside until the exit (importing megatron.core marks PosixPath,
    argparse.Namespace, BytesIO, its config classes...; our checkpoints need none of them)."""
    ours = list(allowed_globals())  # first: its imports may mark globals safe
    others = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(ours)
    try:
        yield
    finally:  # and what a library imported inside marked safe meanwhile
        added = [g for g in torch.serialization.get_safe_globals() if g not in ours]
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(others + added)


def load_checkpoint_file(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """``torch.load(path)`` without running pickled code: only tensors, plain data and
    :func:`allowed_globals` (everything when ``FOCUS_TRUST_CHECKPOINTS=1``).

    Raises:
        UnsafeCheckpointError: the file needs another global.
    """
    if trusted():
        return torch.load(path, map_location=map_location, weights_only=False)
    try:
        with _allowlist():
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(_refusal(err, path)) from err


@contextmanager
def weights_only_loading(source: str | os.PathLike | None = None) -> Iterator[None]:
    """Every ``torch.load`` inside (third-party ones passing ``weights_only=False`` too) loads
    weights only, with :func:`allowed_globals`; the environment is restored on exit. ``source``
    (the checkpoint being read) names it in the error. Processes the code inside forks inherit
    both; a pool started otherwise needs :func:`install_in_worker` as its initializer. Nothing
    changes when ``FOCUS_TRUST_CHECKPOINTS=1``.

    Raises:
        UnsafeCheckpointError: a file read inside needs another global.
    """
    if trusted():
        yield
        return
    # torch 2.11 compares the exact text: "1", not "true"
    with environment({_NO_FORCE_ENV: None, FORCE_ENV: "1"}):
        try:
            with _allowlist():
                yield
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(_refusal(err, _file_of(err) or source)) from err


def install_in_worker() -> None:
    """What :func:`weights_only_loading` sets, for the rest of a pool worker's life (a
    ``ProcessPoolExecutor`` initializer: a worker spawned or started by a fork server inherits
    neither the allowlist nor, from a fork server, the environment)."""
    if trusted():
        return
    os.environ.pop(_NO_FORCE_ENV, None)
    os.environ[FORCE_ENV] = "1"
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(list(allowed_globals()))


def unsafe_globals(path: str | os.PathLike) -> list[str]:
    """The globals the checkpoint file ``path`` names beyond :func:`allowed_globals`, found
    without loading it (torch's static listing: a class a file builds only while loading, e.g.
    numpy's dtype classes, shows up only when it is loaded)."""
    with _allowlist():
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))


def _file_of(err: BaseException) -> str | None:
    """The file the ``torch.load`` that raised ``err`` was reading (when given by name)."""
    for frame, _ in traceback.walk_tb(err.__traceback__):
        if frame.f_code is torch.serialization.load.__code__:
            f = frame.f_locals.get("f")
            # a link's target: callers link checkpoint files into scratch folders
            return os.path.realpath(f) if isinstance(f, (str, os.PathLike)) else None
    return None


def _refusal(err: BaseException, path: str | os.PathLike | None = None) -> str:
    """One line: what ``path`` needs that the allowlist lacks (from torch's error ``err``, and
    the file's own list of globals where ``path`` is a file) and the way out."""
    names = [a or b for a, b in _NAMED.findall(str(err))]
    names = [n if "." in n else f"builtins.{n}" for n in names]  # torch says "GLOBAL getattr"
    if path is not None and Path(path).is_file():
        with suppress(Exception):  # not a zip checkpoint: torch's error names what it met
            names += unsafe_globals(path)
    names = sorted(set(names))
    where = "a checkpoint file" if path is None else f"checkpoint file {path}"
    if path is not None and Path(path).is_dir():
        where = f"a file of checkpoint {path}"
    if names:
        need = f"needs {', '.join(names)}, not on the allowlist of checkpoint globals"
    else:  # torch's reason, without its advice and terminal escapes
        reason = re.sub(r"\x1b\[[0-9;]*m", "", str(err).split("WeightsUnpickler error:")[-1])
        need = f"cannot be loaded as weights only ({' '.join(reason.split())[:300]})"
    return (
        f"{where} {need} (focus_pretrain.storage.safe_load.allowed_globals): loading it could "
        f"run code it carries. Only if you trust the file, load it with {TRUST_ENV}=1 "
        "(weights_only=False: any pickled code in it runs)"
    )
