"""The ``triton`` backend: soft-gated training attention as one fused kernel per pass.

FlexAttention's soft gate (:func:`focus_pretrain.focus.flex.soft`) reads the ``2K`` assignment
tables in its ``score_mod`` and, in the backward pass, accumulates their gradient with atomic
adds per score: on an H100 that made a 1B Focus training step 4x its dense twin's
(docs/benchmarks.md). Here the gate is part of the tile computation
(:mod:`~focus_pretrain.focus.soft_triton_kernels`): the affinities ``G_q G_k^T`` and the
assignment gradients ``dA G_k``, ``dA^T G_q`` are small matrix products in the tile, with no
atomics. The function is exactly the reference's: causal attention, the soft gate
(:func:`~focus_pretrain.focus.pattern.soft_gate`) on pairs beyond the window whose key is not a
sink, optional soft-capping before the gate, packed documents (no pair across documents; the sinks
are each document's first ``S`` tokens). Sliding-window layers (``local_only``: no router; the
dense twin is one with an unlimited window) run through the same kernels without the gate, so a
model configured with ``focus.backend: triton`` runs every layer on them.

Runs on CUDA (fp16/bf16; fp32 at head dim <= 64, or at any head dim with TF32 allowed:
:func:`fp32_products`, :func:`cuda_refusal`) wherever Triton is installed, and on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported: the CPU tests
do this), where it is exact and slow. ``auto`` picks it for soft training on a GPU whose tile
table (:mod:`~focus_pretrain.focus.triton_tiles`) measured it fastest; elsewhere it is selected
with ``backend="triton"`` (model config ``focus.backend: triton``). The kernels' tiles come
from that table (``tools/tune_triton.py`` measures a GPU; docs/benchmarks.md).
Layout: ``[batch, seq, heads, head_dim]``.

The launches are operators (``torch.ops.focus_pretrain.soft_attention_forward`` and
``soft_attention_backward``, :func:`torch.library.custom_op`) with fake (meta) implementations
and the backward registered as the forward's autograd formula: eager calls, autograd and
``torch.compile(fullgraph=True)`` (which traces through them as opaque nodes) run the same code.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

from focus_pretrain.focus.backends import AttentionPattern
from focus_pretrain.focus.pattern_settings import FocusPattern
from focus_pretrain.focus.soft_triton_launch import (
    BackwardState,
    Launch,
    _next_pow2,
    _strided,
    fp32_products,
    launch_backward_kv,
    launch_backward_q,
    launch_forward,
)
from focus_pretrain.focus.triton_tiles import DEFAULTS, size_class

HEAD_DIMS = (16, 32, 64, 128, 256)  # tl.arange needs a power of two (and tl.dot >= 16)


# looked up once (without importing Triton); a constant, so that dynamo traces the check
_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    """Whether the ``triton`` package is importable."""
    return _TRITON_FOUND


def interpreter_on() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def runs_on(device: str, dtype: torch.dtype) -> bool:
    """Whether the kernels can run here: CUDA with Triton (fp16/bf16/fp32), or CPU tensors under
    Triton's interpreter (fp32/fp16: NumPy has no bfloat16)."""
    if not triton_installed():
        return False
    if device == "cuda":
        return torch.cuda.is_available() and dtype in (torch.float16, torch.bfloat16, torch.float32)
    return device == "cpu" and interpreter_on() and dtype in (torch.float32, torch.float16)


def supports(head_dim: int) -> bool:
    """Head dims the kernels take: powers of two, 16-256 (:data:`HEAD_DIMS`)."""
    return head_dim in HEAD_DIMS


