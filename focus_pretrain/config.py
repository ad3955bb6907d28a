"""Recipes: YAML validated into typed dataclasses, with dotted command-line overrides.

A recipe has five sections; each layer owns the dataclass of its own (``model``:
:class:`~focus_pretrain.model.config.ModelConfig` with ``model.focus``; ``data``:
:class:`~focus_pretrain.data.datasets.DataConfig`; ``parallel``:
:class:`~focus_pretrain.parallel.config.ParallelConfig`), and this module holds the ``run`` and
``train`` sections (the trainer consumes the whole recipe, so its section lives below it) and
the checks that span sections.

``load_config("configs/7b.yaml", ["run.output_dir=runs/x", "model.focus.window=256"])`` reads the
YAML, applies each ``section.key=value`` override (values parsed as YAML scalars), and builds the
typed :class:`Config`. Unknown keys, wrong types and bad values fail before any work, naming the
dotted key and what is allowed. :func:`save_config` writes the resolved config (every default
filled in) into run and checkpoint directories.

Plain frozen dataclasses and a small loader (:func:`from_mapping`, in
:mod:`focus_pretrain.recipe_files` with the YAML reading), not pydantic: the
sections stay importable by the plain-PyTorch layers (``focus/`` owns ``FocusConfig``), each
section's ``__post_init__`` keeps its own checks, and the loader's errors already name the
dotted key and the allowed keys; pydantic would add a dependency, a wrapper per error kind to
keep those messages, and looser coercions (``"1"`` as ``True``) we do not want.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from focus_pretrain.data.datasets import DataConfig
from focus_pretrain.errors import as_input_error
from focus_pretrain.model.config import ModelConfig
from focus_pretrain.parallel.config import ParallelConfig
from focus_pretrain.recipe_files import (  # re-exported: their documented home
    RECIPES_DIR,
    apply_override,
    config_to_dict,
    from_mapping,
    read_recipe,
    resolve_recipe,
    save_config,
    shipped_recipes,
)
from focus_pretrain.validation import check_choice, check_int, check_positive


@dataclass(frozen=True)
class RunConfig:
    """Where and how a run lives.

    Attributes:
        name: a label for logs.
        output_dir: run directory (resolved config, checkpoints, TensorBoard events).
        seed: the base random seed.
    """

    name: str = "focus"
    output_dir: str = "runs/focus"
    seed: int = 1234

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ValueError("run.output_dir must be a non-empty path")
        check_int("run.seed", self.seed, low=0)


PRECISIONS = ("bf16", "fp16", "fp32")
SCHEDULES = ("cosine", "linear", "constant")
FREEZE_POLICIES = ("scratch", "retrofit", "centroids", "two_phase")
OBJECTIVES = ("lm", "distill", "mix", "attention_mass")  # train.objective (train.loss)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, schedule, freezing, logging and checkpoint cadence.

    Attributes:
        steps: optimizer steps.
        micro_batch_size: samples per device per micro-step.
        global_batch_size: samples per optimizer step over all data-parallel ranks
            (``micro_batch_size * dp * gradient_accumulation``; must divide exactly).
        precision: ``bf16`` | ``fp16`` | ``fp32``.
        lr, min_lr, warmup_steps, schedule: linear warm-up to ``lr``, then ``cosine`` or
            ``linear`` decay to ``min_lr`` at ``steps`` (or ``constant``).
        weight_decay: AdamW decay (never on norms, biases, router centroids).
        betas, eps: AdamW moments.
        clip_grad: global gradient-norm clipping (0 disables).
        freeze: ``scratch`` (train everything), ``retrofit`` (only routers, every original
            weight frozen and outside the optimizer), ``centroids`` (like ``retrofit`` but only
            the routers' centroids train: ``W_g`` stays frozen too), ``two_phase`` (routers only for
            ``router_only_steps``, then everything).
        router_only_steps: length of phase 1 of ``two_phase``.
        init_from_hf: a local HuggingFace checkpoint directory (config.json + safetensors)
            whose weights initialise a fresh run (routers keep their own initialisation); the
            ``model`` section must have its architecture (``tools/import_hf.py`` prints it).
            Ignored when the run resumes from its own checkpoint.
        log_interval, eval_interval, eval_iters: console/TensorBoard cadence; validation every
            ``eval_interval`` steps over ``eval_iters`` micro-batches (0 disables).
        recall_docs: held-out demo documents scored at each validation for long-range recall
            (loss and accuracy on recalled values; demo corpus only, 0 disables).
        save_interval: checkpoint every N steps (0: only at the end and on SIGTERM/SIGINT).
        keep_last: checkpoints kept (older ones are deleted after a new one is complete).
        peak_tflops: per-device peak for MFU; ``None`` looks the GPU up (CPU: MFU not shown).
        tensorboard: write TensorBoard events under ``run.output_dir/tensorboard``.
        wandb: also log to Weights & Biases, the same keys: ``online``, ``offline`` (written
            under ``run.output_dir/wandb``, ``wandb sync`` uploads it later; no network needed)
            or ``None`` (off); needs the ``wandb`` package (``pip install -e ".[wandb]"``).
        wandb_project: the W&B project (the run's name is ``run.name``).
        allow_changes: resume even when the recipe differs from the checkpoint's in keys that
            change the model or the data order (refused otherwise, naming them;
            :mod:`focus_pretrain.train.resume`).
        load_universal: resume the latest checkpoint at another parallel layout (data-parallel
            size, tensor-parallel size, context-parallel size, ZeRO stage 1-3) with the optimizer
            state kept: it is converted once to DeepSpeed's universal checkpoint
            (``step_N/universal``) and loaded from that; at the saved layout the resume stays
            plain. Off, another layout is refused (:mod:`focus_pretrain.checkpoint.reshard`).
        objective: what a step minimises (:mod:`focus_pretrain.train.distill`): ``lm`` (the
            next-token loss), ``distill`` (KL from the frozen original, the model with its
            Focus layers bypassed, to the Focus model: retrofits only, ``freeze: retrofit`` or
            ``centroids``), ``mix`` (``(1 - distill_weight) * lm + distill_weight * KL``) or
            ``attention_mass`` (retrofits only: per Focus layer, ``-log`` of the share of the
            frozen original's attention mass the training pattern keeps, the model run dense
            and only the routers differentiated, :mod:`focus_pretrain.focus.attention_mass`;
            the ``sigmoid`` gate form, no full recompute, no dropout, no context parallelism).
        distill_weight: the KL's weight in ``mix``, in ``[0, 1]``.
        distill_temperature: the softmax temperature ``T`` of the KL (scaled by ``T^2``).
        max_consecutive_bad_steps: a step whose loss or gradient norm is not finite is skipped
            (weights and optimizer state untouched, the batch consumed, ``skipped_steps``
            logged); this many in a row stop the run with a checkpoint and a non-zero exit
            (:mod:`focus_pretrain.train.bad_steps`).
    """

    steps: int = 100
    micro_batch_size: int = 4
    global_batch_size: int = 8
    precision: str = "bf16"
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 10
    schedule: str = "cosine"
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    clip_grad: float = 1.0
    freeze: str = "scratch"
    router_only_steps: int = 0
    init_from_hf: str | None = None
    log_interval: int = 10
    eval_interval: int = 50
    eval_iters: int = 4
    recall_docs: int = 16
    save_interval: int = 0
    keep_last: int = 2
    peak_tflops: float | None = None
    tensorboard: bool = True
    wandb: str | None = None
    wandb_project: str = "focus-pretrain"
    allow_changes: bool = False
    load_universal: bool = False
    max_consecutive_bad_steps: int = 5
    objective: str = "lm"
    distill_weight: float = 0.5
    distill_temperature: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "micro_batch_size",
            "global_batch_size",
            "log_interval",
            "keep_last",
            "max_consecutive_bad_steps",
        ):
            check_int(f"train.{name}", getattr(self, name), low=1)
        for name in (
            "warmup_steps",
            "router_only_steps",
            "eval_interval",
            "eval_iters",
            "recall_docs",
            "save_interval",
        ):
            check_int(f"train.{name}", getattr(self, name), low=0)
        check_choice("train.precision", self.precision, PRECISIONS)
        if self.wandb is not None:
            check_choice("train.wandb", self.wandb, ("online", "offline"))
        check_choice("train.schedule", self.schedule, SCHEDULES)
        check_choice("train.freeze", self.freeze, FREEZE_POLICIES)
        check_positive("train.lr", self.lr)
        check_positive("train.eps", self.eps)
        for name in ("min_lr", "weight_decay", "clip_grad"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr ({self.min_lr}) must be <= train.lr ({self.lr})")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"train.betas must be two numbers in [0, 1), got {self.betas}")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size ({self.global_batch_size}) must be a "
                f"multiple of train.micro_batch_size ({self.micro_batch_size})"
            )
        if self.freeze == "two_phase" and not 0 < self.router_only_steps < self.steps:
            raise ValueError(
                "train.router_only_steps must be in (0, train.steps) for "
                f"train.freeze=two_phase, got {self.router_only_steps}"
            )
        if self.peak_tflops is not None:
            check_positive("train.peak_tflops", self.peak_tflops)
        check_choice("train.objective", self.objective, OBJECTIVES)
        if not 0 <= self.distill_weight <= 1:
            raise ValueError(f"train.distill_weight must be in [0, 1], got {self.distill_weight}")
        check_positive("train.distill_temperature", self.distill_temperature)
        if self.objective != "lm" and self.freeze not in ("retrofit", "centroids"):
            raise ValueError(
                f"train.objective={self.objective} learns from the frozen original, so it needs "
                f"train.freeze=retrofit or centroids (got {self.freeze}); use "
                "train.objective=lm to train every weight"
            )


