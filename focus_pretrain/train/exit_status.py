"""How a run ended, for cluster scripts: ``$FOCUS_EXIT_STATUS_FILE``."""

from __future__ import annotations

import os
from pathlib import Path

from focus_pretrain.storage.files import write_atomic

__all__ = ["EXIT_STATUS_ENV", "write_exit_status"]

EXIT_STATUS_ENV = "FOCUS_EXIT_STATUS_FILE"


def write_exit_status(stopped: int | None, step: int, failed: str | None = None) -> None:
    """If ``$FOCUS_EXIT_STATUS_FILE`` names a file, write (atomically) how the run ended:
    ``stopped_by_signal N STEP``, ``done STEP`` or ``failed REASON STEP`` (``bad_steps``).
    Cluster scripts read it, e.g. ``launchers/slurm.sh`` requeues the job only after a stop by
    signal (its pre-timeout SIGTERM), not when training is done (both exit with status 0) nor
    after a failure."""
    path = os.environ.get(EXIT_STATUS_ENV)
    if not path:
        return
    if failed is not None:
        text = f"failed {failed} {step}\n"
    elif stopped is not None:
        text = f"stopped_by_signal {int(stopped)} {step}\n"
    else:
        text = f"done {step}\n"
    write_atomic(Path(path), text)