def cuda_refusal(dtype: torch.dtype, head_dim: int, packed: bool = False) -> str | None:
    """Why the kernels are not launched on CUDA for ``dtype`` at ``head_dim`` (``None``: they
    are): fp32 with 3xTF32 products at head dims above 64, or fp32 at head dim 256 on the
    group-sorted layout (``packed``: sparse training), would spill registers."""
    if packed and dtype == torch.float32 and size_class(head_dim) > 128:
        return (
            f"fp32 at head_dim {head_dim} on the group-sorted layout (hard top-1): its dQ kernel "
            "spills registers at every tile (docs/benchmarks.md); train in bf16/fp16 or use "
            "backend 'flex'"
        )
    if (
        dtype != torch.float32
        or fp32_products() != "tf32x3"
        or ("fp32", size_class(head_dim)) in DEFAULTS
    ):
        return None
    return (
        f"fp32 at head_dim {head_dim} with PyTorch's default fp32 matmul precision: the 3xTF32 "
        "backward kernels spill registers above head_dim 64 (docs/benchmarks.md); train in "
        "bf16/fp16, allow TF32 (torch.backends.cuda.matmul.fp32_precision = 'tf32'), or use "
        "backend 'flex'"
    )


def _check_launch(q: Tensor, k: Tensor, probs_q: Tensor | None) -> None:
    """Raise ``ValueError`` before any work when the kernels' grid or 32-bit offsets cannot
    hold the call (shapes only: checked eagerly and while tracing)."""
    b, lq, h = q.shape[:3]
    lk = k.shape[1]
    ka = max(16, _next_pow2(0 if probs_q is None else 3 * probs_q.shape[-1]))
    if b * h > 65535:  # the grid's second axis
        raise ValueError(
            f"the triton backend launches batch x heads = {b * h} programs on a grid axis "
            "limited to 65535; split the batch or use backend='flex'"
        )
    if max(q.numel(), k.numel(), b * h * max(lq, lk) * ka) >= 2**31:
        raise ValueError(
            f"the triton backend indexes with 32-bit offsets; q {tuple(q.shape)} is too large: "
            "shard the sequence (context parallelism) or use backend='flex'"
        )


@torch.library.custom_op("focus_pretrain::soft_attention_forward", mutates_args=())
def soft_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs_q: Tensor | None,
    probs_k: Tensor | None,
    doc_q: Tensor | None,
    doc_k: Tensor | None,
    pos_q: Tensor | None,
    pos_k: Tensor | None,
    window: int,
    gate_lambda: float,
    softcap: float | None,
    scale: float,
    sinks: int,
    packed: bool,
) -> tuple[Tensor, Tensor]:
    """The forward kernel as an operator: ``(out [b, Lq, H, D] (q's strides when read in
    place), lse [b, H, Lq] fp32)``. Arguments as :func:`attend`'s; ``probs_q=None``: a
    sliding-window layer. Differentiable (:func:`_setup_context`, :func:`_backward`)."""
    run = Launch.build(
        q, k, v, probs_q, probs_k, doc_q, doc_k, pos_q, pos_k,
        (window, gate_lambda, softcap, scale, sinks, packed),
    )  # fmt: skip
    return launch_forward(run, run.tiles()["fwd"])


@soft_attention_forward.register_fake
def _forward_fake(q, k, v, probs_q, probs_k, doc_q, doc_k, pos_q, pos_k, *options):
    """Shapes, dtypes and strides of :func:`soft_attention_forward`'s outputs."""
    b, lq, h = q.shape[:3]
    return torch.empty_like(_strided(q)), q.new_empty(b, h, lq, dtype=torch.float32)


