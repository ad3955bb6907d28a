"""The share of the dense attention's mass a Focus pattern removes: what the retrofit objective
``attention_mass`` minimises (:mod:`focus_pretrain.train.loss`).

A query ``i`` of the dense causal attention puts ``a_ij = softmax_j(s_ij)`` on its keys. The
Focus pattern multiplies each of those by a gate in ``[0, 1]`` before normalising: the soft
gate beyond the window (1 on the window and the sinks) in ``soft`` mode; the hard pattern's
pairs, gated beyond the window, in ``hard_gated`` mode (0 elsewhere); the hard pattern's pairs
in ``hard`` mode. The pattern keeps the share ``sum_j a_ij * gate_ij`` of the mass, and

    removed_i = -log(sum_j a_ij * gate_ij) = lse_dense_i - lse_pattern_i

per query and head, 0 when the pattern keeps every key the dense attention reads. It is the
attention's own measure of what a query loses (the hard pattern renormalises what is left, so
the keys it drops are what changes the output), and it is cheap: two log-sum-exps of calls
every backend makes, and its gradient reaches the routing through the gate only (SeerAttention
trains its gates on the original model's attention in the same spirit, Gao et al. 2024).

Only the ``sigmoid`` gate form is a gate in ``[0, 1]``: the ``dot`` form adds a bonus, so the
share would not be one; it is refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import Tensor

from focus_pretrain.focus.attention import focus_attention
from focus_pretrain.focus.pattern import UNLIMITED_WINDOW
from focus_pretrain.focus.pattern_settings import FocusPattern, with_settings
from focus_pretrain.focus.router import Routing

__all__ = ["removed_attention_mass"]


def removed_attention_mass(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    routing: Routing | Tensor,
    pattern: FocusPattern | None = None,
    *,
    backend: str = "auto",
    check_finite: bool = True,
    documents: Tensor | None = None,
    **settings: Any,
) -> Tensor:
    """``-log`` of the share of the dense causal attention's mass that ``pattern`` keeps, per
    query and head: ``[batch, seq, heads]`` fp32, ``>= 0`` (to rounding).

    Arguments as :func:`~focus_pretrain.focus.focus_attention`'s (``q [b, s, H, D]``,
    ``k``/``v [b, s, Hkv, D]``, the layer's routing, the pattern or its settings, packed
    ``documents``). Differentiable in the routing (through the gate) and in ``q`` and ``k``;
    with ``q`` and ``k`` not requiring gradients (a frozen model) only the pattern's side
    builds a graph. ``v`` only satisfies the attention API: the result does not depend on it.

    Raises:
        ValueError: a sliding-window pattern (``local_only``: no routing), the ``dot`` gate
            form (not a gate in ``[0, 1]``), or anything :func:`focus_attention` refuses.
    """
    pattern = with_settings(pattern, settings, caller="removed_attention_mass")
    if pattern.local_only:
        raise ValueError("removed_attention_mass needs a routed pattern, not local_only")
    if pattern.gate_form != "sigmoid":
        raise ValueError(
            f"removed_attention_mass needs gate_form='sigmoid' (a gate in [0, 1]), got "
            f"{pattern.gate_form!r}: the dot form adds to the scores, so no share is removed"
        )
    extra = {} if documents is None else {"documents": documents}
    dense = replace(pattern, window=UNLIMITED_WINDOW, mode="soft", local_only=True)
    _, lse_dense = focus_attention(
        q, k, v, None, dense, return_lse=True, check_finite=check_finite, **extra
    )  # [b, s, H]
    _, lse_kept = focus_attention(
        q, k, v, routing, pattern, return_lse=True, backend=backend, check_finite=False, **extra
    )  # [b, s, H]
    return lse_dense - lse_kept
