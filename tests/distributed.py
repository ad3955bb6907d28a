"""Run a test worker in N real processes (gloo; NCCL for GPU tests) and collect what each returns.

A worker is a module-level function ``fn(rank, world_size, *args) -> object`` (picklable by
name); its return value is saved with ``torch.save`` and handed back in rank order. The
processes meet through a file in a temporary directory, not a TCP port, so concurrent test runs
on one machine cannot collide. Gloo ranks fork from a forkserver that has imported the heavy
modules once (:data:`PRELOAD`), with the caller's environment, working directory and
``sys.path`` at the call; ``FOCUS_TEST_START_METHOD=spawn`` spawns them instead (as NCCL ranks
always are). A run that outlives its deadline has every rank's Python stacks
taken (faulthandler, SIGUSR1) before it is killed and put in the error, so a hang fails in
minutes and says where.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from focus_pretrain.parallel.launch import free_port

__all__ = ["free_port", "run_workers"]


# what every rank imports, and what takes its time to start (~8 s a process on a 2-core CPU):
# gloo ranks are forked from a forkserver that imported these once per test process (the GPU
# tests' NCCL ranks are spawned: a fork must not inherit CUDA state)
PRELOAD = ["torch", "torch.distributed", "focus_pretrain.model", "focus_pretrain.train.trainer"]


def _start_method(backend: str) -> str:
    method = os.environ.get("FOCUS_TEST_START_METHOD", "forkserver")
    if backend == "nccl" or method == "spawn":
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # before the server starts
    return "forkserver"


def _entry(
    rank: int,
    world_size: int,
    target: str,
    args: tuple,
    out_dir: str,
    backend: str = "gloo",
    parent: tuple[dict, str, list] | None = None,
):
    if parent is not None:  # forked from the forkserver: the caller's environment, not its own
        env, cwd, path = parent
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = path
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    stacks = open(Path(out_dir) / f"stacks{rank}.txt", "w")  # noqa: SIM115 (open till exit)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # for the deadline
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
    target: str, world_size: int, *args: object, timeout: float = 900, backend: str = "gloo"
) -> list:
    """Run ``target`` (``"package.module:function"``) in ``world_size`` processes (``gloo``;
    ``backend="nccl"`` for the GPU tests: one GPU per rank).

    Returns the workers' return values in rank order; a worker's exception fails the call, and
    so does a run still going after ``timeout`` seconds (the error holds every rank's stacks).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        method = _start_method(backend)
        parent = (dict(os.environ), os.getcwd(), list(sys.path)) if method != "spawn" else None
        context = mp.start_processes(
            _entry,
            args=(world_size, target, args, out_dir, backend, parent),
            nprocs=world_size,
            join=False,
            start_method=method,
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(0.0, min(30.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                _dump_and_kill(context.processes)
                stacks = "".join(
                    f"\n--- rank {r} ---\n" + _stacks(Path(out_dir) / f"stacks{r}.txt")
                    for r in range(world_size)
                )
                raise TimeoutError(
                    f"{target} on {world_size} processes did not finish in {timeout:.0f} s; "
                    f"where each rank was:{stacks}"
                )
        return [
            torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)
        ]


def _stacks(path: Path) -> str:
    """A rank's stacks as faulthandler wrote them, or why there are none."""
    if not path.exists():
        return "(none: the process had not yet started its worker, still importing)\n"
    return path.read_text()


def _dump_and_kill(processes: list) -> None:
    """Ask every live worker for its stacks (SIGUSR1: faulthandler), then kill them all."""
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGUSR1)
    time.sleep(3)
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(10)