@torch.library.custom_op("focus_pretrain::soft_attention_backward", mutates_args=())
def soft_attention_backward(
    d_out: Tensor,
    d_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs_q: Tensor | None,
    probs_k: Tensor | None,
    doc_q: Tensor | None,
    doc_k: Tensor | None,
    pos_q: Tensor | None,
    pos_k: Tensor | None,
    out: Tensor,
    lse: Tensor,
    window: int,
    gate_lambda: float,
    softcap: float | None,
    scale: float,
    sinks: int,
    packed: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The two backward kernels as an operator: ``(dq, dk, dv, d_probs_q, d_probs_k)`` from
    the gradients of ``out [b, Lq, H, D]`` and ``lse [b, H, Lq]`` (``None``: unused), the
    forward's inputs and its outputs. ``dq`` has q's strides (read in place), ``dk, dv`` are
    dense; the assignment gradients (summed over heads) are ``[b, Lq|Lk, K]`` in the
    assignments' dtypes, or empty ``[0]`` for a sliding-window layer."""
    run = Launch.build(
        q, k, v, probs_q, probs_k, doc_q, doc_k, pos_q, pos_k,
        (window, gate_lambda, softcap, scale, sinks, packed), backward=True,
    )  # fmt: skip
    tiles = run.tiles()
    atomic = "kva" in tiles and not torch.are_deterministic_algorithms_enabled()
    grads = BackwardState.build(run, d_out, d_lse, out, lse, atomic)
    if atomic:  # one pass: dQ added atomically (the tile table says it is faster here)
        launch_backward_kv(run, grads, tiles["kva"])
    else:
        launch_backward_kv(run, grads, tiles["kv"])
        launch_backward_q(run, grads, tiles["q"])
    q, settings = run.q, run.settings
    dq, dk, dv, dg_q, dg_k = grads.dq, grads.dk, grads.dv, grads.dg_q, grads.dg_k
    if settings.local:
        return dq, dk, dv, _no_grad(q), _no_grad(q)
    groups = settings.num_groups
    d_pq = dg_q.sum(dim=1)[..., :groups].to(probs_q.dtype).contiguous()  # [b, Lq, K]
    d_pk = dg_k.sum(dim=1)[..., :groups].to(probs_k.dtype).contiguous()  # [b, Lk, K]
    return dq, dk, dv, d_pq, d_pk


def _no_grad(q: Tensor) -> Tensor:
    """The empty ``[0]`` fp32 placeholder for an assignment gradient a layer does not have."""
    return q.new_empty(0, dtype=torch.float32)


@soft_attention_backward.register_fake
def _backward_fake(d_out, d_lse, q, k, v, probs_q, probs_k, *rest):
    """Shapes, dtypes and strides of :func:`soft_attention_backward`'s outputs."""
    dq = torch.empty_like(_strided(q))
    dk, dv = (t.new_empty(t.shape) for t in (k, v))  # dense
    d_pq, d_pk = (_no_grad(q) if p is None else p.new_empty(p.shape) for p in (probs_q, probs_k))
    return dq, dk, dv, d_pq, d_pk


_TENSORS = 9  # q, k, v, probs_q, probs_k, doc_q, doc_k, pos_q, pos_k; then the options


def _setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    """Saves what :func:`_backward` hands the backward operator: the forward's tensors, its
    outputs and its options (window, gate lambda, softcap, scale, sinks, packed)."""
    ctx.save_for_backward(*inputs[:_TENSORS], *output)
    ctx.options = tuple(inputs[_TENSORS:])


def _backward(ctx, d_out: Tensor, d_lse: Tensor | None) -> tuple:
    """Gradients of :func:`soft_attention_forward`'s inputs through the backward operator:
    ``q``, ``k``, ``v`` and the assignments (``None`` for a sliding-window layer's absent
    ones); documents, positions and options get none."""
    saved = ctx.saved_tensors
    dq, dk, dv, d_pq, d_pk = torch.ops.focus_pretrain.soft_attention_backward(
        d_out, d_lse, *saved, *ctx.options
    )
    probs_q, probs_k = saved[3], saved[4]
    d_pq, d_pk = (None if p is None else g for p, g in ((probs_q, d_pq), (probs_k, d_pk)))
    return (dq, dk, dv, d_pq, d_pk) + (None,) * (_TENSORS - 5 + len(ctx.options))


soft_attention_forward.register_autograd(_backward, setup_context=_setup_context)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs_q: Tensor | None,
    probs_k: Tensor | None,
    pattern: FocusPattern,
    *,
    doc_q: Tensor | None = None,
    doc_k: Tensor | None = None,
    pos_q: Tensor | None = None,
    pos_k: Tensor | None = None,
    packed: bool = False,
) -> tuple[Tensor, Tensor]:
    """Queries against keys through the fused kernels: soft-gated, or a sliding window when
    ``probs_q`` is ``None``; differentiable in ``q``, ``k``, ``v``, the assignments and
    through the returned ``lse``.

    Args:
        q: ``[b, Lq, H, D]``; k, v: ``[b, Lk, Hkv, D]`` (one dtype, ``D`` in :data:`HEAD_DIMS`).
        probs_q, probs_k: ``[b, Lq|Lk, K]`` soft assignments (the same tensor for
            self-attention), or ``None`` for a sliding-window layer.
        pattern: the window, the gate, soft-capping, the sinks and the scale (``None``:
            ``1 / sqrt(D)``); its mode is the caller's: the assignments given or not say soft or
            sliding window.
        doc_q, doc_k: ``[b, Lq|Lk]`` int64 document starts (global positions), or ``None``.
        pos_q, pos_k: ``[Lq]``/``[b, Lq]`` and ``[Lk]``/``[b, Lk]`` increasing global
            positions (a ring step's blocks), or ``None``: one sequence, positions ``0..L-1``
            (then ``Lq = Lk`` and the loops skip the blocks no query may see).
        packed: one packed sequence (``Lq = Lk``, the same tokens) whose ``doc_q``/``doc_k``
            are its document starts as indices: the positions serve the pair rule only and the
            loops skip blocks as on one sequence (the group-sorted layout, :func:`hard_top1`).

    Returns:
        ``(out [b, Lq, H, D] in q.dtype, lse [b, Lq, H] fp32)``; a query with no allowed key
        gets ``out = 0`` and ``lse = -inf``.
    """
    _check_launch(q, k, probs_q)
    softcap = None if pattern.softcap is None else float(pattern.softcap)
    scale = pattern.scale_for(q.shape[-1])
    out, lse = torch.ops.focus_pretrain.soft_attention_forward(
        q, k, v, probs_q, probs_k, doc_q, doc_k, pos_q, pos_k, int(pattern.window),
        float(pattern.gate_lambda), softcap, scale, int(pattern.sinks),
        bool(packed),
    )  # fmt: skip
    return out, lse.transpose(1, 2)  # [b, H, Lq] -> [b, Lq, H]


