"""Megatron's ``parallel_state`` shaped as DeepSpeed's ``mpu`` argument.

Without an ``mpu``, DeepSpeed treats tensor-parallel ranks as data-parallel replicas and
broadcasts rank 0's weights over the other TP shards: silent corruption. ``parallel_state``
lacks a few of the names DeepSpeed asks for; this adapter supplies them.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state as ps


class MegatronMPU:
    """The model-parallel unit DeepSpeed expects, backed by Megatron's process groups."""

    def get_model_parallel_rank(self) -> int:
        return ps.get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return ps.get_tensor_model_parallel_world_size()

    def get_model_parallel_group(self):
        return ps.get_tensor_model_parallel_group()

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    # DeepSpeed's "data parallel" is data x context parallel: context-parallel ranks hold the
    # same weights and their gradients are averaged (and ZeRO-partitioned) like replicas'.
    def get_data_parallel_rank(self) -> int:
        return ps.get_data_parallel_rank(with_context_parallel=True)

    def get_data_parallel_world_size(self) -> int:
        return ps.get_data_parallel_world_size(with_context_parallel=True)

    def get_data_parallel_group(self):
        return ps.get_data_parallel_group(with_context_parallel=True)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.get_data_parallel_group())

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_group(self):
        return None
