"""Run megatron-core on a machine without CUDA (development laptops, CI), for real, under gloo.

megatron-core assumes CUDA: it asks ``torch.cuda.current_device()`` for the device of new tensors
and keeps the tensor-parallel dropout RNG in CUDA generator states. :func:`apply_cpu_shim`
replaces, *in memory and only when CUDA is absent*, the few entry points involved (no file on
disk is touched, nothing changes on a GPU machine):

1. ``torch.cuda.current_device`` returns ``"cpu"``, so megatron's tensor factories allocate on
   the CPU.
2. ``torch.cuda.{get,set}_rng_state``, ``torch.cuda.random.{get,set}_rng_state`` and
   ``torch.cuda.manual_seed[_all]`` act on the CPU generator (what CPU dropout draws from).
3. ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` act on
   the CPU generator too. The originals defer through ``torch.cuda._lazy_call``, which on a CPU
   build never runs: the RNG tracker's ``fork()`` then silently does nothing and tensor-parallel
   ranks draw *different* dropout masks where they must agree (and the same where they must
   differ).
4. ``CheckpointWithoutOutput`` (selective recompute of norms) sets ``self.fp8 = fp8 is not None``,
   which is always true and sends it down TransformerEngine's fp8 path; the shim sets it to
   ``bool(fp8)``.
5. ``get_pos_emb_on_this_cp_rank`` (RoPE under context parallelism) moves its chunk indices to
   the GPU with ``.cuda()``; the shim's version keeps them on the embedding's device.
6. The tracker's "CPU RNG state changed within GPU RNG context" warning is expected here (the
   "GPU" generator *is* the CPU one) and is filtered out.

Everything is idempotent; :func:`cpu_shim_applied` tells whether it is active.
"""

from __future__ import annotations

import logging

import torch

_APPLIED = False
_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


def cpu_shim_applied() -> bool:
    """Whether :func:`apply_cpu_shim` has patched this process."""
    return _APPLIED


def apply_cpu_shim(force: bool = False) -> bool:
    """Patch the CUDA entry points megatron-core uses so that it runs on the CPU.

    Args:
        force: apply even if CUDA is available (tests only).

    Returns:
        ``True`` if the shim is active after the call.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available() and not force:
        return False

    def get_rng_state(device: object = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(new_state: torch.Tensor, device: object = "cuda") -> None:
        torch.set_rng_state(new_state)

    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))  # torch.manual_seed would recurse here

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.set_rng_state = set_rng_state
    torch.cuda.random.get_rng_state = get_rng_state
    torch.cuda.random.set_rng_state = set_rng_state
    torch.cuda.manual_seed = manual_seed
    torch.cuda.manual_seed_all = manual_seed
    torch.cuda.random.manual_seed = manual_seed
    torch.cuda.random.manual_seed_all = manual_seed

    from megatron.core.tensor_parallel import random as mcore_random

    def get_tracker_state(device: object = "cuda", clone: bool = False, graph_safe: bool = False):
        return torch.get_rng_state()

    def set_tracker_state(new_state: torch.Tensor, device: object = -1, graph_safe: bool = False):
        torch.set_rng_state(new_state)

    mcore_random._get_cuda_rng_state = get_tracker_state
    mcore_random._set_cuda_rng_state = set_tracker_state

    original_init = mcore_random.CheckpointWithoutOutput.__init__

    def checkpoint_init(self, fp8: object = False) -> None:
        original_init(self, fp8=fp8)
        self.fp8 = bool(fp8)

    mcore_random.CheckpointWithoutOutput.__init__ = checkpoint_init

    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    def pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        chunks = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        shape = pos_emb.shape
        pos_emb = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1 :])
        pos_emb = pos_emb.index_select(seq_dim, chunks)
        return pos_emb.view(*shape[:seq_dim], -1, *shape[seq_dim + 1 :])

    rope_utils.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank

    class _DropExpectedRngWarning(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return _RNG_WARNING not in record.getMessage()

    logging.getLogger(mcore_random.__name__).addFilter(_DropExpectedRngWarning())
    _APPLIED = True
    return True
