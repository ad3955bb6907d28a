"""Run the launcher, but SIGKILL the process in the middle of writing checkpoint ``step`` (after
its first file is on disk, before the rest): ``python kill_during_save.py STEP LAUNCHER ARGS``.

The fault is injected from outside the product (wrapping ``torch.save``), so the product's own
code path is exactly what runs in production.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

import torch

step = int(sys.argv[1])
marker = f".tmp-step_{step:08d}"
_save = torch.save


def save_then_die(obj, f, *args, **kwargs):
    _save(obj, f, *args, **kwargs)
    if marker in str(f):
        os.kill(os.getpid(), signal.SIGKILL)


torch.save = save_then_die
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
