"""The Focus pattern's settings as one object, from the recipe to the kernels.

A :class:`FocusPattern` says which pattern one attention call computes, apart from the tokens'
own data (their routing and document starts): the window, the mode, ``top_k``, the soft gate's
parameters, the sinks, soft-capping, the score scale, and whether the layer is a sliding-window
layer. It travels whole: the model builds it from its
:class:`~focus_pretrain.focus.config.FocusConfig` (:meth:`FocusConfig.pattern`, by field name),
:func:`~focus_pretrain.focus.focus_attention`, context parallelism (all-to-all and ring) and the
ring's per-block kernels take it as it is, and every backend reads it from
:class:`~focus_pretrain.focus.backends.AttentionPattern` (this object plus the call's tensors).
The export writes the same ``FocusConfig`` fields into ``config.json``.

So a new gate parameter is a field here (with its check), the recipe's field of the same name
in ``FocusConfig``, the rule (:mod:`focus_pretrain.focus.pattern`) and the rule's copies (the
kernels, the shipped HF code); nothing that carries the pattern changes
(docs/architecture.md, "Add a gate parameter").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from focus_pretrain.focus.pattern import PATTERN_MODES
from focus_pretrain.validation import check_choice, check_int, check_positive

GATE_FORMS = ("sigmoid", "dot")  # the soft gate's forms (focus_pretrain.focus.gate_forms)
# which groups a key counts as in (focus_pretrain.focus.pattern, "Key groups"): its own, or its
# own and its predecessor's (a key routed also by the token before it: induction pairs)
KEY_GROUPS = ("own", "own_and_previous")


@dataclass(frozen=True, kw_only=True)
class FocusPattern:
    """Which Focus pattern an attention call computes (defaults: :func:`focus_attention`'s).

    Attributes:
        window: the local window ``w >= 0``: keys with ``0 <= i - j <= w`` are always attended.
        mode: ``"soft"`` (the soft gate), ``"hard"`` (top-k groups) or ``"hard_gated"`` (sparse
            training: the hard pattern, gated beyond the window); ignored when ``local_only``.
        top_k: groups per token in the hard modes, ``1 <= top_k <= K``.
        gate_lambda: the soft gate's sharpness ``lambda`` (or the ``dot`` form's weight).
        gate_form: ``"sigmoid"`` (the paper's gate beyond the window) or ``"dot"``
            (:mod:`~focus_pretrain.focus.gate_forms`); no effect with ``local_only``.
        sinks: attention sinks ``S >= 0``: the first ``S`` tokens of each document.
        softcap: Gemma-2 logit soft-capping ``c``, or ``None``.
        scale: the score scale, ``None`` for ``1 / sqrt(head_dim)``.
        local_only: a sliding-window layer: the window and the sinks only, no routing.
        key_groups: which groups a key counts as in: ``"own"`` (the method: a token is routed
            once, for both sides) or ``"own_and_previous"`` (also the groups of the token
            before it in its document; :func:`~focus_pretrain.focus.pattern.key_memberships`).
    """

    window: int = 128
    mode: str = "soft"
    top_k: int = 1
    gate_lambda: float = 10.0
    gate_form: str = "sigmoid"
    sinks: int = 0
    softcap: float | None = None
    scale: float | None = None
    local_only: bool = False
    key_groups: str = "own"

    @property
    def kind(self) -> str:
        """``"local"``, ``"soft"``, ``"hard"`` or ``"hard_gated"``: what the pattern is."""
        return "local" if self.local_only else self.mode

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad setting (``top_k``'s upper bound, ``K``,
        is the routing's: checked where the routing is known)."""
        check_int("window", self.window, low=0)
        check_choice("mode", self.mode, PATTERN_MODES)
        check_int("top_k", self.top_k, low=1)
        check_positive("gate_lambda", self.gate_lambda)
        check_choice("gate_form", self.gate_form, GATE_FORMS)
        check_int("sinks", self.sinks, low=0)
        if self.softcap is not None:
            check_positive("softcap", self.softcap)
        if self.scale is not None:
            check_positive("scale", self.scale)
        check_choice("key_groups", self.key_groups, KEY_GROUPS)
        if self.key_groups != "own" and self.gate_form != "sigmoid":
            raise ValueError(
                f"key_groups={self.key_groups!r} needs gate_form='sigmoid' (the dot form's "
                f"channels route both sides alike), got gate_form={self.gate_form!r}"
            )

    def scale_for(self, head_dim: int) -> float:
        """The score scale of a call with ``head_dim``-wide heads: ``scale``, or
        ``1 / sqrt(head_dim)`` when it is ``None``."""
        return head_dim**-0.5 if self.scale is None else float(self.scale)

    def settings(self) -> dict[str, Any]:
        """``{name: value}`` of every setting (the fields of :class:`FocusPattern` only, also
        on a subclass): what :func:`with_settings` and a subclass's constructor take."""
        return {name: getattr(self, name) for name in PATTERN_FIELDS}


PATTERN_FIELDS = tuple(field.name for field in dataclasses.fields(FocusPattern))


def with_settings(
    pattern: FocusPattern | None, settings: dict[str, Any], *, caller: str
) -> FocusPattern:
    """``pattern`` (default: :class:`FocusPattern`'s defaults) with ``settings`` (``{name:
    value}`` keywords of ``caller``) in place of its own; raises ``TypeError`` naming any name
    that is not a setting."""
    unknown = sorted(set(settings) - set(PATTERN_FIELDS))
    if unknown:
        raise TypeError(
            f"{caller}() got unknown pattern setting(s) {unknown}; the settings are "
            f"{list(PATTERN_FIELDS)}"
        )
    base = FocusPattern() if pattern is None else pattern
    if not isinstance(base, FocusPattern):
        raise TypeError(f"{caller}(): pattern must be a FocusPattern, got {type(base).__name__}")
    if not settings:
        return base
    return FocusPattern(**{**base.settings(), **settings})
