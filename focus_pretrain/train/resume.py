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
:func:`~focus_pretrain.checkpoint.layout.check_layout` refuses a plain resume at another
layout (DeepSpeed would restore ZeRO
partitions and tensor-parallel shards cut for the old one) and names ``train.load_universal``,
which converts the checkpoint to DeepSpeed's universal form and loads that
(:mod:`focus_pretrain.checkpoint.reshard`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from focus_pretrain.checkpoint.layout import check_layout
from focus_pretrain.config import Config, config_to_dict, load_config
from focus_pretrain.errors import InputError
from focus_pretrain.recipe_files import flatten

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
    With ``layout`` (this run's, :func:`~focus_pretrain.checkpoint.layout.run_layout`), another
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


def check_run_config(path: Path) -> None:
    """Refuse a run directory whose ``config.yaml`` this program did not write: the run writes
    its resolved recipe there (and would replace the file). Ours is a YAML mapping of the
    recipe's sections (``run``, ``model``, ``data``, ``train`` at least, nothing else), each a
    mapping; anything else is the user's.

    Raises:
        InputError: ``path`` exists and is not a resolved recipe.
    """
    import yaml

    if not path.exists() and not path.is_symlink():
        return
    refusal = InputError(
        f"{path} is not a recipe this program wrote (a run writes its resolved recipe there): "
        "move the file away or choose another run.output_dir"
    )
    if not path.is_file() or path.is_symlink():
        raise refusal
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        raise refusal from None
    sections = {field.name for field in dataclasses.fields(Config)}
    if (
        not isinstance(data, dict)
        or not {"run", "model", "data", "train"} <= set(data) <= sections
        or not all(isinstance(value, dict) for value in data.values())
    ):
        raise refusal
