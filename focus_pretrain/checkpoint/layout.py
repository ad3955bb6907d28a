"""A checkpoint's parallel layout: what it was saved at, and whether resuming it under another
one needs resharding.

:func:`saved_layout` reads the data-parallel, tensor-parallel and context-parallel sizes and the
ZeRO stage from a checkpoint's recipe and its ZeRO file names; :func:`check_layout` refuses a
plain resume at another layout (DeepSpeed would restore ZeRO partitions and tensor-parallel
shards cut for the old one) and names ``train.load_universal``, which converts the checkpoint
to DeepSpeed's universal form and loads that (:mod:`focus_pretrain.checkpoint.reshard`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from focus_pretrain.config import Config, load_config
from focus_pretrain.errors import InputError

# one optimizer file per data x context-parallel rank (the first number) and TP rank
_ZERO_FILE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def run_layout(layout, parallel) -> dict[str, int]:
    """This run's layout (a :class:`~focus_pretrain.parallel.launch.ParallelLayout` and the
    recipe's ``parallel`` section), keyed like :func:`saved_layout`."""
    return {
        "data_parallel_size": layout.data_parallel_size,
        "tensor_parallel_size": layout.tensor_parallel_size,
        "context_parallel_size": layout.context_parallel_size,
        "zero_stage": parallel.zero_stage,
    }


def saved_layout(checkpoint: Path) -> dict[str, int] | None:
    """``{"data_parallel_size", "tensor_parallel_size", "context_parallel_size",
    "zero_stage"}`` of a checkpoint, read from its recipe and its ZeRO file names (one
    optimizer file per data x context-parallel rank and tensor-parallel rank); ``None``
    without a readable recipe. ``data_parallel_size`` is ``None`` at ZeRO stage 0 (no such
    files)."""
    recipe = Path(checkpoint) / "config.yaml"
    try:
        parallel = load_config(recipe).parallel
    except (FileNotFoundError, ValueError):  # none, or unreadable (see train.allow_changes)
        return None
    ranks = {int(m.group(1)) for p in Path(checkpoint).iterdir() if (m := _ZERO_FILE.match(p.name))}
    dp_cp = len(ranks) or None
    return {
        "data_parallel_size": None if dp_cp is None else dp_cp // parallel.context_parallel_size,
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "context_parallel_size": parallel.context_parallel_size,
        "zero_stage": parallel.zero_stage,
    }


LAYOUT_KEYS = {
    "data_parallel_size": "data-parallel size",
    "tensor_parallel_size": "parallel.tensor_parallel_size",
    "context_parallel_size": "parallel.context_parallel_size",
    "zero_stage": "parallel.zero_stage",
}


# ZeRO-1 and ZeRO-2 partition the optimizer state alike (one checkpoint format): a change
# between them alone resumes plainly (verified: the same losses as an uninterrupted run)
_ZERO_FAMILY = {0: 0, 1: 1, 2: 1, 3: 3}


def layout_changes(saved: dict[str, Any] | None, now: dict[str, int]) -> list[tuple[str, Any, Any]]:
    """``(what, saved value, current value)`` for every part of the parallel layout that
    differs in a way a plain resume cannot load (a saved ``None``: unknown, not compared;
    ZeRO stages 1 and 2 count as one)."""
    if saved is None:
        return []
    changes = [
        (label, saved[key], now[key])
        for key, label in LAYOUT_KEYS.items()
        if saved.get(key) is not None and saved[key] != now[key]
    ]
    if _ZERO_FAMILY[saved["zero_stage"]] == _ZERO_FAMILY[now["zero_stage"]]:
        changes = [c for c in changes if c[0] != LAYOUT_KEYS["zero_stage"]]
    return changes


def check_layout(checkpoint: Path, config: Config, layout: dict[str, int]) -> bool:
    """Whether resuming ``checkpoint`` under ``layout`` reshards it. Raises ``ValueError``
    when the layouts differ and ``train.load_universal`` is off (naming it), or when either
    side has no ZeRO (``parallel.zero_stage=0``: nothing the universal converter reads)."""
    saved = saved_layout(Path(checkpoint))
    changes = layout_changes(saved, layout)
    if not changes:
        return False
    listed = "; ".join(f"{k}: {a} in the checkpoint, {b} now" for k, a, b in changes)
    if not config.train.load_universal:
        raise InputError(
            f"refusing to resume from {checkpoint}: it was saved at another parallel layout "
            f"({listed}), and a plain resume restores ZeRO's optimizer partitions and the "
            "tensor-parallel shards as they were cut for that layout. Set "
            "train.load_universal=true (or pass --universal-checkpoint) to reshard it through "
            "DeepSpeed's universal checkpoint (weights, Adam moments and the data position "
            "kept), or resume at the saved layout"
        )
    stages = (saved["zero_stage"], layout["zero_stage"])
    if 0 in stages:
        raise InputError(
            f"cannot reshard {checkpoint} ({listed}): train.load_universal needs ZeRO on both "
            f"sides (parallel.zero_stage 1-3), got {stages[0]} in the checkpoint and "
            f"{stages[1]} now"
        )
    return True
