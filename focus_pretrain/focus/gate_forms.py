"""The soft gate's forms: the paper's pairwise ``sigmoid`` gate, and a low-rank ``dot`` gate that
any attention kernel computes.

``sigmoid`` (default; docs/focus-method.md, section 3) adds
``log sigmoid(lambda * (g_i . g_j - 1/2))`` to the logits of the routed pairs (beyond the window,
not sinks): a pairwise function that only this package's kernels compute.

``dot`` adds ``lambda * g_i . g_j`` to the logit of **every** allowed pair, the window's and the
sinks' included (the constant ``-lambda / 2`` of sigmoid's argument is left out: a constant per
query changes no attention weight). It is a rank-``K`` bilinear term, so it is computed as ``K``
extra head-dim channels, ``q' = [q, (lambda / scale) g_i]`` and ``k' = [k, g_j]``, with ``v``
padded by zeros: then any attention kernel (FlashAttention, cuDNN, SDPA, our own) computes the
gated attention and its gradients, the routers' included. The term is part of the logit before
logit soft-capping (what such a kernel computes). With it:

- the soft pattern is plain causal attention (every pair of the document, each carrying the
  term): the dense path, at dense cost;
- sparse training and the hard inference pattern are the hard pattern (``mode="hard"``) with
  the term on every kept pair: training and inference compute the same function.

:func:`dot_gate_call` rewrites one call of ``focus_attention`` into the call that computes the
``dot`` form and :func:`attend_with_dot_gate` makes it; :func:`focus_pretrain.focus.
focus_attention` and context parallelism (:mod:`focus_pretrain.parallel.context_parallel`) use
it, so the rule is written once.
Experiment E6 (docs/experiments.md) compares the two forms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from focus_pretrain.focus.pattern import UNLIMITED_WINDOW
from focus_pretrain.focus.pattern_settings import GATE_FORMS, FocusPattern

__all__ = [
    "CHANNEL_MULTIPLE",
    "GATE_FORMS",
    "DotGateCall",
    "attend_with_dot_gate",
    "dot_gate_call",
    "dot_gate_channels",
    "dot_gate_pattern",
]
CHANNEL_MULTIPLE = 8  # the extra channels are padded to a multiple of 8 (flash kernels' rule)


@dataclass(frozen=True)
class DotGateCall:
    """The attention call that computes the ``dot`` form of one Focus call.

    Attributes:
        q, k, v: ``[b, s, H|Hkv, D + P]``: the channels appended (``v``: zeros).
        probs: the routing to pass (``None`` for the soft pattern: no routing is read).
        pattern: the call's pattern: the hard pattern (either hard mode) with the original
            window, or plain causal attention (the soft pattern: ``local_only``, an unlimited
            window); the ``sigmoid`` form (no gate of its own) and the original call's score
            scale (the head dim grew, the scale must not).
        head_dim: ``D``: the output's width to keep (``out[..., :D]``).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    probs: Tensor | None
    pattern: FocusPattern
    head_dim: int


def dot_gate_pattern(mode: str) -> str:
    """The pattern the ``dot`` form computes for the call mode ``mode``: ``"local"`` (the soft
    pattern: plain causal attention) or ``"hard"`` (``"hard"`` and ``"hard_gated"``)."""
    return "local" if mode == "soft" else "hard"


def dot_gate_channels(
    q: Tensor, k: Tensor, v: Tensor, probs: Tensor, *, gate_lambda: float, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``q, k, v`` with the ``dot`` gate's channels appended, so that
    ``scale * q'_i . k'_j = scale * q_i . k_j + gate_lambda * g_i . g_j`` and ``p v' = [p v, 0]``.

    Args:
        q: ``[b, s, H, D]``; k, v: ``[b, s, Hkv, D]``; probs: ``[b, s, K]`` soft assignments.

    Returns:
        ``[b, s, H|Hkv, D + P]`` each, ``P = K`` rounded up to a multiple of 8 (zero channels).
    """
    b, s, heads, _ = q.shape
    heads_kv, groups = k.shape[2], probs.shape[-1]
    width = -(-groups // CHANNEL_MULTIPLE) * CHANNEL_MULTIPLE
    g = torch.nn.functional.pad(probs, (0, width - groups))  # [b, s, K] -> [b, s, P]
    g_q = (g * (gate_lambda / scale)).to(q.dtype)  # in the probabilities' precision, then cast
    q_extra = g_q[:, :, None].expand(b, s, heads, width)  # [b, s, P] -> [b, s, H, P]
    k_extra = g.to(k.dtype)[:, :, None].expand(b, s, heads_kv, width)  # [b, s, Hkv, P]
    q_out = torch.cat([q, q_extra], dim=-1)  # [b, s, H, D + P]
    k_out = torch.cat([k, k_extra], dim=-1)  # [b, s, Hkv, D + P]
    v_out = torch.nn.functional.pad(v, (0, width))  # [b, s, Hkv, D + P]
    return q_out, k_out, v_out


def dot_gate_call(
    q: Tensor, k: Tensor, v: Tensor, probs: Tensor, pattern: FocusPattern
) -> DotGateCall:
    """The call that computes Focus attention of ``pattern`` (mode ``"soft"``, ``"hard"`` or
    ``"hard_gated"``) with the ``dot`` gate form: the channels of :func:`dot_gate_channels`,
    and the soft pattern as plain causal attention, either hard mode as the hard pattern.

    Args:
        q: ``[b, s, H, D]``; k, v: ``[b, s, Hkv, D]``; probs: ``[b, s, K]``.
        pattern: the call's settings (``scale``: ``None`` for ``1 / sqrt(D)``).
    """
    head_dim = q.shape[-1]
    scale = pattern.scale_for(head_dim)
    q, k, v = dot_gate_channels(q, k, v, probs, gate_lambda=pattern.gate_lambda, scale=scale)
    rewritten = dict(scale=scale, gate_form="sigmoid", local_only=False)
    if dot_gate_pattern(pattern.mode) == "local":
        rewritten.update(mode="soft", window=UNLIMITED_WINDOW, local_only=True)
        probs = None
    else:
        rewritten.update(mode="hard")
    return DotGateCall(q, k, v, probs, replace(pattern, **rewritten), head_dim)


def attend_with_dot_gate(
    attend: Callable,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor,
    pattern: FocusPattern,
    *,
    return_lse: bool = False,
    **kwargs,
):
    """``attend(q, k, v, probs, pattern, **options)`` (``focus_attention``'s signature)
    computing the ``dot`` form of ``pattern``: the rewritten call of :func:`dot_gate_call`, its
    output cut back to ``D`` channels. ``[b, s, H, D]`` out (and the log-sum-exp with
    ``return_lse``); ``kwargs`` go to ``attend`` unchanged (backend, documents, ...)."""
    call = dot_gate_call(q, k, v, probs, pattern)
    if return_lse:
        kwargs["return_lse"] = True
    out = attend(call.q, call.k, call.v, call.probs, call.pattern, **kwargs)  # [b, s, H, D + P]
    if return_lse:
        return out[0][..., : call.head_dim], out[1]  # [b, s, H, D + P] -> [b, s, H, D]
    return out[..., : call.head_dim]  # [b, s, H, D + P] -> [b, s, H, D]
