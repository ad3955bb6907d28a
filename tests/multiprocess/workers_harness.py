"""Workers of tests/multiprocess/test_harness.py (module-level: spawned processes import them)."""

from __future__ import annotations

import threading


def wait_forever(rank: int, world_size: int) -> None:
    """A rank that never returns: what a hung collective or build lock looks like."""
    threading.Event().wait()
