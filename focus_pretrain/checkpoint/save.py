"""DeepSpeed checkpoints that are never lost, never half-read and never silently restarted.

Layout under ``run.output_dir/checkpoints`` (:mod:`focus_pretrain.storage.checkpoint_files`):
one directory per step (``step_00000100``) with DeepSpeed's files, the resolved
``config.yaml``, ``client_state`` (the trainer's ``state_dict``: step, consumed samples, RNG
states), a copy of the run's tokenizer and ``checkpoint.json`` (every file's size and CRC-32);
a ``latest`` file naming the newest complete one.

A save, in order: every rank writes its files under ``.tmp-step_N`` and fsyncs each one as it
is written (recording its size and CRC-32); rank 0 adds the recipe, the tokenizer and the
manifest, fsyncs them and the folder, renames it to ``step_N`` (a rollback's older folder of
that step is set aside first and deleted at the end), fsyncs the parent, moves ``latest`` by
an atomic, fsynced rename, and only then deletes checkpoints older than the ``keep_last``
newest (never the one just written, nor a newer one). A crash, a SIGKILL or a power loss at
any point leaves ``latest`` naming a whole checkpoint.

A load, in order: ``latest`` is validated (missing, empty or dangling with step folders
present: refused, naming them), the folder is checked against its manifest by all ranks (a
truncated or corrupt file: refused, naming it and offering the previous whole checkpoint),
then read with DeepSpeed under weights-only unpickling.

Every checkpoint also declares how its tensors merge over tensor-parallel ranks (DeepSpeed's
``UNIVERSAL_CHECKPOINT_INFO``), so that it can resume at another parallel layout: with
``train.load_universal`` a checkpoint saved at another one is converted to DeepSpeed's universal
form (``step_N/universal``) and loaded from it (:mod:`focus_pretrain.checkpoint.reshard`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from focus_pretrain.checkpoint import reshard
from focus_pretrain.checkpoint.layout import check_layout
from focus_pretrain.checkpoint.read import latest_checkpoint
from focus_pretrain.config import Config, save_config
from focus_pretrain.storage.checkpoint_files import (
    LATEST,
    check_files,
    copy_tokenizer,
    damaged_checkpoint_error,
    file_record,
    prune,
    read_latest,
    read_manifest,
    remove_leftovers,
    tag_for,
    write_manifest,
)
from focus_pretrain.storage.files import fsync_dir, fsync_file, write_atomic
from focus_pretrain.storage.safe_load import weights_only_loading

__all__ = ["Checkpointer", "latest_checkpoint", "tag_for"]


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_gather(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (one process: ``[value]``)."""
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _record_written_files(engine, written: dict[str, dict[str, int]]) -> None:
    """Make the engine's checkpoint engine fsync every file it saves and record its size and
    CRC-32 into ``written`` (path -> record): DeepSpeed's extension point for checkpoint
    I/O, wrapped on this engine's instance only."""
    checkpoint_engine = engine.checkpoint_engine
    save = checkpoint_engine.save

    def save_durably(state_dict, path, *args, **kwargs):
        result = save(state_dict, path, *args, **kwargs)
        fsync_file(path)
        written[str(path)] = file_record(path)
        return result

    checkpoint_engine.save = save_durably


