"""``focus_attention``: the one attention API; backends plug in behind it.

Layout ``[batch, seq, heads, head_dim]`` for queries and ``[batch, seq, heads_kv, head_dim]`` for
keys and values (GQA when ``heads_kv < heads``). Causal self-attention with the Focus pattern
(:mod:`focus_pretrain.focus.pattern`):

* ``mode="soft"`` (training): every causal pair, with the soft gate on pairs beyond the window;
  differentiable in ``q``, ``k``, ``v`` and the routing's soft assignments.
* ``mode="hard"`` (inference): the window plus pairs whose ``top_k`` groups intersect.
* ``mode="hard_gated"`` (sparse training): the hard pattern's pairs only, with the soft gate
  on those beyond the window; differentiable in ``q``, ``k``, ``v`` and the soft assignments
  (through the gate; the top-k choice is not differentiated).
* ``local_only=True``: a sliding-window layer (interleaved local/global models); no routing.
* ``sinks=S``: attention sinks, the first ``S`` positions visible to every query in any of
  these (no gate on them in soft mode); every backend computes them exactly.
* ``documents``: packed documents, ``[b, s]`` per-token document ids; no pair crosses a
  document boundary and the sinks are each document's first ``S`` tokens, so every document
  gets exactly the attention it would get alone.

Every backend computes exactly the same function; ``backend="auto"`` picks the fastest exact
one for the request (:func:`select_backend`). Backends:

* ``reference`` (:mod:`~focus_pretrain.focus.reference`): exact, differentiable, any device;
  the yardstick.
* ``decomposed`` (:mod:`~focus_pretrain.focus.decomposed`): hard top-1 and sliding-window
  inference as group sort + one varlen causal call + cross-group band + log-sum-exp merge.
* ``flex`` (:mod:`~focus_pretrain.focus.flex`): FlexAttention, hard any ``top_k`` (block-sparse on
  the group-sorted layout), soft gate as ``score_mod`` (training), sliding window.
* ``segments`` (:mod:`~focus_pretrain.focus.segments`): hard and hard_gated top-1 on the
  group-sorted layout in differentiable PyTorch, forward and backward (CPU sparse training).
* ``triton`` (:mod:`~focus_pretrain.focus.soft_triton`): the soft gate (training) and
  sliding-window layers as fused Triton kernels, forward and backward, with no atomics, and
  hard / hard_gated top-1 (sparse training) through the same kernels on the group-sorted layout
  (:mod:`~focus_pretrain.focus.sorted_triton`); CUDA, or CPU under Triton's interpreter.
  ``auto`` trains the soft gate on it on a GPU whose measured tile table says it is the
  fastest there (:func:`~focus_pretrain.focus.triton_tiles.fastest_training_backend`; H200:
  2.5x dense's time at 8K, ``flex`` 99x, docs/benchmarks.md); otherwise by name only.

``auto`` on CUDA: ``decomposed`` for hard top-1 fp16/bf16 when a FlashAttention varlen kernel
is there (flash-attn, or PyTorch's ``varlen_attn`` without soft-capping; measured faster than
``flex`` on an H100, docs/benchmarks.md), else ``flex``. On CPU:
``decomposed`` for hard top-1 from :data:`CPU_DECOMPOSED_MIN_SEQ` tokens, else ``reference``
(CPU FlexAttention is eager and forward-only: exact, selectable, never automatic).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from focus_pretrain.focus.backends import (
    AttentionPattern,
    AttentionRequest,
    Backend,
    Capabilities,
    available_backends,
    differentiated,
    register_backend,
    select_backend,
)
from focus_pretrain.focus.builtin_backends import CPU_DECOMPOSED_MIN_SEQ
from focus_pretrain.focus.gate_forms import attend_with_dot_gate
from focus_pretrain.focus.pattern import (
    compute_dtype,
    document_starts,
    key_assignments,
    key_side_memberships,
)
from focus_pretrain.focus.pattern_settings import FocusPattern, with_settings
from focus_pretrain.focus.router import Routing
from focus_pretrain.validation import check_int

__all__ = [
    "CPU_DECOMPOSED_MIN_SEQ",
    "AttentionPattern",
    "AttentionRequest",
    "Backend",
    "Capabilities",
    "FocusPattern",
    "available_backends",
    "focus_attention",
    "register_backend",
    "select_backend",
]


def focus_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    routing: Routing | Tensor | None = None,
    pattern: FocusPattern | None = None,
    *,
    backend: str = "auto",
    return_lse: bool = False,
    check_finite: bool = True,
    documents: Tensor | None = None,
    **settings: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal Focus attention.

    Args:
        q: ``[batch, seq, heads, head_dim]``.
        k, v: ``[batch, seq, heads_kv, head_dim]`` with ``heads % heads_kv == 0``.
        routing: the layer's :class:`Routing` (or its soft assignments ``[batch, seq, K]``);
            may be ``None`` only with ``local_only=True``.
        pattern: the pattern to compute, a :class:`~focus_pretrain.focus.pattern_settings.
            FocusPattern` (default: its defaults).
        settings: any of :class:`FocusPattern`'s settings by name, in place of ``pattern``'s
            own: ``window`` (local window ``w >= 0``: keys with ``0 <= i - j <= w`` are always
            attended; default 128), ``mode`` (``"soft"``: training, soft gate; ``"hard"``:
            inference, top-k groups; ``"hard_gated"``: sparse training, the hard pattern gated
            beyond the window), ``top_k`` (groups per token in the hard modes, ``1 <= top_k <=
            K``), ``gate_lambda`` (the soft gate's sharpness), ``gate_form`` (``"sigmoid"``, the
            paper's gate beyond the window, or ``"dot"``: ``gate_lambda * g_i . g_j`` on every
            allowed pair, as extra head-dim channels, :mod:`~focus_pretrain.focus.gate_forms`),
            ``sinks`` (``S >= 0``: keys at positions ``< S`` are attended by every later query,
            with no gate in soft mode, also in ``local_only`` layers), ``softcap`` (Gemma-2
            logit soft-capping ``c``, :func:`~focus_pretrain.focus.pattern.soft_cap`, before the
            pattern), ``scale`` (default ``1 / sqrt(head_dim)``), ``local_only`` (a
            sliding-window-only layer).
        backend: ``"auto"`` or one of :func:`available_backends`.
        return_lse: also return the per-query log-sum-exp ``[batch, seq, heads]`` (fp32).
        check_finite: raise ``ValueError`` on NaN/inf inputs (a device sync on GPU).
        documents: ``[batch, seq]`` integer document ids of packed sequences: a token whose id
            differs from the previous token's starts a new document. Queries attend only keys
            of their own document, and the sinks are the first ``S`` tokens of each document.
            Start positions (:func:`~focus_pretrain.focus.pattern.document_starts`) are valid
            ids. ``None``: one document per sequence.

    Returns:
        ``out`` ``[batch, seq, heads, head_dim]`` in ``q.dtype`` (and ``lse`` if asked).

    Raises:
        TypeError: a keyword that is neither an argument nor a setting.
        ValueError: before any backend runs, on a bad shape or setting, on mixed dtypes
            (:func:`check_dtypes`: one dtype for ``q``, ``k``, ``v``; routing probabilities
            at most as precise as their compute dtype, e.g. fp32 with bf16) and, with
            ``check_finite``, on NaN/inf inputs; and when the named ``backend`` cannot run the
            call (the reason is named; nothing is substituted).
    """
    pattern = with_settings(pattern, settings, caller="focus_attention")
    probs = routing.probs if isinstance(routing, Routing) else routing
    _validate(q, k, v, probs, pattern, check_finite=check_finite)
    if pattern.gate_form == "dot" and not pattern.local_only:
        return attend_with_dot_gate(
            focus_attention, q, k, v, probs, pattern, return_lse=return_lse, backend=backend,
            check_finite=False, documents=documents,
        )  # fmt: skip
    if documents is not None:
        check_documents(documents, q)
        documents = document_starts(documents)  # [b, s] int64
    member = None
    routing_groups = 0 if probs is None else probs.shape[-1]
    if pattern.local_only:
        probs = None
    elif pattern.mode == "hard":
        member = Routing(probs).membership(pattern.top_k)  # [b, s] int64
        probs = None
    elif pattern.mode == "hard_gated":  # the choice: not differentiated
        member = Routing(probs).membership(pattern.top_k)  # [b, s] int64
    scale = pattern.scale_for(q.shape[-1])
    call = AttentionPattern.of(
        replace(pattern, scale=scale), probs=probs, member=member, documents=documents,
        groups=0 if pattern.local_only else routing_groups, **_key_side(pattern, probs, member,
        documents),
    )  # fmt: skip
    chosen = select_backend(backend, _request(q, k, v, call, return_lse))
    out, lse = chosen.fn(q, k, v, call)
    return (out, lse) if return_lse else out


