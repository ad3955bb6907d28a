"""Evaluating a checkpoint outside training: validate it, measure its pattern.

:func:`~focus_pretrain.checkpoint.model.load_checkpoint_model` builds the Megatron model of a
checkpoint in this process group (any tensor-parallel size; context parallelism installed when
``parallel.context_parallel_size > 1``). :func:`evaluate_checkpoint` runs the
trainer's :class:`~focus_pretrain.train.validate.Validator` on it (loss, loss by distance,
retrieval probes, demo recall), optionally on another corpus (``data.sources`` override: the
checkpoint's own tokenizer is kept) or another inference pattern (``model.focus.top_k``, ...),
and measures the hard pattern's kept-pair fraction on the validation tokens.
``tools/evaluate.py`` is the command line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from focus_pretrain.checkpoint.model import EvalModel, load_checkpoint_model
from focus_pretrain.config import Config, config_to_dict, split_shares
from focus_pretrain.data.coordinate import prepare_data_in_job
from focus_pretrain.data.datasets import build_datasets
from focus_pretrain.errors import InputError
from focus_pretrain.focus import FocusRouter, Routing, pattern_density
from focus_pretrain.focus.pattern import key_side_memberships
from focus_pretrain.train.validate import Validator, validation_samples

__all__ = ["DensityMeter", "EvalModel", "evaluate_checkpoint", "load_checkpoint_model"]


class DensityMeter:
    """While entered, forward hooks on every :class:`FocusRouter` of ``model`` record the hard
    pattern's kept-pair fraction (:func:`pattern_density`: ``top_k`` groups, the window's and
    the sinks' pairs included; of the pairs inside each document with packed documents; a
    key in its predecessor's groups too with ``key_groups="own_and_previous"``) of
    every routed sequence; :meth:`mean` averages over layers and
    sequences. Only meaningful without context parallelism (a router sees whole sequences)."""

    def __init__(
        self, model: torch.nn.Module, top_k: int, window: int, sinks: int = 0,
        key_groups: str = "own",
    ) -> None:  # fmt: skip
        self.model, self.top_k, self.window, self.sinks = model, top_k, window, sinks
        self.key_groups = key_groups
        self.values: list[float] = []
        self.handles: list = []

    def __enter__(self) -> DensityMeter:
        routers = [m for m in self.model.modules() if isinstance(m, FocusRouter)]
        self.handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in routers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _hook(self, module, args, kwargs, routing: Routing) -> None:
        member = routing.membership(self.top_k)  # [b, s] group bits
        documents = kwargs.get("documents")  # [b, s] starts of packed documents, or None
        keys = key_side_memberships(member, self.key_groups, documents)  # None: their own
        self.values += pattern_density(member, self.window, self.sinks, documents, keys).tolist()

    def mean(self) -> float | None:
        """Mean kept-pair fraction, ``None`` before any forward."""
        return sum(self.values) / len(self.values) if self.values else None


def check_evaluation(config: Config) -> None:
    """Refuse an evaluation of nothing: ``train.eval_iters=0``, or a ``data.split`` that gives
    the validation split no documents.

    Raises:
        InputError: naming the key and the fix.
    """
    if config.train.eval_iters < 1:
        raise InputError(
            f"train.eval_iters={config.train.eval_iters} evaluates no batch: give it >= 1"
        )
    if split_shares(config.data.split)[1] <= 0:
        raise InputError(
            f"data.split {config.data.split!r} gives the validation split no documents: "
            "nothing to evaluate; give its second number a share, e.g. data.split=98,2,0"
        )


def evaluate_checkpoint(
    checkpoint: str | os.PathLike,
    overrides: Sequence[str] = (),
    out: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Validate ``checkpoint`` (see :func:`load_checkpoint_model` for ``overrides``): the
    :class:`Validator`'s scalars over ``train.eval_iters`` micro-batches of the validation
    split of ``data.sources``, plus ``kept_pairs`` (hard-pattern density on those tokens, a
    Focus model in hard mode without context parallelism; else absent).

    Returns ``{"checkpoint", "step", "overrides", "metrics", "loss_by_position", "config"}``
    (``loss_by_position``: ``{"lo-hi": loss}``, the validation tokens by position bucket);
    rank 0 writes it as JSON to ``out`` when given.

    Raises:
        InputError: ``out`` is a directory, or what :func:`load_checkpoint_model` refuses (a
            missing tokenizer included), before the model is loaded.
    """
    if out is not None and Path(out).is_dir():
        raise InputError(f"--out {out} is a directory: give a file name for the JSON")
    loaded = load_checkpoint_model(
        checkpoint, overrides, need_tokenizer=True, check=check_evaluation
    )
    config, layout = loaded.config, loaded.layout
    trained = config.train  # the split the run validated on: the same size, the same shuffle
    train = replace(config.train, eval_interval=max(config.train.eval_interval, 1))
    config = replace(config, train=train)
    _, prefixes = prepare_data_in_job(config.data, config.run.seed)
    per_step = train.micro_batch_size * layout.data_parallel_size
    _, valid_set = build_datasets(
        config.data,
        loaded.tokenizer,
        prefixes,
        per_step,
        validation_samples(trained, per_step),
        config.run.seed,
    )
    validator = Validator(config, valid_set, loaded.tokenizer, layout, loaded.device)
    focus = config.model.focus
    meter = None
    hard = focus.enabled and not focus.window_only and focus.inference_mode == "hard"
    if hard and layout.context_parallel_group is None:
        meter = DensityMeter(loaded.model, focus.top_k, focus.window, focus.sinks, focus.key_groups)
    metrics = validator.run(loaded.model, meter)
    loaded.model.eval()
    if meter is not None:
        metrics["kept_pairs"] = meter.mean()
    step = int(loaded.checkpoint.name.rpartition("_")[2]) if "_" in loaded.checkpoint.name else None
    result = {
        "checkpoint": str(loaded.checkpoint),
        "step": step,
        "overrides": list(overrides),
        "metrics": metrics,
        "loss_by_position": validator.last_loss_by_position,
        "config": config_to_dict(config),
    }
    if out is not None and layout.is_main:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1))
    return result