def soft_gated_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor | None,
    *,
    window: int,
    gate_lambda: float,
    scale: float,
    softcap: float | None = None,
    sinks: int = 0,
    documents: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Soft-gated causal Focus attention through the fused Triton kernels.

    Args:
        q: ``[b, n, H, D]``; k, v: ``[b, n, Hkv, D]`` (one dtype, ``D`` in :data:`HEAD_DIMS`).
        probs: ``[b, n, K]`` soft assignments (differentiable), or ``None`` for a
            sliding-window layer (keys at most ``window`` back, plus the sinks; no gate).
        documents: ``[b, n]`` int64 document starts, or ``None``.

    Returns:
        ``(out [b, n, H, D] in q.dtype, lse [b, n, H] fp32)``; ``out`` is differentiable in
        ``q``, ``k``, ``v`` and ``probs``.
    """
    pattern = FocusPattern(
        window=window, gate_lambda=gate_lambda, scale=scale, softcap=softcap, sinks=sinks
    )
    return attend(q, k, v, probs, probs, pattern, doc_q=documents, doc_k=documents)


def triton_focus_attention(
    q: Tensor, k: Tensor, v: Tensor, pattern: AttentionPattern
) -> tuple[Tensor, Tensor]:
    """Backend entry (:class:`~focus_pretrain.focus.backends.Backend`): the soft pattern and
    sliding-window layers; not the hard one."""
    if not pattern.local_only and (pattern.mode != "soft" or pattern.probs is None):
        raise ValueError("the triton backend computes the soft pattern, not the hard one")
    probs = None if pattern.local_only else pattern.probs
    docs = pattern.documents
    return attend(q, k, v, probs, probs, pattern, doc_q=docs, doc_k=docs)