def _key_side(
    pattern: FocusPattern, probs: Tensor | None, member: Tensor | None, documents: Tensor | None
) -> dict[str, Tensor | None]:
    """The keys' own ``key_probs`` and ``key_member`` when ``key_groups`` makes them differ
    from the queries' (:mod:`focus_pretrain.focus.pattern`, "Key groups"); else none."""
    if pattern.key_groups == "own" or pattern.local_only:
        return {}
    return {
        "key_probs": None if probs is None else key_assignments(probs, documents),
        "key_member": None
        if member is None
        else key_side_memberships(member, pattern.key_groups, documents),
    }


def _request(
    q: Tensor, k: Tensor, v: Tensor, pattern: AttentionPattern, return_lse: bool
) -> AttentionRequest:
    """What the call asks of a backend (shapes ``[b, s, H|Hkv, D]``, device, dtype, pattern)."""
    return AttentionRequest.of(
        q, k, pattern, needs_grad=differentiated(q, k, v, pattern.probs),
        documents=pattern.documents is not None, needs_lse=return_lse,
    )  # fmt: skip


def _validate(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor | None,
    pattern: FocusPattern,
    *,
    check_finite: bool,
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be a 4-D tensor [batch, seq, heads, head_dim], got {shape}"
            )
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    (b, s, h, d), (bk, sk, hkv, dk) = q.shape, k.shape
    for what, got, want in (("batch", bk, b), ("seq", sk, s), ("head_dim", dk, d)):
        if got != want:
            raise ValueError(f"k/v {what} must equal q's {what} ({want}), got {got}")
    if hkv < 1 or h % hkv != 0:
        raise ValueError(f"heads ({h}) must be divisible by heads_kv ({hkv})")
    pattern.check()
    local_only = pattern.local_only
    if probs is None:
        if not local_only:
            raise ValueError("routing is required unless local_only=True (a sliding-window layer)")
    elif not local_only:
        if not isinstance(probs, Tensor) or probs.dim() != 3 or probs.shape[:2] != (b, s):
            shape = tuple(probs.shape) if isinstance(probs, Tensor) else type(probs).__name__
            raise ValueError(f"routing.probs must be [batch={b}, seq={s}, K], got {shape}")
        if probs.device != q.device:
            raise ValueError(f"routing.probs must be on {q.device}, got {probs.device}")
        check_int(
            "top_k", pattern.top_k, low=1, high=probs.shape[-1], high_name="K (number of groups)"
        )
    check_dtypes(q, k, v, None if local_only else probs)
    if check_finite:
        raise_if_not_finite(q=q, k=k, v=v, **{"routing.probs": None if local_only else probs})


