"""DeepSpeed checkpoints whose ``latest`` only ever points at a complete checkpoint.

Layout under ``run.output_dir/checkpoints``: one directory per step (``step_00000100``) with
DeepSpeed's files, the resolved ``config.yaml`` and ``client_state`` (step, consumed samples,
RNG states); a ``latest`` file naming the newest complete one. A checkpoint is written under a
temporary name, renamed when every rank has finished, and only then does ``latest`` move (by an
atomic rename), so a crash or SIGTERM mid-save leaves the previous checkpoint in charge.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from focus_pretrain.config import save_config

_TAG = re.compile(r"^step_(\d+)$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def latest_tag(root: Path) -> str | None:
    """The tag ``latest`` names, if that checkpoint exists."""
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    return tag if (root / tag).is_dir() else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(
    engine, root: Path, step: int, client_state: dict[str, Any], config, keep_last: int
) -> Path:
    """Save on every rank; rank 0 renames, moves ``latest`` and prunes old checkpoints."""
    root.mkdir(parents=True, exist_ok=True)
    tag, tmp_tag = tag_for(step), f".tmp-{tag_for(step)}"
    engine.save_checkpoint(str(root), tag=tmp_tag, client_state=client_state, save_latest=False)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if dist.is_initialized():
        dist.barrier()
    if rank0:
        save_config(config, root / tmp_tag / "config.yaml")
        if (root / tag).exists():
            shutil.rmtree(root / tag)
        os.replace(root / tmp_tag, root / tag)
        _write_atomic(root / "latest", tag)
        steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := _TAG.match(p.name)))
        for old in steps[:-keep_last]:
            shutil.rmtree(root / tag_for(old), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return root / tag


def load_checkpoint(engine, root: Path) -> dict[str, Any] | None:
    """Restore the checkpoint ``latest`` names into ``engine``; its client state, or ``None``.

    Rank 0 first deletes what a killed save left behind (``.tmp-*`` directories).
    """
    if (not dist.is_initialized() or dist.get_rank() == 0) and root.is_dir():
        for stale in root.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    tag = latest_tag(root)
    if tag is None:
        return None
    path, client_state = engine.load_checkpoint(str(root), tag=tag)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {root / tag}")
    return client_state