PROBE_KINDS = ("passkey", "multikey")


@dataclass(frozen=True)
class ProbesConfig:
    """Synthetic long-context retrieval probes (the ``probes:`` section), scored at every
    validation and by ``tools/evaluate.py`` (see :mod:`focus_pretrain.train.probes`).

    Attributes:
        lengths: sequence lengths in tokens (each <= ``model.max_seq_length``); empty disables.
        depths: where the needle sits in the filler, as a fraction in ``[0, 1]`` (0: right
            after the instruction, 1: just before the question).
        count: sequences per (kind, length, depth).
        kinds: ``passkey`` (one number hidden in filler, asked for at the end) and/or
            ``multikey`` (``keys`` key-value pairs hidden at random depths, the one at the
            given depth asked for).
        keys: key-value pairs of a ``multikey`` sequence.
        digits: digits of every hidden number (the answer tokens).
    """

    lengths: list[int] = field(default_factory=list)
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    count: int = 4
    kinds: list[str] = field(default_factory=lambda: list(PROBE_KINDS))
    keys: int = 4
    digits: int = 5

    def __post_init__(self) -> None:
        for length in self.lengths:
            check_int("probes.lengths[]", length, low=16)
        for depth in self.depths:
            if isinstance(depth, bool) or not isinstance(depth, int | float) or not 0 <= depth <= 1:
                raise ValueError(f"probes.depths[] must be numbers in [0, 1], got {depth!r}")
        if self.lengths and not self.depths:
            raise ValueError("probes.depths must list at least one depth")
        for kind in self.kinds:
            check_choice("probes.kinds[]", kind, PROBE_KINDS)
        if self.lengths and not self.kinds:
            raise ValueError(f"probes.kinds must list at least one of {', '.join(PROBE_KINDS)}")
        check_int("probes.count", self.count, low=1)
        check_int("probes.keys", self.keys, low=1)
        check_int("probes.digits", self.digits, low=1, high=18)


