"""DeepSpeed checkpoints whose ``latest`` only ever points at a complete checkpoint.

Layout under ``run.output_dir/checkpoints``: one directory per step (``step_00000100``) with
DeepSpeed's files, the resolved ``config.yaml`` and ``client_state`` (the trainer's
``state_dict``: step, consumed samples, RNG states); a ``latest`` file naming the newest
complete one. A checkpoint is written under a temporary name, renamed when every rank has
finished, and only then does ``latest`` move (by an atomic rename), so a crash or SIGTERM
mid-save leaves the previous checkpoint in charge.

Every checkpoint also declares how its tensors merge over tensor-parallel ranks (DeepSpeed's
``UNIVERSAL_CHECKPOINT_INFO``), so that it can resume at another parallel layout: with
``train.load_universal`` a checkpoint saved at another one is converted to DeepSpeed's universal
form (``step_N/universal``) and loaded from it (:mod:`focus_pretrain.train.reshard`).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from focus_pretrain.config import Config, save_config
from focus_pretrain.train import reshard
from focus_pretrain.train.resume import check_layout

_TAG = re.compile(r"^step_(\d+)$")


def tag_for(step: int) -> str:
    """The directory name of step ``step``'s checkpoint."""
    return f"step_{step:08d}"


def latest_tag(root: Path) -> str | None:
    """The tag ``latest`` names, if that checkpoint exists."""
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    return tag if (root / tag).is_dir() else None


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint directory ``latest`` names under ``root``, if it exists."""
    tag = latest_tag(Path(root))
    return None if tag is None else Path(root) / tag


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never half-written)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class Checkpointer:
    """Saves and restores a DeepSpeed engine and the trainer's state, on its own cadence.

    Args:
        root: the checkpoints directory (``run.output_dir/checkpoints``).
        engine: the DeepSpeed engine (every rank saves its shards).
        config: the resolved recipe, written into every checkpoint; ``train.save_interval``
            (0: only the last step) and ``train.keep_last`` set the cadence and retention.
        client_state: returns what the trainer needs to resume (called at each save).
        layout: this run's parallel layout (:func:`~focus_pretrain.train.resume.run_layout`);
            a checkpoint saved at another one is loaded through its universal form (allowed
            by ``train.load_universal``, refused otherwise). ``None``: never resharded.
    """

    def __init__(
        self,
        root: Path,
        engine,
        config: Config,
        client_state: Callable[[], dict[str, Any]],
        layout: dict[str, int] | None = None,
    ) -> None:
        self.root = Path(root)
        self.engine = engine
        self.config = config
        self.client_state = client_state
        self.interval = config.train.save_interval
        self.keep_last = config.train.keep_last
        self.saved_step: int | None = None  # never rewrite the checkpoint `latest` names
        self.layout = layout
        reshard.declare_universal_info(engine, config.model)

    def save(self, step: int, *, last: bool = False) -> Path | None:
        """Save step ``step`` if it is due: every ``interval`` steps, or ``last`` (the end of
        training or a stop) unless this step is saved already. Collective: every rank calls
        it at the same step. Returns the checkpoint directory, or ``None`` when not due."""
        due = last or (self.interval > 0 and step % self.interval == 0)
        if not due or self.saved_step == step:
            return None
        path = self._write(step)
        self.saved_step = step
        return path

    def load(self) -> dict[str, Any] | None:
        """Restore the checkpoint ``latest`` names into the engine; its client state, or
        ``None`` when there is none. Rank 0 first deletes what a killed save left behind
        (``.tmp-*`` directories)."""
        if _is_main() and self.root.is_dir():
            for stale in self.root.glob(".tmp-step_*"):
                shutil.rmtree(stale, ignore_errors=True)
        _barrier()
        tag = latest_tag(self.root)
        if tag is None:
            return None
        if self.layout is not None and check_layout(self.root / tag, self.config, self.layout):
            return self._load_resharded(self.root / tag)
        path, client_state = self.engine.load_checkpoint(str(self.root), tag=tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {self.root / tag}")
        self.saved_step = client_state["step"]
        return client_state

    def _load_resharded(self, checkpoint: Path) -> dict[str, Any]:
        """Convert ``checkpoint`` to its universal form (rank 0, once) and load that."""
        if _is_main():
            print(
                f"focus-pretrain: resharding {checkpoint} to this run's layout "
                f"{self.layout} through DeepSpeed's universal checkpoint",
                flush=True,
            )
        folder = reshard.ensure_universal(checkpoint, _is_main())
        client_state = reshard.load_universal(self.engine, folder, self.config)
        self.saved_step = client_state["step"]
        return client_state

    @property
    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names."""
        return latest_checkpoint(self.root)

    def _write(self, step: int) -> Path:
        """Every rank writes its shards under a temporary tag; rank 0 renames the directory,
        moves ``latest`` and prunes old checkpoints once all ranks are done."""
        root = self.root
        root.mkdir(parents=True, exist_ok=True)
        tag, tmp_tag = tag_for(step), f".tmp-{tag_for(step)}"
        self.engine.save_checkpoint(
            str(root), tag=tmp_tag, client_state=self.client_state(), save_latest=False
        )
        _barrier()
        if _is_main():
            save_config(self.config, root / tmp_tag / "config.yaml")
            if (root / tag).exists():
                shutil.rmtree(root / tag)
            os.replace(root / tmp_tag, root / tag)
            write_atomic(root / "latest", tag)
            steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := _TAG.match(p.name)))
            for old in steps[: -self.keep_last]:
                shutil.rmtree(root / tag_for(old), ignore_errors=True)
        _barrier()
        return root / tag