class Checkpointer:
    """Saves and restores a DeepSpeed engine and the trainer's state, on its own cadence.

    Args:
        root: the checkpoints directory (``run.output_dir/checkpoints``).
        engine: the DeepSpeed engine (every rank saves its shards).
        config: the resolved recipe, written into every checkpoint; ``train.save_interval``
            (0: only the last step) and ``train.keep_last`` set the cadence and retention.
        client_state: returns what the trainer needs to resume (called at each save).
        layout: this run's parallel layout (:func:`~focus_pretrain.checkpoint.layout.run_layout`);
            a checkpoint saved at another one is loaded through its universal form (allowed
            by ``train.load_universal``, refused otherwise). ``None``: never resharded.
        tokenizer: the run's tokenizer (a ``.model`` file or a HuggingFace tokenizer
            directory), copied into every checkpoint so that an export finds it anywhere.
    """

    def __init__(
        self,
        root: Path,
        engine,
        config: Config,
        client_state: Callable[[], dict[str, Any]],
        layout: dict[str, int] | None = None,
        tokenizer: str | os.PathLike | None = None,
    ) -> None:
        self.root = Path(root)
        self.engine = engine
        self.config = config
        self.client_state = client_state
        self.interval = config.train.save_interval
        self.keep_last = config.train.keep_last
        self.saved_step: int | None = None  # never rewrite the checkpoint `latest` names
        self.layout = layout
        self.tokenizer = None if tokenizer is None else Path(tokenizer)
        self._written: dict[str, dict[str, int]] = {}
        _record_written_files(engine, self._written)
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
        ``None`` when there is none. Rank 0 first deletes what a killed save or prune left
        behind (``.tmp-step_*``, ``.old-step_*``, ``.deleting-step_*``, a temporary
        ``latest``: the run directory's lock, held by the trainer, guarantees that no other
        run is writing them). Collective.

        Raises:
            InputError: ``latest`` is missing, empty or dangling beside step folders, or the
                checkpoint is truncated or corrupt (naming the file and the previous whole
                checkpoint).
        """
        if _is_main() and self.root.is_dir():
            remove_leftovers(self.root)
        _barrier()
        tag = read_latest(self.root)
        if tag is None:
            return None
        self._verify(tag)
        if self.layout is not None and check_layout(self.root / tag, self.config, self.layout):
            return self._load_resharded(self.root / tag)
        with weights_only_loading(self.root / tag):  # DeepSpeed's own torch.load calls too
            path, client_state = self.engine.load_checkpoint(str(self.root), tag=tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {self.root / tag}")
        self.saved_step = client_state["step"]
        return client_state

    def _verify(self, tag: str) -> None:
        """Check checkpoint ``tag`` against its manifest (sizes and CRC-32), the files shared
        out over the ranks; raise on every rank when any file is missing, truncated or
        corrupt. A checkpoint written before manifests existed passes."""
        folder = self.root / tag
        manifest = read_manifest(folder)
        if manifest is None:
            return
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        mine = check_files(folder, sorted(manifest)[rank::world], manifest)
        problems = [problem for part in _all_gather(mine) for problem in part]
        if problems:
            raise damaged_checkpoint_error(self.root, tag, problems)

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
        """Every rank writes (and fsyncs) its shards under a temporary tag; once all are done,
        rank 0 completes and commits the checkpoint (:meth:`_commit`)."""
        root = self.root
        root.mkdir(parents=True, exist_ok=True)
        tmp_tag = f".tmp-{tag_for(step)}"
        self._written.clear()
        self.engine.save_checkpoint(
            str(root), tag=tmp_tag, client_state=self.client_state(), save_latest=False
        )
        folder = (root / tmp_tag).resolve()
        written = {
            Path(path).resolve(): record
            for rank_records in _all_gather(dict(self._written))
            for path, record in rank_records.items()
        }
        records = {  # the folder's files, every rank's
            path.relative_to(folder).as_posix(): record
            for path, record in written.items()
            if path.is_relative_to(folder)
        }
        if _is_main():
            self._commit(step, records)
        _barrier()
        return root / tag_for(step)

    def _commit(self, step: int, records: dict[str, dict[str, int]]) -> None:
        """Rank 0: the recipe, the tokenizer and the manifest into the temporary folder, all
        fsynced; the folder renamed to ``step_N`` (a rollback's older ``step_N`` set aside
        first), ``latest`` moved, old checkpoints pruned. Every step is durable before the
        next one starts, so a crash anywhere leaves ``latest`` naming a whole checkpoint."""
        root, tag = self.root, tag_for(step)
        folder = root / f".tmp-{tag}"
        save_config(self.config, folder / "config.yaml")
        if self.tokenizer is not None:
            copy_tokenizer(self.tokenizer, folder)
        write_manifest(folder, records)
        for path in folder.rglob("*"):  # the ranks fsynced theirs; these are rank 0's
            name = path.relative_to(folder).as_posix()
            if path.is_file() and name not in records:
                fsync_file(path)
        for sub in sorted({p.parent for p in folder.rglob("*")}, key=lambda p: -len(p.parts)):
            fsync_dir(sub)
        replaced = None
        if (root / tag).exists():  # a rollback's later checkpoint of this step
            replaced = root / f".old-{tag}"
            shutil.rmtree(replaced, ignore_errors=True)
            os.rename(root / tag, replaced)
        os.rename(folder, root / tag)
        fsync_dir(root)
        write_atomic(root / LATEST, tag)
        prune(root, tag, self.keep_last)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