@dataclass(frozen=True)
class Config:
    """A whole recipe: ``run``, ``model`` (with ``model.focus``), ``data``, ``train``,
    ``parallel`` (the only section that sets tensor and context parallelism) and ``probes``."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    probes: ProbesConfig = field(default_factory=ProbesConfig)

    def __post_init__(self) -> None:
        self.parallel.check_model(self.model)
        self.parallel.check_seq_length(self.data.seq_length)
        if self.model.max_seq_length < self.data.seq_length:
            raise ValueError(
                f"model.max_seq_length ({self.model.max_seq_length}) must be >= "
                f"data.seq_length ({self.data.seq_length})"
            )
        self._check_objective()
        check_split(self.data.split, validates=validates(self.train))
        for length in self.probes.lengths:
            if length > self.model.max_seq_length:
                raise ValueError(
                    f"probes.lengths has {length}, beyond model.max_seq_length "
                    f"({self.model.max_seq_length}); lower it or raise model.max_seq_length"
                )
            self.parallel.check_seq_length(length, "probes.lengths[]")

    def _check_objective(self) -> None:
        """What ``train.objective=attention_mass`` needs of the other sections."""
        if self.train.objective != "attention_mass":
            return
        if self.model.focus.gate_form != "sigmoid":
            raise ValueError(
                "train.objective=attention_mass needs model.focus.gate_form=sigmoid (a gate in "
                f"[0, 1]), got {self.model.focus.gate_form}; use train.objective=lm or distill"
            )
        if self.model.recompute == "full":
            raise ValueError(
                "train.objective=attention_mass measures each layer inside its forward, which "
                "model.recompute=full runs without gradients; use model.recompute=selective "
                "or none (a retrofit's frozen model keeps few activations)"
            )
        if self.model.hidden_dropout > 0:
            raise ValueError(
                "train.objective=attention_mass measures the frozen original, which "
                f"model.hidden_dropout={self.model.hidden_dropout} would perturb; set it to 0"
            )
        if self.parallel.context_parallel_size > 1:
            raise ValueError(
                "train.objective=attention_mass does not run under context parallelism "
                f"(parallel.context_parallel_size={self.parallel.context_parallel_size}); "
                "retrofit at context_parallel_size=1 or use train.objective=distill"
            )


def validates(train: TrainConfig) -> bool:
    """Whether a run with ``train`` validates (``eval_interval`` and ``eval_iters`` both > 0)."""
    return bool(train.eval_interval) and bool(train.eval_iters)


def split_shares(split: str) -> tuple[float, float, float]:
    """The train, validation and test shares of a ``data.split`` (checked by ``DataConfig``)."""
    train, valid, test = (float(part) for part in split.split(","))
    return train, valid, test


def check_split(split: str, validates: bool) -> None:
    """Refuse a ``data.split`` that gives training no documents, or validation none when the
    run validates (Megatron would build an empty split, and the run fail at its first use)."""
    train, valid, _ = split_shares(split)
    if train <= 0:
        raise ValueError(
            f"data.split {split!r} gives the training split no documents: give its first "
            "number a share, e.g. data.split=98,2,0"
        )
    if validates and valid <= 0:
        raise ValueError(
            f"data.split {split!r} gives the validation split no documents, but the run "
            "validates (train.eval_interval and train.eval_iters > 0): give its second number "
            "a share, e.g. data.split=98,2,0, or set train.eval_interval=0"
        )


# Recipes and checkpoints written before the parallel section became the only home of these.
_MOVED_TO_PARALLEL = ("tensor_parallel_size", "context_parallel_size", "cp_mode")


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> Config:
    """Load ``path`` (YAML; ``None`` for all defaults), apply ``overrides``, validate.

    Raises:
        MissingInputError: (a ``FileNotFoundError``) the recipe does not exist.
        InputError: (a ``ValueError``) a bad override, key, type or value (the message names
            the dotted key).
    """
    return as_input_error(lambda: _load_config(path, overrides))


def _load_config(path: str | os.PathLike | None, overrides: Sequence[str]) -> Config:
    tree: dict[str, Any] = {} if path is None else read_recipe(resolve_recipe(path), ())
    for override in overrides:
        apply_override(tree, override)
    _move_legacy_parallel_keys(tree)
    return from_mapping(Config, tree, section="")


def recipe_sections(path: str | os.PathLike) -> dict[str, Any]:
    """The sections of the recipe at ``path`` with its ``defaults:`` merged in, as written (not
    validated: a base recipe may leave out what its users fill in)."""
    return as_input_error(lambda: read_recipe(resolve_recipe(path), ()))


def _move_legacy_parallel_keys(tree: dict[str, Any]) -> None:
    """``model.tensor_parallel_size`` (and CP size, mode) of older recipes and checkpoints go
    to ``parallel``; a value that contradicts ``parallel`` is an error."""
    model = tree.get("model")
    if not isinstance(model, dict):
        return
    parallel = tree.setdefault("parallel", {})
    for key in _MOVED_TO_PARALLEL:
        if key not in model or not isinstance(parallel, dict):
            continue
        value = model.pop(key)
        if parallel.setdefault(key, value) != value:
            raise ValueError(
                f"model.{key} ({value}) differs from parallel.{key} ({parallel[key]}); "
                f"set only parallel.{key}"
            )


__all__ = [
    "FREEZE_POLICIES",
    "OBJECTIVES",
    "PRECISIONS",
    "PROBE_KINDS",
    "RECIPES_DIR",
    "SCHEDULES",
    "Config",
    "ProbesConfig",
    "RunConfig",
    "TrainConfig",
    "apply_override",
    "config_to_dict",
    "from_mapping",
    "load_config",
    "recipe_sections",
    "resolve_recipe",
    "save_config",
    "shipped_recipes",
]
