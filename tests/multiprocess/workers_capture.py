"""Workers for the capture tests: what a training step's Focus parts ask of the host."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.multiprocess.workers_model import LLAMA, _batch, _build


def training_step_syncs(rank: int, world_size: int, focus_kwargs: dict, micro_batches: int):
    """Micro-batches of forward + backward of a tiny Focus model, then the routers' balance
    update over the world (what the trainer does each step), under a dispatch counter;
    then the interval's group-share statistic. Returns the host syncs of each phase.

    The ranks are data-parallel (tensor parallel 1) and the loss is a plain function of the
    logits: megatron-core's vocab-parallel embedding (tensor parallel > 1) and cross entropy
    mask by boolean indexing, syncs of their own that are not Focus parts. So every sync
    counted here would be Focus's."""
    from focus_pretrain.bench.dispatch import DispatchCounter
    from focus_pretrain.focus import FocusRouter
    from focus_pretrain.parallel import apply_cpu_shim
    from focus_pretrain.train.focus_stats import max_group_share, update_balance

    apply_cpu_shim()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)  # data parallel
    config, model = _build(1, LLAMA, {"check_finite": False, **focus_kwargs})
    routers = [m for m in model.modules() if isinstance(m, FocusRouter)]
    model.train()
    offsets = [r.balance_offsets.clone() for r in routers]
    with DispatchCounter() as step:
        for micro in range(micro_batches):
            tokens, positions, _ = _batch(config, seed=micro)
            logits = model(tokens, positions, None)  # [b, s, vocab / tp]
            logits.float().square().mean().backward()
        update_balance(routers, dist.group.WORLD)
    with DispatchCounter() as interval:
        share = max_group_share(routers, dist.group.WORLD)
    return {
        "step_syncs": dict(step.sync_ops),
        "interval_syncs": dict(interval.sync_ops),
        "share": share,
        "offsets_moved": [
            not torch.equal(o, r.balance_offsets) for o, r in zip(offsets, routers, strict=True)
        ],
        "routers": len(routers),
    }
