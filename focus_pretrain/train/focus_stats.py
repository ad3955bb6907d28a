"""Focus bookkeeping of a training run: router balance updates after each optimizer step, and
the statistics logged each interval (largest group share, the pairs sparse training computed,
ring blocks skipped)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from focus_pretrain.focus import FocusRouter
from focus_pretrain.parallel.ring import RingStats


def update_balance(routers: list[FocusRouter], group: dist.ProcessGroup) -> None:
    """After an optimizer step: average each router's load target over ``group`` (data x
    context-parallel ranks: each saw a different part of the batch) and step its offsets.

    One collective for every layer (their statistics stacked ``[layers, K + 1]``) and no host
    round trip: the mean over the ranks that saw a batch is taken on the device."""
    causal = [router for router in routers if router.balance == "causal"]
    if not causal:
        return
    stats = torch.stack([router.balance_statistics() for router in causal])  # [layers, K + 1]
    dist.all_reduce(stats, group=group)
    seen = stats[:, -1]  # [layers] ranks that saw a batch
    targets = stats[:, :-1] / seen.clamp(min=1)[:, None]  # [layers, K]
    for router, target, any_seen in zip(causal, targets, seen > 0, strict=True):
        router.apply_balance(target, any_seen)


def set_training_pattern(layers: list, focus, step: int) -> None:
    """Before the optimizer step ``step`` (0-based): the attention mode the Focus layers train
    with (:meth:`~focus_pretrain.focus.FocusConfig.training_pattern_at`: the soft gate during
    ``focus.soft_warmup_steps``, then sparse); a resumed run picks it up from its step."""
    pattern = focus.training_pattern_at(step)
    for layer in layers:
        layer.training_pattern = pattern


def discard_balance(routers: list[FocusRouter]) -> None:
    """After a skipped bad step: drop what its batch accumulated; the offsets stay put."""
    for router in routers:
        router.discard_balance_target()


def max_group_share(routers: list[FocusRouter], group: dist.ProcessGroup) -> float | None:
    """Largest top-1 group share over the interval, worst layer (counts summed over
    ``group``); 1/K is perfect balance, 1 a collapsed router."""
    if not routers:
        return None
    counts = torch.stack([r.pop_load().float() for r in routers])  # [layers, K]
    dist.all_reduce(counts, group=group)
    shares = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
    return float(shares.max())


def attention_density(layers: list, group: dist.ProcessGroup) -> float | None:
    """Sparse training: the share of causal pairs the Focus layers computed since the last call
    (kept pairs over ``n (n + 1) / 2`` per sample and layer, summed over ``group``), from each
    layer's on-device ``pair_counts`` (read here, once per log interval, then reset); ``None``
    when no layer counted (soft training, context parallelism)."""
    counted = [layer for layer in layers if getattr(layer, "pair_counts", None) is not None]
    if not counted:
        return None
    totals = torch.stack([layer.pair_counts for layer in counted]).sum(dim=0).double()  # [2]
    for layer in counted:
        layer.pair_counts = None
    dist.all_reduce(totals, group=group)
    kept, causal = totals.tolist()
    return kept / causal if causal else None


def ring_skipped_share(stats: RingStats | None) -> float | None:
    """Share of ring steps skipped since the last call (hard-mode blocks with no allowed pair;
    training runs the soft gate, so it counts evaluation)."""
    if stats is None or stats.computed + stats.skipped == 0:
        return None
    share = stats.skipped / (stats.computed + stats.skipped)
    stats.computed = stats.skipped = 0
    return share
