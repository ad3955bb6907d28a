"""Run the launcher, but send SIGTERM to one rank only, at the start of a given step:
``python signal_during_step.py STEP RANK LAUNCHER ARGS`` (also as a torchrun/deepspeed entry).

The rank that matches ``RANK`` signals itself when it begins optimizer step ``STEP + 1`` (after
``STEP`` steps are done), before that step's collectives; the other ranks get no signal. The
fault is injected from outside the product (wrapping ``Trainer.train_step``), so what runs is
the product's own code path, and the moment is deterministic, whatever the machine's load.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from focus_pretrain.train.trainer import Trainer

step, rank = int(sys.argv[1]), sys.argv[2]
_train_step = Trainer.train_step


def train_step_then_signal(self):
    if self.step == step and os.environ.get("RANK") == rank:
        os.kill(os.getpid(), signal.SIGTERM)
    return _train_step(self)


Trainer.train_step = train_step_then_signal
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
