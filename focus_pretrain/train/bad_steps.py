"""Bad steps: an optimizer step whose loss or gradients are not finite is skipped, not taken.

A NaN or inf from one bad batch must not crash a days-long run, nor poison the weights and the
Adam moments. Per step the trainer decides once, with one reduction over all ranks:

* :class:`GradientWatch` folds every trainable parameter's gradient into one fp32 scalar per
  rank as backward produces it (a tensor hook per parameter: a sum on the device, no host
  sync, before DeepSpeed reduces or partitions anything, so it works alike for ZeRO 0-3 and
  offload); a NaN or inf anywhere makes the scalar non-finite;
* :class:`BadStepPolicy` adds the step's loss, all-reduces a "bad" flag over the world (MAX)
  and, if it is set, tells the optimizer to skip its update (:func:`skippable`): DeepSpeed
  still reduces and clears the gradients and keeps its counters, but the weights, the Adam
  moments and the Adam step count stay exactly as they were: as if that step had not happened.
  The batch is consumed (a restart does not replay it) and the step counts as a step (like
  Megatron's skipped iterations); ``skipped_steps`` is logged.

``train.max_consecutive_bad_steps`` bad steps in a row stop the run: the trainer saves a
checkpoint (its weights are the last good ones) and raises :class:`TooManyBadSteps`, which the
launcher turns into a non-zero exit with the reason. With fp16 an overflow of the *scaled*
gradients is DeepSpeed's dynamic loss scaling at work (it skips that step and lowers the
scale), so with fp16 only a non-finite loss counts as bad.

``model.focus.check_finite`` (a ``ValueError`` inside each router and attention call, a host
sync each) is the debugging knob for finding *where* a NaN starts; training does not need it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


class TooManyBadSteps(RuntimeError):
    """``train.max_consecutive_bad_steps`` optimizer steps in a row had a non-finite loss or
    gradient; the run stopped after saving a checkpoint."""


class StepSwitch:
    """Turns an optimizer's update off for one step: :func:`skippable` wraps its ``step``.

    DeepSpeed calls the wrapped optimizer's ``step`` (once per parameter group under ZeRO-1/2,
    once per sub-group under ZeRO-3) after reducing and clipping the gradients; skipping it
    leaves the fp32 master weights and the optimizer state untouched, and DeepSpeed then
    copies the unchanged master weights back and clears the gradients as after any step.
    The instance's ``step`` is wrapped rather than the class subclassed because DeepSpeed's
    ZeRO-3 offload path tests ``type(optimizer) == DeepSpeedCPUAdam``.
    """

    def __init__(self) -> None:
        self.skip = False


def skippable(optimizer: torch.optim.Optimizer) -> StepSwitch:
    """Wrap ``optimizer.step`` so that it does nothing while the returned switch is on."""
    switch, inner = StepSwitch(), optimizer.step

    def step(*args, **kwargs):
        if switch.skip:
            return None
        return inner(*args, **kwargs)

    optimizer.step = step
    return switch


class GradientWatch:
    """One fp32 scalar per rank that is non-finite iff some gradient this step was.

    A hook on every trainable parameter adds ``grad.sum()`` (accumulated in fp32) to it as
    backward computes the gradient of each micro-batch: one small reduction kernel per
    parameter, no host synchronisation. (An fp32 sum of finite gradients does not overflow in
    practice: it would need values near 1e38.)
    """

    def __init__(self, parameters: Iterable[nn.Parameter], device: torch.device) -> None:
        self.total = torch.zeros((), dtype=torch.float32, device=device)
        self._handles = [p.register_hook(self._add) for p in parameters if p.requires_grad]

    def _add(self, grad: torch.Tensor) -> None:
        self.total.add_(grad.sum(dtype=torch.float32).to(self.total.device))

    def reset(self) -> None:
        """Start the next optimizer step."""
        self.total.zero_()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class BadStepPolicy:
    """Decides once per optimizer step whether to skip it, and when to give up.

    Args:
        max_consecutive: bad steps in a row that stop the run (``train.max_consecutive_bad_steps``).
        watch: the gradients' :class:`GradientWatch`, or ``None`` to look at the loss only
            (fp16: DeepSpeed's loss scaler owns gradient overflows).

    Attributes:
        skipped: bad steps skipped (the trainer restores it on resume: counted over resumes).
        consecutive: bad steps in a row up to now (0 after a good step).
        first_bad: the step (1-based, as logged) that began the current run of bad steps.
    """

    def __init__(self, max_consecutive: int, watch: GradientWatch | None) -> None:
        self.max_consecutive = max_consecutive
        self.watch = watch
        self.skipped = 0
        self.consecutive = 0
        self.first_bad: int | None = None

    def is_bad(self, loss: torch.Tensor, step: int) -> bool:
        """Whether step ``step`` (1-based) must be skipped: the local ``loss`` (this rank's
        micro-batch losses, summed) or a gradient is not finite on *any* rank. One all-reduce
        over the world and one host sync. Updates the counters."""
        value = loss.detach().float().reshape(())
        if self.watch is not None:
            value = value + self.watch.total
        flag = (~torch.isfinite(value)).to(torch.float32).reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = bool(flag.item())
        if self.watch is not None:
            self.watch.reset()
        if bad:
            self.skipped += 1
            self.consecutive += 1
            self.first_bad = step if self.consecutive == 1 else self.first_bad
        else:
            self.consecutive, self.first_bad = 0, None
        return bad

    @property
    def exhausted(self) -> bool:
        """Whether the run must stop: ``max_consecutive`` bad steps in a row."""
        return self.consecutive >= self.max_consecutive

    def message(self, step: int, checkpoint: object) -> str:
        """Why the run stopped, and what to do (for :class:`TooManyBadSteps`)."""
        return (
            f"{self.consecutive} consecutive optimizer steps ({self.first_bad}-{step}) had a "
            "non-finite loss or gradient norm and were skipped (train.max_consecutive_bad_steps"
            f" = {self.max_consecutive}); stopped with checkpoint {checkpoint}, which holds the "
            "last good weights. Lower train.lr or raise train.warmup_steps, look for bad data "
            "in those steps' batches (model.focus.check_finite=true names the first layer that "
            "sees a NaN), then resume with the same command; the bad batches are not replayed"
        )
