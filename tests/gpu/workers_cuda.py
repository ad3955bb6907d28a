"""Workers of the CUDA model tests: one NCCL process on one GPU, megatron-core without the CPU
shim, the tiny Focus model of the multi-process tests built on the GPU."""

from __future__ import annotations

import torch

from tests.multiprocess.workers_model import LLAMA


def model_on_cuda(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Per case (``dtype``, focus keys): one training forward/backward (soft pattern) and one
    eval forward (hard pattern) of the tiny Llama-style Focus model on CUDA.

    Returns per case the loss, the eval logits ``[b, s, vocab]`` and every gradient, on the CPU
    in fp32, and the device type of the parameters."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from focus_pretrain.focus import FocusConfig
    from focus_pretrain.model import ModelConfig, build_model

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    gen = torch.Generator().manual_seed(3)
    b, s = 2, 384
    tokens = torch.randint(0, LLAMA["vocab_size"], (b, s), generator=gen).cuda()  # [b, s]
    labels = torch.randint(0, LLAMA["vocab_size"], (b, s), generator=gen).cuda()
    positions = torch.arange(s, device="cuda")[None].expand(b, s)  # [b, s]
    results = []
    for case in cases:
        dtype = case.get("dtype", torch.float32)
        focus = {k: v for k, v in case.items() if k != "dtype"}
        config = ModelConfig(focus=FocusConfig(**focus), **LLAMA)
        model_parallel_cuda_manual_seed(42)
        torch.manual_seed(0)
        model = build_model(config, dtype).cuda()
        model.train()
        loss = model(tokens, positions, None, labels=labels).float().mean()  # [b, s] -> []
        loss.backward()
        model.eval()
        with torch.no_grad():
            logits = model(tokens, positions, None)  # [b, s, vocab]
        results.append(
            dict(
                loss=loss.detach().cpu(),
                logits=logits.float().cpu(),
                grads={
                    n: p.grad.float().cpu()
                    for n, p in model.named_parameters()
                    if p.grad is not None
                },
                devices={p.device.type for p in model.parameters()},
            )
        )
    return results
