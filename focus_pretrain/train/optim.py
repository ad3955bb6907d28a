"""Freezing policies, AdamW parameter groups and optimizer, the learning-rate schedule, and the
DeepSpeed configuration of a recipe."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from focus_pretrain.config import Config, TrainConfig
from focus_pretrain.parallel.deepspeed_overrides import merge_deepspeed_config
from focus_pretrain.parallel.launch import load_deepspeed_ops_in_turn


def is_router_parameter(name: str) -> bool:
    """Router parameters (``W_g`` and centroids) of a Focus layer."""
    return ".router." in name or name.startswith("router.")


def no_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Norm weights, biases and router centroids are not decayed."""
    return param.dim() < 2 or name.endswith(".bias") or "norm" in name or "centroids" in name


def apply_freeze_policy(model: nn.Module, config: TrainConfig) -> dict[str, int]:
    """Set ``requires_grad`` for ``config.freeze``; returns trainable/frozen parameter counts.

    * ``scratch`` and ``two_phase``: everything trainable (``two_phase`` holds the original
      weights still during phase 1 through :class:`PhaseGate`).
    * ``retrofit``: only router parameters are trainable; every original weight is frozen and
      kept out of the optimizer.
    * ``centroids``: only the routers' centroids are trainable (``W_g`` frozen at its
      initialisation too): the literal "freeze everything except the centroids".
    """
    routers = 0
    for name, param in model.named_parameters():
        router = is_router_parameter(name)
        routers += param.numel() if router else 0
        if config.freeze == "retrofit":
            param.requires_grad_(router)
        elif config.freeze == "centroids":
            param.requires_grad_(router and name.endswith("centroids"))
        else:
            param.requires_grad_(True)
    if config.freeze in ("retrofit", "centroids", "two_phase") and routers == 0:
        raise ValueError(
            f"train.freeze={config.freeze} needs Focus routers, but the model has "
            "none (model.focus.enabled is false?)"
        )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return {"trainable": trainable, "frozen": frozen, "router": routers}


def parameter_groups(model: nn.Module, config: TrainConfig) -> list[dict]:
    """AdamW groups over trainable parameters: ``{router, model} x {decay, no_decay}``.

    Each group carries ``lr_scale`` (1.0; the two-phase gate sets the model groups to 0) and a
    ``name``; empty groups are dropped.
    """
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            key = (is_router_parameter(name), no_weight_decay(name, param))
            groups.setdefault(key, []).append(param)
    return [
        {
            "params": params,
            "weight_decay": 0.0 if no_decay else config.weight_decay,
            "name": f"{'router' if router else 'model'}_{'no_decay' if no_decay else 'decay'}",
            "lr_scale": 1.0,
        }
        for (router, no_decay), params in sorted(groups.items())
    ]


def build_optimizer(groups: list[dict], config: TrainConfig, cpu_offload: bool):
    """AdamW over ``groups``; with ZeRO-Offload DeepSpeed's vectorised CPU AdamW (compiled on
    first use), which DeepSpeed requires for offloaded optimizer states. On a GPU, PyTorch's
    fused AdamW (:func:`use_fused_adamw`): multi-tensor kernels, step counts on the device."""
    kwargs = dict(lr=config.lr, betas=tuple(config.betas), eps=config.eps)
    if cpu_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        load_deepspeed_ops_in_turn("CPUAdamBuilder")  # compiled by one rank, not all at once
        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    if use_fused_adamw(groups, cpu_offload):
        kwargs["fused"] = True
    return torch.optim.AdamW(groups, **kwargs)


def use_fused_adamw(groups: list[dict], cpu_offload: bool) -> bool:
    """Whether AdamW over ``groups`` takes ``fused=True``: on a CUDA machine, without
    ZeRO-Offload, when every parameter is a floating-point tensor on the GPU, or on the CPU
    when the model was initialised there (``model.cpu_initialization``), since DeepSpeed moves
    the module to the GPU before the first step, and under ZeRO the optimizer steps fp32
    partitions on the GPU. (The fused kernel checks devices at its first step, not here.)"""
    if cpu_offload or not torch.cuda.is_available():
        return False
    params = [p for group in groups for p in group["params"]]
    return all(p.is_floating_point() and p.device.type in ("cuda", "cpu") for p in params)


def deepspeed_config(config: Config, grad_accum: int) -> dict:
    """The DeepSpeed config dict of a recipe (micro-batch, accumulation, clipping, ZeRO stage
    and offload, precision), with ``parallel.deepspeed`` merged over it (monitors, profilers,
    bucket sizes: :mod:`focus_pretrain.parallel.deepspeed_overrides`); the optimizer and the
    schedule stay ours."""
    train, parallel = config.train, config.parallel
    zero: dict = {"stage": parallel.zero_stage}
    if parallel.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    generated = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": train.clip_grad,
        "zero_optimization": zero,
        "bf16": {"enabled": train.precision == "bf16"},
        "fp16": {"enabled": train.precision == "fp16", "initial_scale_power": 16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    return merge_deepspeed_config(generated, parallel.deepspeed)


def lr_lambda(config: TrainConfig) -> Callable[[int], float]:
    """Multiplier of ``config.lr`` at a step: linear warm-up, then cosine/linear/constant."""
    floor = config.min_lr / config.lr

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.schedule == "constant":
            return 1.0
        span = max(1, config.steps - config.warmup_steps)
        progress = min(1.0, (step - config.warmup_steps) / span)
        if config.schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1 - progress)

    return factor


class PhaseGate:
    """Phase 1 of ``two_phase``: original weights get zero gradient and zero learning rate.

    Zeroed gradients keep their Adam moments at zero and the zero rate cancels weight decay, so
    the weights are exactly unchanged until :meth:`open`; after it they train normally, as if
    unfrozen at that step. (Their backward is still computed during phase 1.)
    """

    def __init__(self, model: nn.Module) -> None:
        self._handles = [
            param.register_hook(torch.zeros_like)
            for name, param in model.named_parameters()
            if param.requires_grad and not is_router_parameter(name)
        ]

    @property
    def closed(self) -> bool:
        return bool(self._handles)

    def scale(self, group: dict) -> float:
        """LR multiplier of an optimizer group while the gate is closed."""
        return 0.0 if self.closed and group["name"].startswith("model") else group["lr_scale"]

    def open(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
