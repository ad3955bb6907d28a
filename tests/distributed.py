"""Run a test worker in N real processes on the gloo backend and collect what each returns.

A worker is a module-level function ``fn(rank, world_size, *args) -> object`` (picklable by
name); its return value is saved with ``torch.save`` and handed back in rank order.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from focus_pretrain.train.engine import free_port


def _entry(rank: int, world_size: int, port: int, target: str, args: tuple, out_dir: str):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        module, name = target.rsplit(":", 1)
        result = getattr(importlib.import_module(module), name)(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_workers(target: str, world_size: int, *args: object, timeout: float = 300) -> list:
    """Run ``target`` (``"package.module:function"``) in ``world_size`` gloo processes.

    Returns the workers' return values in rank order; a worker's exception fails the call.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry,
            args=(world_size, free_port(), target, args, out_dir),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        while not context.join(timeout=timeout):
            pass
        return [
            torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)
        ]
