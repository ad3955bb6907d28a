"""The ``parallel:`` section of a recipe: the one place tensor, sequence and context
parallelism are set.

The model section describes the architecture only; :meth:`ParallelConfig.check_model` holds the
checks that need both (heads split over tensor-parallel ranks, all-to-all heads over
context-parallel ranks, backends that can run inside the ring),
:meth:`ParallelConfig.check_seq_length` those that need a sequence length. The model itself
reads its tensor- and context-parallel sizes from Megatron's initialised ``parallel_state`` (set
by :meth:`focus_pretrain.parallel.launch.ParallelLayout.initialize`); the trainer passes
``sequence_parallel`` to :func:`focus_pretrain.model.build_model`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from focus_pretrain.focus.backends import ring_backend_names
from focus_pretrain.model.config import ModelConfig
from focus_pretrain.parallel.deepspeed_overrides import check_deepspeed_overrides
from focus_pretrain.validation import check_choice, check_int, check_positive

CP_MODES = ("a2a", "ring")  # context parallelism: all-to-all (Ulysses) or ring


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices.

    Attributes:
        tensor_parallel_size: Megatron tensor parallelism (heads and MLP split over ranks).
        context_parallel_size: ranks that split each sequence (Focus context parallelism);
            the data-parallel size is ``world / (tensor_parallel_size * context_parallel_size)``.
        cp_mode: ``"a2a"`` (all-to-all, heads split over the CP ranks) or ``"ring"`` (K/V
            blocks passed around the ranks).
        sequence_parallel: Megatron sequence parallelism (Korthikanti et al. 2022; needs
            ``tensor_parallel_size > 1``): between the tensor-parallel regions (norms, dropout,
            residual adds, the layer inputs full recompute keeps, the routers' projection)
            every tensor-parallel rank holds ``1 / tensor_parallel_size`` of the tokens,
            ``[s / tp, b, h]``, instead of all of them. The tensor-parallel all-reduces become
            all-gather + reduce-scatter pairs (the same volume); each router all-gathers its
            ``d_g``-wide projection. Sequence lengths must divide by ``tensor_parallel_size x
            context_parallel_size``; combines with context parallelism. Norm weights, the
            routers' projections and row-parallel biases see only their rank's tokens: their
            gradients are summed over the tensor-parallel group by hooks
            (:mod:`focus_pretrain.parallel.sequence_parallel`), which DeepSpeed would not do.
        zero_stage: DeepSpeed ZeRO stage 0-3 over the data-parallel ranks.
        cpu_offload: ZeRO optimizer-state offload to CPU memory (stages 1-3).
        gpus: devices the recipe is planned for (the ``--dry-run`` memory plan uses it;
            ``None``: one tensor x context-parallel group). Training uses whatever the launcher
            starts.
        gpu_memory_gb: memory per device the plan must fit.
        timeout_minutes: how long a collective may wait for the other ranks before the job
            fails (the process-group timeout; raise it when a rank can be slow, e.g. rank 0
            preparing data or writing a large checkpoint).
        deepspeed: DeepSpeed config entries merged over the generated one (monitors such as
            ``csv_monitor`` or ``wandb``, ``flops_profiler``, ``comms_logger``, ZeRO bucket
            sizes ...); keys the recipe owns (batch sizes, ZeRO stage, precision, clipping,
            optimizer, scheduler) are refused, naming the recipe key
            (:mod:`focus_pretrain.parallel.deepspeed_overrides`).
    """

    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    cp_mode: str = "a2a"
    sequence_parallel: bool = False
    zero_stage: int = 1
    cpu_offload: bool = False
    gpus: int | None = None
    gpu_memory_gb: float = 80.0
    timeout_minutes: float = 30.0
    deepspeed: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_int("parallel.tensor_parallel_size", self.tensor_parallel_size, low=1)
        check_int("parallel.zero_stage", self.zero_stage, low=0, high=3)
        check_int("parallel.context_parallel_size", self.context_parallel_size, low=1)
        check_choice("parallel.cp_mode", self.cp_mode, CP_MODES)
        if self.gpus is not None:
            check_int("parallel.gpus", self.gpus, low=1)
        check_positive("parallel.gpu_memory_gb", self.gpu_memory_gb)
        check_positive("parallel.timeout_minutes", self.timeout_minutes)
        check_deepspeed_overrides(self.deepspeed)
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError(
                "parallel.sequence_parallel needs parallel.tensor_parallel_size > 1 (it splits "
                "each sequence over the tensor-parallel ranks); set "
                "parallel.sequence_parallel=false or raise parallel.tensor_parallel_size"
            )
        if self.cpu_offload and self.zero_stage == 0:
            raise ValueError("parallel.cpu_offload needs parallel.zero_stage >= 1")
        if self.gpus is not None and self.gpus % self.model_parallel_size:
            raise ValueError(
                f"parallel.gpus ({self.gpus}) must be a multiple of "
                "parallel.tensor_parallel_size x context_parallel_size "
                f"({self.model_parallel_size})"
            )

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the model between them (tensor x context parallel)."""
        return self.tensor_parallel_size * self.context_parallel_size

    def check_model(self, model: ModelConfig) -> None:
        """Raise ``ValueError`` unless ``model`` can be split the way this section says."""
        model.check_tensor_parallel(self.tensor_parallel_size)
        cp = self.context_parallel_size
        check_cp_heads(model.num_attention_heads, self.tensor_parallel_size, cp, self.cp_mode)
        if cp > 1 and self.cp_mode == "ring":
            if model.focus.key_groups != "own" and model.focus.enabled:
                raise ValueError(
                    f"model.focus.key_groups {model.focus.key_groups!r} does not run inside "
                    "the ring (a shard's first key needs the previous rank's last token); "
                    "use parallel.cp_mode 'a2a' or model.focus.key_groups 'own'"
                )
            for key in ("backend", "inference_backend"):
                chosen = getattr(model.focus, key)
                if chosen not in ring_backend_names():
                    raise ValueError(
                        f"model.focus.{key} {chosen!r} cannot run inside the ring (each ring "
                        "step runs the exact per-block attention); use one of "
                        f"{ring_backend_names()} or parallel.cp_mode 'a2a'"
                    )
            self._check_ring_triton(model)

    @staticmethod
    def _check_ring_triton(model: ModelConfig) -> None:
        """The ring's ``triton`` step computes the soft gate and sliding windows, not the hard
        pattern: a ``triton`` backend whose pattern is hard (sparse training, hard inference)
        is refused under the ring before training."""
        focus = model.focus
        patterns = {"backend": focus.training_pattern, "inference_backend": focus.inference_mode}
        for key, pattern in patterns.items():
            if getattr(focus, key) == "triton" and pattern in ("hard", "hard_gated"):
                raise ValueError(
                    f"model.focus.{key} 'triton' runs the {pattern!r} pattern on the "
                    "group-sorted layout, which the ring's triton step does not (it runs the "
                    f"soft gate and sliding windows); use model.focus.{key} 'auto' (flex on "
                    "CUDA) or 'reference', or parallel.cp_mode 'a2a'"
                )

    def check_seq_length(self, seq_len: int, name: str = "data.seq_length") -> None:
        """Raise ``ValueError`` unless sequences of ``seq_len`` tokens split over the ranks:
        two equal chunks per context-parallel rank, and with sequence parallelism an equal
        slice of each rank's shard per tensor-parallel rank."""
        cp, tp = self.context_parallel_size, self.tensor_parallel_size
        check_cp_seq_length(seq_len, cp, name)
        if self.sequence_parallel and seq_len % (tp * cp):
            raise ValueError(
                f"{name} ({seq_len}) must be divisible by parallel.tensor_parallel_size x "
                f"context_parallel_size ({tp} x {cp} = {tp * cp}) with "
                "parallel.sequence_parallel: each tensor-parallel rank holds an equal slice of "
                "its sequence shard; change the length or set parallel.sequence_parallel=false"
            )


def check_cp_heads(heads: int, tp: int, cp: int, cp_mode: str) -> None:
    """All-to-all context parallelism splits each tensor-parallel rank's heads over CP ranks."""
    check_choice("parallel.cp_mode", cp_mode, CP_MODES)
    if cp > 1 and cp_mode == "a2a" and (heads // tp) % cp:
        raise ValueError(
            f"parallel.cp_mode 'a2a' splits each tensor-parallel rank's heads "
            f"({heads} / {tp} = {heads // tp}) over parallel.context_parallel_size ({cp}), "
            "which must divide them; use cp_mode 'ring' or another size"
        )


def check_cp_seq_length(seq_len: int, cp: int, name: str = "data.seq_length") -> None:
    """Each context-parallel rank holds two equal chunks of every sequence (any length
    without context parallelism: nothing is split)."""
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(
            f"{name} ({seq_len}) must be divisible by 2 x "
            f"parallel.context_parallel_size (2 x {cp} = {2 * cp}): each context-parallel "
            "rank holds two equal chunks of every sequence"
        )
