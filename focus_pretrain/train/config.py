"""The ``train:`` and ``parallel:`` sections of a recipe."""

from __future__ import annotations

from dataclasses import dataclass, field

from focus_pretrain.focus.config import check_choice, check_int, check_positive
from focus_pretrain.model.config import CP_MODES

PRECISIONS = ("bf16", "fp16", "fp32")
SCHEDULES = ("cosine", "linear", "constant")
FREEZE_POLICIES = ("scratch", "retrofit", "two_phase")


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
            weight frozen and outside the optimizer), ``two_phase`` (routers only for
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

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch_size", "global_batch_size", "log_interval", "keep_last"):
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


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices.

    Attributes:
        tensor_parallel_size: Megatron tensor parallelism (heads and MLP split over ranks).
        zero_stage: DeepSpeed ZeRO stage 0-3 over the data-parallel ranks.
        cpu_offload: ZeRO optimizer-state offload to CPU memory (stages 1-3).
        gpus: devices the recipe is planned for (the ``--dry-run`` memory plan uses it;
            ``None``: one tensor-parallel group). Training uses whatever the launcher starts.
        gpu_memory_gb: memory per device the plan must fit.
        context_parallel_size: ranks that split each sequence (Focus context parallelism);
            the data-parallel size is ``world / (tensor_parallel_size * context_parallel_size)``.
        cp_mode: ``"a2a"`` (all-to-all, heads split over the CP ranks) or ``"ring"`` (K/V
            blocks passed around the ranks).
    """

    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    cp_mode: str = "a2a"
    zero_stage: int = 1
    cpu_offload: bool = False
    gpus: int | None = None
    gpu_memory_gb: float = 80.0

    def __post_init__(self) -> None:
        check_int("parallel.tensor_parallel_size", self.tensor_parallel_size, low=1)
        check_int("parallel.zero_stage", self.zero_stage, low=0, high=3)
        check_int("parallel.context_parallel_size", self.context_parallel_size, low=1)
        check_choice("parallel.cp_mode", self.cp_mode, CP_MODES)
        if self.gpus is not None:
            check_int("parallel.gpus", self.gpus, low=1)
        check_positive("parallel.gpu_memory_gb", self.gpu_memory_gb)
        if self.cpu_offload and self.zero_stage == 0:
            raise ValueError("parallel.cpu_offload needs parallel.zero_stage >= 1")
        model_parallel = self.tensor_parallel_size * self.context_parallel_size
        if self.gpus is not None and self.gpus % model_parallel:
            raise ValueError(
                f"parallel.gpus ({self.gpus}) must be a multiple of "
                f"parallel.tensor_parallel_size x context_parallel_size ({model_parallel})"
            )
