"""Workers for the model tests (real gloo processes; megatron-core through the CPU shim)."""

from __future__ import annotations

import dataclasses

import torch


def _setup(world_size: int, **model_kwargs):
    from focus_pretrain.parallel import apply_cpu_shim

    apply_cpu_shim()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from focus_pretrain.model import ModelConfig, build_model

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    model_parallel_cuda_manual_seed(42)
    config = ModelConfig(tensor_parallel_size=world_size, **model_kwargs)
    torch.manual_seed(0)
    return config, build_model


def _batch(config, b=2, s=48, seed=3):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (b, s), generator=gen)
    labels = torch.randint(0, config.vocab_size, (b, s), generator=gen)
    position_ids = torch.arange(s)[None].expand(b, s)
    return tokens, position_ids, labels


def forward_backward(rank: int, world_size: int, model_kwargs: dict, focus_kwargs: dict) -> dict:
    """Loss, logits and all gradients of one forward/backward (train mode)."""
    from focus_pretrain.focus import FocusConfig

    config, build_model = _setup(world_size, focus=FocusConfig(**focus_kwargs), **model_kwargs)
    model = build_model(config)
    tokens, position_ids, labels = _batch(config)
    model.train()
    loss = model(tokens, position_ids, None, labels=labels).float().mean()  # [b, s] -> scalar
    loss.backward()
    model.eval()
    with torch.no_grad():
        logits = model(tokens, position_ids, None)  # [b, s, vocab / tp]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return dict(
        loss=loss.detach(),
        logits=logits,
        grads=grads,
        params=dict(model.named_parameters()).keys().__len__(),
        config=dataclasses.asdict(config),
    )
