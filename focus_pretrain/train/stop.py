"""A stop request (SIGTERM, SIGINT) that every rank agrees on.

A signal can reach one rank before another, or only one rank (a scheduler or an operator
signalling one process). If each rank decided alone, one would stop and save (a collective)
while the other waits in the next step's forward collective, and the job would hang until the
communication timeout killed it without a checkpoint. So the handler only records the signal,
and :meth:`StopSignal.should_stop`, called by every rank at the same point of each step,
all-reduces the flag (one integer, MAX): every rank sees the request at the same step, saves
that step's checkpoint and exits cleanly. Megatron's ``DistributedSignalHandler`` does the same
with an all-gather.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Records ``signals`` while installed (``with StopSignal(): ...``); :meth:`should_stop`
    tells, identically on every rank of ``group``, whether any rank received one.

    Attributes:
        received: the signal this rank received, or ``None``.
        agreed: the signal the ranks stop for (the largest number any of them received), once
            :meth:`should_stop` has returned ``True``; else ``None``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        signals: tuple[signal.Signals, ...] = DEFAULT_SIGNALS,
    ) -> None:
        self.group = group
        self.signals = signals
        self.received: int | None = None
        self.agreed: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignal:
        self._previous = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def should_stop(self) -> bool:
        """Whether any rank received a signal (a collective: every rank must call it at the
        same point)."""
        flag = torch.tensor([self.received or 0], dtype=torch.int64, device=self._device())
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        agreed = int(flag.item())
        if agreed:
            self.agreed = agreed
        return bool(agreed)

    def _device(self) -> torch.device:
        """NCCL reduces device tensors; gloo host tensors."""
        if dist.is_initialized() and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
