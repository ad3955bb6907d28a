"""Starting a run's processes: rank discovery, ``torch.distributed`` and the parallel layout.

:func:`launch_environment` maps what a launcher gives a process (``deepspeed``/``torchrun``:
``RANK``...; ``srun``: ``SLURM_*``; nothing: one process) to the ``torch.distributed``
variables. :func:`init_distributed` starts the default process group (NCCL on GPUs, gloo on CPU).
:class:`ParallelLayout` is the process grid, ``world = tensor x context x data`` parallel
(Megatron's order: tensor-parallel ranks are neighbours), like torchtitan's ``ParallelDims``:
:meth:`ParallelLayout.initialize` builds Megatron's groups for it and seeds every generator,
and its properties hand out the groups the trainer reduces over.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import random
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from focus_pretrain.errors import InputError
from focus_pretrain.parallel.config import ParallelConfig
from focus_pretrain.parallel.cpu_shim import apply_cpu_shim


def launch_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*`` variables this process lacks.

    A launcher that sets ``RANK`` needs nothing. Under ``srun`` (``SLURM_STEP_NUM_TASKS`` is
    set only inside a job step) ranks come from ``SLURM_PROCID``/``SLURM_LOCALID`` and the
    rendezvous from ``MASTER_ADDR``/``MASTER_PORT``. Otherwise: one process on a free port.
    """
    if "RANK" in env:
        return {}
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", "1"))
    if "SLURM_PROCID" in env and tasks > 1:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
        if missing:
            raise InputError(
                f"running under srun with several tasks but {' and '.join(missing)} "
                "not set: export the first node's address and a port for the rendezvous, as "
                "launchers/slurm.sh does"
            )
        return {
            "RANK": env["SLURM_PROCID"],
            "WORLD_SIZE": str(tasks),
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "MASTER_PORT": env["MASTER_PORT"],
        }
    return {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a local rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_deepspeed_ops_in_turn(*builder_names: str) -> None:
    """Load DeepSpeed's ops ``builder_names`` (e.g. ``"CPUAdamBuilder"``; JIT-compiled on first
    use, then cached in ``TORCH_EXTENSIONS_DIR``) in three turns separated by barriers: global
    rank 0, then the first rank of every other node (whose cache may be another disk), then the
    rest, who find them built. Ranks compiling one extension at the same time race on torch's
    build lock, which can stall a job at start-up (DeepSpeed's CI hung on it: PR #2844). Each
    process keeps what it loaded, so DeepSpeed's own later load is a lookup. Ops this machine's
    accelerator lacks are skipped, as DeepSpeed skips them."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builders = [get_accelerator().create_op_builder(name) for name in builder_names]
    builders = [
        b for b in builders if b is not None and deepspeed.ops.__compatible_ops__.get(b.NAME)
    ]
    if not builders:
        return
    if not dist.is_initialized() or dist.get_world_size() == 1:
        for builder in builders:
            builder.load()
        return
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    for my_turn in (rank == 0, rank != 0 and local_rank == 0, local_rank != 0):
        if my_turn:
            for builder in builders:
                builder.load()
        dist.barrier()


def init_distributed(timeout_minutes: float = 30.0) -> None:
    """Start ``torch.distributed`` (NCCL with CUDA, else gloo) and DeepSpeed's communication
    layer, with ranks from :func:`launch_environment` and a collective timeout of
    ``timeout_minutes`` (``parallel.timeout_minutes``). A lone process rendezvouses in memory
    (no port to collide with other jobs on the machine). Idempotent."""
    import deepspeed

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        os.environ.update(launch_environment(os.environ))
        if os.environ["WORLD_SIZE"] == "1":
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:  # env:// (MASTER_ADDR/PORT, RANK, WORLD_SIZE), as DeepSpeed would
            dist.init_process_group(backend, timeout=timeout)
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stdout(chatter):  # joins the group
            # DeepSpeed's comm layer JIT-builds its CPU shared-memory op in every rank
            load_deepspeed_ops_in_turn("ShareMemCommBuilder")
            deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    finally:  # what it printed, but its CPU build notice ("... built successfully")
        for line in chatter.getvalue().splitlines():
            if not line.endswith(" built successfully"):
                print(line)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def shutdown_distributed() -> None:
    """Destroy the process groups (if any) before the interpreter exits: left to the exit,
    their threads can race it (``terminate called without an active exception``, seen once
    in an evaluation process on a loaded machine)."""
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class ParallelLayout:
    """The process grid of a run: ``world_size = tensor x context x data`` parallel ranks.

    Attributes:
        world_size: all processes.
        tensor_parallel_size: ranks that split every layer (Megatron tensor parallelism).
        context_parallel_size: ranks that split every sequence.
    """

    world_size: int
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1

    def __post_init__(self) -> None:
        tp, cp = self.tensor_parallel_size, self.context_parallel_size
        if self.world_size % (tp * cp):
            raise InputError(
                f"world size {self.world_size} is not a multiple of "
                f"parallel.tensor_parallel_size x context_parallel_size ({tp} x {cp})"
            )

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the model: ``world / (tensor x context parallel)``."""
        return self.world_size // (self.tensor_parallel_size * self.context_parallel_size)

    @classmethod
    def initialize(cls, parallel: ParallelConfig, seed: int) -> ParallelLayout:
        """Start ``torch.distributed`` if needed, build Megatron's process groups for
        ``parallel`` (CPU shim without CUDA) and seed Python, NumPy, torch and Megatron's
        tensor-parallel generators with ``seed``."""
        init_distributed(parallel.timeout_minutes)
        apply_cpu_shim()
        layout = cls(
            dist.get_world_size(), parallel.tensor_parallel_size, parallel.context_parallel_size
        )
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=layout.tensor_parallel_size,
                context_parallel_size=layout.context_parallel_size,
            )
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        return layout

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return dist.get_rank()

    @property
    def is_main(self) -> bool:
        """Global rank 0: the process that logs and writes run-level files."""
        return self.rank == 0

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data shard (context-parallel ranks of one replica share it)."""
        return parallel_state.get_data_parallel_rank()

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        """Ranks holding the same model shard and different samples."""
        return parallel_state.get_data_parallel_group()

    @property
    def context_parallel_group(self) -> dist.ProcessGroup | None:
        """Ranks splitting one sequence, or ``None`` without context parallelism."""
        if self.context_parallel_size == 1:
            return None
        return parallel_state.get_context_parallel_group()

    @property
    def data_context_group(self) -> dist.ProcessGroup:
        """Data x context-parallel ranks: those that hold the same weights (DeepSpeed's
        "data parallel": gradients averaged, ZeRO partitions, router statistics)."""
        return parallel_state.get_data_parallel_group(with_context_parallel=True)
