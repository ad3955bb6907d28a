"""Resume safety: a run resumes only with the recipe its checkpoint was trained with.

Every checkpoint holds the resolved recipe (``checkpoints/step_N/config.yaml``). Before a run
resumes, :func:`check_resume` compares it with the recipe now given and refuses (a
``ValueError`` naming each differing key with both values) when they differ in anything that
changes the model or the order of the data:

* every ``model.*`` key, except those that never change the function the model computes
  (:data:`FREE_KEYS`: the attention backends, ``check_finite``, activation recompute, where
  weights are initialised and their initial scale, which a resume never uses);
* every ``data.*`` key, except where and how the data is prepared (cache, workers, timeouts);
* ``run.seed`` (data order, dropout), ``train.global_batch_size`` (which samples make a step)
  and ``train.freeze`` (which weights train, and the optimizer state's layout).

Everything else may change on resume: learning rate and schedule, ``train.steps`` (continue
longer), the logging, evaluation and checkpoint cadences. ``train.allow_changes: true``
continues anyway (the differences are then printed and recorded in the run's ``start`` event).

The parallel layout (data-parallel size, ``parallel.tensor_parallel_size``,
``parallel.context_parallel_size``, ``parallel.zero_stage``) may change only through resharding:
:func:`check_layout` refuses a plain resume at another layout (DeepSpeed would restore ZeRO
partitions and tensor-parallel shards cut for the old one) and names ``train.load_universal``,
which converts the checkpoint to DeepSpeed's universal form and loads that
(:mod:`focus_pretrain.train.reshard`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from focus_pretrain.config import Config, config_to_dict, load_config
from focus_pretrain.errors import InputError

GUARDED_SECTIONS = ("model.", "data.")
GUARDED_KEYS = frozenset({"run.seed", "train.global_batch_size", "train.freeze"})
FREE_KEYS = frozenset(
    {
        "model.focus.backend",
        "model.focus.inference_backend",
        "model.focus.check_finite",
        "model.recompute",
        "model.cpu_initialization",
        "model.init_std",
        "data.cache_dir",
        "data.workers",
        "data.tokenize_in_job",
        "data.prepare_timeout_s",
    }
)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and ``None`` stay values)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def guarded(key: str) -> bool:
    """Whether a change of ``key`` (dotted) changes the model or the data order."""
    if key in FREE_KEYS:
        return False
    return key in GUARDED_KEYS or key.startswith(GUARDED_SECTIONS)


def recipe_changes(saved: Config, current: Config) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` for every guarded key that differs, sorted."""
    old, new = flatten(config_to_dict(saved)), flatten(config_to_dict(current))
    keys = sorted(k for k in old.keys() | new.keys() if guarded(k))
    return [(k, old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)]


def check_resume(
    checkpoint: Path | None, config: Config, layout: dict[str, int] | None = None
) -> list[tuple[str, Any, Any]]:
    """Compare ``config`` with the recipe saved in ``checkpoint`` (a checkpoint directory, or
    ``None`` for a fresh run). Returns the guarded differences (empty when there are none or
    nothing to compare); raises ``ValueError`` naming them unless ``train.allow_changes``.
    With ``layout`` (this run's, :func:`run_layout`), another
    saved layout is refused unless ``train.load_universal`` (:func:`check_layout`)."""
    saved_path = None if checkpoint is None else Path(checkpoint) / "config.yaml"
    if saved_path is None or not saved_path.is_file():
        return []
    allow = config.train.allow_changes
    try:
        saved = load_config(saved_path)
    except ValueError as err:
        if allow:
            return [("<checkpoint recipe>", f"unreadable: {err}", None)]
        raise InputError(
            f"cannot compare the recipe with the one checkpoint {checkpoint} was trained with "
            f"({saved_path}: {err}); set train.allow_changes=true to resume anyway"
        ) from err
    changes = recipe_changes(saved, config)
    if changes and not allow:
        listed = "; ".join(f"{k}: {a!r} in the checkpoint, {b!r} now" for k, a, b in changes)
        raise InputError(
            f"refusing to resume from {checkpoint}: the recipe differs from the one it was "
            f"trained with in keys that change the model or the data order ({listed}). Restore "
            "them, train into a new run.output_dir, or set train.allow_changes=true to resume "
            "anyway"
        )
    if layout is not None:
        check_layout(Path(checkpoint), config, layout)
    return changes


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
