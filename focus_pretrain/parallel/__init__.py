"""Process groups and the parallel layout, context parallelism for Focus, the gradient sums of
sequence parallelism, the CPU shim for megatron-core, and the ``parallel:`` section of a
recipe."""

from focus_pretrain.parallel.config import ParallelConfig
from focus_pretrain.parallel.context_parallel import (
    apply_context_parallel,
    context_parallel_attention,
)
from focus_pretrain.parallel.cpu_shim import apply_cpu_shim, cpu_shim_applied
from focus_pretrain.parallel.launch import (
    ParallelLayout,
    free_port,
    init_distributed,
    launch_environment,
)
from focus_pretrain.parallel.sequence_parallel import reduce_sequence_parallel_grads
from focus_pretrain.parallel.sharding import gather_sequence, shard_batch, shard_sequence

__all__ = [
    "ParallelConfig",
    "ParallelLayout",
    "apply_context_parallel",
    "apply_cpu_shim",
    "context_parallel_attention",
    "cpu_shim_applied",
    "free_port",
    "gather_sequence",
    "init_distributed",
    "launch_environment",
    "reduce_sequence_parallel_grads",
    "shard_batch",
    "shard_sequence",
]