def check_documents(
    documents: Tensor, q: Tensor, *, seq: str = "seq", what: str = "per-token document ids"
) -> None:
    """Raise ``ValueError`` unless ``documents`` is an integer ``[b, s]`` tensor on ``q``'s
    device (``q [b, s, ...]``); ``seq`` and ``what`` name the length and the content in the
    message (the context-parallel shards pass ``seq_local`` and document starts)."""
    b, s = q.shape[:2]
    if not isinstance(documents, Tensor) or tuple(documents.shape) != (b, s):
        shape = tuple(documents.shape) if isinstance(documents, Tensor) else type(documents)
        raise ValueError(f"documents must be [batch={b}, {seq}={s}] {what}, got {shape}")
    if documents.is_floating_point() or documents.is_complex() or documents.dtype == torch.bool:
        raise ValueError(f"documents must be an integer tensor, got {documents.dtype}")
    if documents.device != q.device:
        raise ValueError(f"documents must be on {q.device}, got {documents.device}")


def check_dtypes(q: Tensor, k: Tensor, v: Tensor, probs: Tensor | None) -> None:
    """Raise ``ValueError`` unless ``q``, ``k``, ``v`` share one dtype and ``probs`` (the
    routing's soft assignments; ``None`` skipped) is floating point and no more precise than the
    dtype the Focus maths runs in for ``q`` (:func:`~focus_pretrain.focus.pattern.compute_dtype`:
    fp32 for fp16/bf16/fp32, fp64 for fp64). So fp32 routing with bf16 q/k/v (what the model
    passes under bf16) is fine, fp64 routing with fp32 q/k/v is not."""
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(
            f"q, k, v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; cast them "
            "to one (e.g. k.to(q.dtype), v.to(q.dtype))"
        )
    if probs is None:
        return
    if not probs.is_floating_point():
        raise ValueError(
            f"routing.probs must be floating point (soft group assignments), got {probs.dtype}"
        )
    maths = compute_dtype(q.dtype)
    if compute_dtype(q.dtype, probs.dtype) != maths:
        raise ValueError(
            f"routing.probs is {probs.dtype} but q, k, v are {q.dtype}, whose Focus maths runs "
            f"in {maths}: routing.probs may be at most {maths} (fp16, bf16 or fp32 routing with "
            f"fp16/bf16/fp32 q/k/v; fp64 only with fp64 q/k/v); cast routing.probs to {maths} "
            f"or q, k and v to {probs.dtype}"
        )


def raise_if_not_finite(**tensors: Tensor | None) -> None:
    """Raise ``ValueError`` naming the first of ``tensors`` (``None`` skipped) holding NaN or
    inf (a device sync on GPU). Inside a compiled graph the check is a device-side assertion
    (``torch._assert_async``: no host sync, no graph break; it fails the next sync instead)."""
    for name, t in tensors.items():
        if t is not None and torch.compiler.is_compiling():
            torch._assert_async(torch.isfinite(t).all(), f"{name} contains NaN or inf values")
        elif t is not None and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains NaN or inf values")
