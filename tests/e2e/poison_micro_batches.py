"""Run the launcher with chosen micro-batches poisoned to NaN:
``python poison_micro_batches.py 2,6,7 LAUNCHER ARGS`` poisons this process's micro-batches
2, 6 and 7 (counted from 0 over the run).

The fault is injected from outside the product: the trainer's micro-batch loss is wrapped so
that a poisoned micro-batch's loss (and so every gradient) is NaN, as a corrupt batch or an
overflow would make it; what runs is the product's own bad-step path.
"""

from __future__ import annotations

import runpy
import sys

from focus_pretrain.train import trainer

poisoned = {int(i) for i in sys.argv[1].split(",") if i}
_micro_batch_loss = trainer.micro_batch_loss
seen = [0]


def poisoned_loss(*args, **kwargs):
    backward, mean = _micro_batch_loss(*args, **kwargs)
    index, seen[0] = seen[0], seen[0] + 1
    if index in poisoned:
        return backward * float("nan"), mean * float("nan")
    return backward, mean


trainer.micro_batch_loss = poisoned_loss
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
