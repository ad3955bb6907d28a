"""Worker for tests/multiprocess/test_bad_steps.py: the bad-step decision on real ranks."""

from __future__ import annotations

import torch
from torch import nn

from focus_pretrain.train.bad_steps import BadStepPolicy, GradientWatch


def decide_steps(rank: int, world_size: int) -> dict:
    """Four steps of a tiny linear model; each rank backpropagates its own loss:
    step 1 clean; step 2 a NaN loss on the last rank only; step 3 a finite loss with an inf
    gradient on rank 0 only; step 4 clean. Returns each step's decision and the counters."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    policy = BadStepPolicy(max_consecutive=2, watch=GradientWatch(model.parameters(), "cpu"))
    decisions, consecutive = [], []
    for step in (1, 2, 3, 4):
        x = torch.randn(4, 3) + rank
        loss = model(x).square().mean()
        if step == 2 and rank == world_size - 1:
            loss = loss * float("nan")
        if step == 3 and rank == 0:
            loss.register_hook(lambda g: g * float("inf"))  # the loss stays finite
        loss.backward()
        model.zero_grad()
        decisions.append(policy.is_bad(loss.detach(), step))
        consecutive.append((policy.consecutive, policy.exhausted))
    return {"bad": decisions, "consecutive": consecutive, "skipped": policy.skipped}
