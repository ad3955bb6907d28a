"""Run a test worker in N real processes (gloo; NCCL for GPU tests) and collect what each returns.

A worker is a module-level function ``fn(rank, world_size, *args) -> object`` (picklable by
name); its return value is saved with ``torch.save`` and handed back in rank order. The
processes meet through a file in a temporary directory, not a TCP port, so concurrent test runs
on one machine cannot collide.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from focus_pretrain.parallel.launch import free_port

__all__ = ["free_port", "run_workers"]


def _entry(
    rank: int, world_size: int, target: str, args: tuple, out_dir: str, backend: str = "gloo"
):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    rendezvous = f"file://{Path(out_dir) / 'rendezvous'}"
    dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world_size)
    try:
        module, name = target.rsplit(":", 1)
        result = getattr(importlib.import_module(module), name)(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_workers(
    target: str, world_size: int, *args: object, timeout: float = 300, backend: str = "gloo"
) -> list:
    """Run ``target`` (``"package.module:function"``) in ``world_size`` processes (``gloo``;
    ``backend="nccl"`` for the GPU tests: one GPU per rank).

    Returns the workers' return values in rank order; a worker's exception fails the call.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry,
            args=(world_size, target, args, out_dir, backend),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        while not context.join(timeout=timeout):
            pass
        return [
            torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)
        ]
