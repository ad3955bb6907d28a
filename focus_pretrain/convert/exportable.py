"""What an export (full model or router adapter) can reproduce: the one rule, read by
``export_hf``, ``export_router_adapter`` and the retrofit command (which checks it before it
exports, and evaluates a run it cannot export)."""

from __future__ import annotations

import os
from pathlib import Path

from focus_pretrain.checkpoint.read import checkpoint_config, resolve_checkpoint
from focus_pretrain.config import Config
from focus_pretrain.errors import UnsupportedInputError


def exportable_checkpoint(checkpoint: str | os.PathLike) -> tuple[Path, Config]:
    """The checkpoint directory and its config, refusing what an export (full model or router
    adapter) cannot reproduce (:func:`export_refusal`)."""
    ckpt = resolve_checkpoint(checkpoint)
    config = checkpoint_config(ckpt)
    reason = export_refusal(config)
    if reason is not None:
        raise UnsupportedInputError(f"{ckpt} {reason}")
    return ckpt, config


def export_refusal(config: Config) -> str | None:
    """Why a run of ``config`` cannot be exported (full model or router adapter), as the end
    of a sentence about the run, or ``None``. The one place for that rule: the shipped modeling
    code routes each token on its own (``balance=causal``: softmax of its logits plus the saved
    offsets; ``balance=none``: the same with offsets that stay zero); it computes every
    ``key_groups`` rule."""
    focus = config.model.focus
    if focus.enabled and focus.balance == "sinkhorn":
        return (
            f"was trained with model.focus.balance={focus.balance}, whose routing is "
            "balanced over the whole sequence (not causal); an export (full model or router "
            "adapter) routes each token on its own, so its logits would differ from the trained "
            "model's. Export a run trained with model.focus.balance=causal (the default), e.g. "
            "fine-tune this one's routers with it"
        )
    return None
