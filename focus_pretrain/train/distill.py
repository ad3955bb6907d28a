"""Distillation from the frozen original: the retrofit objectives ``distill`` and ``mix``.

A retrofit freezes every original weight (``train.freeze: retrofit`` or ``centroids``), so the
model with its Focus layers bypassed (:func:`~focus_pretrain.model.attention.dense_attention`)
*is* the original dense model: its logits are a free teacher, one forward pass without
gradients. The student is the same model with Focus on, in ``focus.training_mode``'s pattern
(the soft gate, or the hard pattern of sparse training). The loss per token is the forward KL
``KL(p_teacher || p_student)`` of the temperature-``T`` softmaxes, times ``T^2`` (Hinton et
al.'s scaling: the gradient's size does not depend on ``T``):

* ``lm`` (default): the next-token loss through the student, no teacher;
* ``distill``: the KL alone;
* ``mix``: ``(1 - w) * next-token loss + w * KL`` with ``w = train.distill_weight``.

The logits are vocabulary-parallel under tensor parallelism (``[b, s, V / tp]``): the softmax
normalisers and the KL's sum over the vocabulary are all-reduced over the tensor-parallel group
(:class:`_VocabParallelKL`), as Megatron's cross entropy does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _all_reduce(tensor: Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> Tensor:
    """``tensor`` reduced over ``group`` in place (nothing without a group of several ranks)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _log_normalizer(logits: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``logsumexp`` over the last dimension of vocabulary shards ``[..., V / tp]``:
    ``[..., 1]`` fp32 (an fp32 copy of the shard lives only inside this call)."""
    logits = logits.float()
    peak = _all_reduce(logits.max(dim=-1, keepdim=True).values, dist.ReduceOp.MAX, group)
    total = _all_reduce((logits - peak).exp().sum(dim=-1, keepdim=True), dist.ReduceOp.SUM, group)
    return peak + total.log()


class _VocabParallelKL(torch.autograd.Function):
    """``KL(softmax(teacher / T) || softmax(student / T)) * T^2`` per token, over vocabulary
    shards; the gradient reaches the student only: ``T * (p_student - p_teacher)``.

    It keeps the two logit tensors (in their own dtype) and the log-normalisers ``[..., 1]``,
    not fp32 softmaxes: the backward recomputes them (for a 128K vocabulary at 8K tokens, 8 GB
    less than saving two fp32 distributions)."""

    @staticmethod
    def forward(ctx, student: Tensor, teacher: Tensor, temperature: float, group) -> Tensor:
        student_scaled, teacher_scaled = (
            student.float() / temperature,
            teacher.float() / temperature,
        )
        norm_student = _log_normalizer(student_scaled, group)  # [..., 1]
        norm_teacher = _log_normalizer(teacher_scaled, group)
        log_teacher = teacher_scaled - norm_teacher  # [..., V / tp]
        log_ratio = log_teacher - (student_scaled - norm_student)
        partial = (log_teacher.exp() * log_ratio).sum(dim=-1)  # [...]
        kl = _all_reduce(partial, dist.ReduceOp.SUM, group)
        ctx.save_for_backward(student, teacher, norm_student, norm_teacher)
        ctx.temperature = temperature
        return kl * temperature**2

    @staticmethod
    def backward(ctx, grad: Tensor):
        student, teacher, norm_student, norm_teacher = ctx.saved_tensors
        t = ctx.temperature
        p_student = (student.float() / t - norm_student).exp()  # [..., V / tp]
        p_teacher = (teacher.float() / t - norm_teacher).exp()
        # d(T^2 * KL)/d(student) = T^2 * (p_s - p_t) / T
        grad_student = (p_student - p_teacher) * (grad.float().unsqueeze(-1) * t)
        return grad_student.to(student.dtype), None, None, None


def distillation_kl(
    student: Tensor,
    teacher: Tensor,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Per-token ``KL(p_teacher || p_student) * T^2`` of logits ``[..., V]`` (``[..., V / tp]``
    shards of the vocabulary over ``group``, the tensor-parallel group): ``[...]`` fp32.
    The teacher gets no gradient."""
    if student.shape != teacher.shape:
        raise ValueError(
            f"student logits {tuple(student.shape)} and teacher logits "
            f"{tuple(teacher.shape)} must have one shape"
        )
    if not temperature > 0:
        raise ValueError(f"the distillation temperature must be > 0, got {temperature}")
    return _VocabParallelKL.apply(student, teacher.detach(), float(temperature), group)


def per_token_objective(
    logits: Tensor,
    labels: Tensor,
    teacher: Tensor | None,
    *,
    objective: str,
    weight: float,
    temperature: float,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """The objective per token ``[b, s]`` (fp32) from the student's logits ``[b, s, V / tp]``,
    the labels ``[b, s]`` and the teacher's logits (``None`` for ``lm``)."""
    from megatron.core import tensor_parallel

    if objective == "lm":
        # Megatron's vocab-parallel cross entropy takes [s, b, V / tp] and [s, b]; it works in
        # place on its input, here a copy (the logits may feed the KL too)
        return tensor_parallel.vocab_parallel_cross_entropy(
            logits.transpose(0, 1).float().contiguous(), labels.transpose(0, 1).contiguous()
        ).transpose(0, 1)  # [b, s, V / tp] -> [s, b, V / tp] ... [s, b] -> [b, s]
    if teacher is None:
        raise ValueError(f"train.objective={objective} needs the teacher's logits")
    kl = distillation_kl(logits, teacher, temperature, group)  # [b, s]
    if objective == "distill":
        return kl
    lm = per_token_objective(
        logits, labels, None, objective="lm", weight=0.0, temperature=temperature
    )
    return (1.0 - weight) * lm + weight * kl
