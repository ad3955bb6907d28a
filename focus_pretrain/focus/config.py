"""Hyperparameters of Focus attention, validated at construction.

Every knob of the method lives here so that recipes can set it from YAML (the config loader
builds this dataclass from the ``focus:`` section). Defaults follow the paper's ablations
(arXiv 2604.03260): ``K = 8`` groups (its 7B run used ``K = 4``), ``d_g = 16``, ``w = 128``,
``tau = 0.1`` and 10 Sinkhorn iterations.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

from focus_pretrain.focus import backends as registry
from focus_pretrain.focus import builtin_backends  # noqa: F401  (fills the registry)
from focus_pretrain.focus.gate_forms import dot_gate_pattern
from focus_pretrain.focus.pattern_settings import (
    GATE_FORMS,
    KEY_GROUPS,
    PATTERN_FIELDS,
    FocusPattern,
)
from focus_pretrain.focus.router import BALANCE_MODES, MAX_GROUPS
from focus_pretrain.validation import check_choice, check_int, check_positive

ATTENTION_MODES = ("soft", "hard")  # the patterns a model infers with (focus.inference_mode)
TRAINING_MODES = ("soft", "hard")  # focus.training_mode: the soft gate, or sparse training


def __getattr__(name: str) -> tuple[str, ...]:
    """``BACKEND_NAMES`` and ``TRAINING_BACKENDS``: one-release aliases of
    :func:`~focus_pretrain.focus.backends.backend_names` and
    :func:`~focus_pretrain.focus.backends.training_backend_names` (the registry can grow after
    import, so the names are read from it when asked)."""
    readers = {
        "BACKEND_NAMES": registry.backend_names,
        "TRAINING_BACKENDS": registry.training_backend_names,
    }
    if name not in readers:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"focus_pretrain.focus.config.{name} is deprecated and will be removed in the next "
        f"release; call focus_pretrain.focus.backends.{readers[name].__name__}()",
        DeprecationWarning,
        stacklevel=2,
    )
    return readers[name]()


@dataclass(frozen=True)
class FocusConfig:
    """Focus attention hyperparameters (the ``focus:`` section of a recipe).

    Attributes:
        enabled: ``False`` builds the dense causal baseline from the same code.
        num_groups: ``K``, the number of learned centroids (groups) per layer.
        group_dim: ``d_g``, the router's projection width.
        window: ``w``; a query ``i`` always sees keys ``j`` with ``0 <= i - j <= w``.
        tau: routing temperature: logits are ``<W_g h, c_k> / tau``.
        balance: ``"causal"`` (default; per-token softmax plus non-gradient balance offsets),
            ``"sinkhorn"`` (paper-faithful, over the sequence, *not causal*) or ``"none"``
            (plain per-token softmax, no balancing: the ablation that may collapse).
        sinkhorn_iters: log-domain Sinkhorn iterations (``sinkhorn`` routing and the causal
            mode's load target).
        balance_rate: step of the balance offsets toward the batch's Sinkhorn column
            potentials after each optimizer step (``causal`` mode), in ``(0, 1]``.
        top_k: groups kept per token by the hard (inference) pattern, 1 to ``num_groups``.
        inference_mode: the pattern a model uses in ``eval()``: ``"hard"`` (default) or
            ``"soft"``.
        training_mode: the pattern a model trains on: ``"soft"`` (default: the soft gate over
            every causal pair, dense cost) or ``"hard"`` (sparse training: only the hard top-k
            pattern's pairs, forward and backward, with the soft gate on its routed pairs so
            the routers learn; ``docs/focus-method.md``, "Sparse training").
        soft_warmup_steps: with ``training_mode: hard``, the optimizer steps trained with the
            soft gate first (the routers learn groups on every pair, then training turns
            sparse); ``0`` (default): sparse from the first step.
        gate_lambda: sharpness ``lambda`` of the soft gate on pairs beyond the window
            (:func:`~focus_pretrain.focus.pattern.soft_gate`), or of the ``dot`` form.
        gate_form: ``"sigmoid"`` (default: the paper's ``log sigmoid(lambda (g_i . g_j -
            1/2))`` on pairs beyond the window) or ``"dot"`` (``lambda g_i . g_j`` on every
            allowed pair, computed as ``K`` extra head-dim channels of q and k, so any attention
            kernel trains it: :mod:`~focus_pretrain.focus.gate_forms`; experiment E6 in
            docs/experiments.md). Training and inference use the same form.
        normalize: route by cosine similarity (unit ``W_g h`` and unit centroids, so logits
            lie in ``[-1/tau, 1/tau]``); ``False`` uses the plain dot product. **Decision**: cosine
            by default; with plain dot products 10 Sinkhorn iterations at ``tau = 0.1`` leave
            the worst column 18-36% off balance, with cosine 0.1% (docs/benchmarks.md).
        check_finite: a debugging knob, off by default: each router and attention call raises
            a ``ValueError`` naming the first NaN/inf input it sees (a blocking device sync
            per call on GPU: about 160 per micro-batch for a 7B model). Training does not need
            it: a step with a non-finite loss or gradient is skipped
            (:mod:`focus_pretrain.train.bad_steps`); turn it on to find where a NaN starts.
        window_only: ablation: no router, every layer attends only inside the window (the
            sliding-window twin a Focus model is compared against; same other weights).
        backend: attention backend of the training pattern: ``"auto"`` (an exact one for each
            call, by fixed rules), ``"reference"``, ``"flex"`` or ``"triton"`` (fused Triton
            kernels; ``auto`` picks it for the soft gate where its tile table measured it
            fastest, docs/benchmarks.md); one that computes
            ``training_mode``'s pattern with gradients.
        inference_backend: backend of the ``eval()`` pattern: ``"auto"``, ``"reference"``,
            ``"flex"``, ``"decomposed"`` (hard top-1 only) or ``"triton"`` (soft only).
        sinks: ``S >= 0`` attention sinks (StreamingLLM): the first ``S`` tokens of every
            sequence (positions ``0 .. S-1``) are visible to every later query, in both patterns
            (no gate on them in the soft one), like keys inside the window; ``S`` extra keys per
            query. Focus layers and the ``window_only`` twin take them; a family's own
            sliding-window layers do not. ``0`` (default) is the plain pattern.
        key_groups: which groups a key counts as in: ``"own"`` (default, the method: each token
            routed once, for both sides) or ``"own_and_previous"`` (a key also in the groups
            of the token before it, so that a query finds the token after its match, the link
            of induction heads: :mod:`focus_pretrain.focus.pattern`, "Key groups"; E7).
            Computed by the ``reference`` backend (CPU and CUDA) and under ``cp_mode: a2a``.
    """

    enabled: bool = True
    num_groups: int = 8
    group_dim: int = 16
    window: int = 128
    tau: float = 0.1
    balance: str = "causal"
    sinkhorn_iters: int = 10
    balance_rate: float = 0.1
    top_k: int = 1
    inference_mode: str = "hard"
    training_mode: str = "soft"
    soft_warmup_steps: int = 0
    gate_lambda: float = 10.0
    gate_form: str = "sigmoid"
    normalize: bool = True
    check_finite: bool = False
    window_only: bool = False
    backend: str = "auto"
    inference_backend: str = "auto"
    sinks: int = 0
    key_groups: str = "own"

    def __post_init__(self) -> None:
        check_int("focus.num_groups", self.num_groups, low=1, high=MAX_GROUPS)
        check_int("focus.group_dim", self.group_dim, low=1)
        check_int("focus.window", self.window, low=0)
        check_int("focus.sinks", self.sinks, low=0)
        check_int("focus.sinkhorn_iters", self.sinkhorn_iters, low=1)
        check_int("focus.top_k", self.top_k, low=1, high=self.num_groups, high_name="num_groups")
        check_positive("focus.tau", self.tau)
        check_positive("focus.gate_lambda", self.gate_lambda)
        check_positive("focus.balance_rate", self.balance_rate)
        if self.balance_rate > 1:
            raise ValueError(f"focus.balance_rate must be in (0, 1], got {self.balance_rate}")
        check_choice("focus.balance", self.balance, BALANCE_MODES)
        check_choice("focus.gate_form", self.gate_form, GATE_FORMS)
        check_choice("focus.inference_mode", self.inference_mode, ATTENTION_MODES)
        check_choice("focus.training_mode", self.training_mode, TRAINING_MODES)
        check_int("focus.soft_warmup_steps", self.soft_warmup_steps, low=0)
        if self.soft_warmup_steps and self.training_mode != "hard":
            raise ValueError(
                f"focus.soft_warmup_steps={self.soft_warmup_steps} warms up sparse training "
                "with the soft gate: set focus.training_mode=hard, or soft_warmup_steps=0"
            )
        check_choice("focus.backend", self.backend, registry.training_backend_names())
        check_choice("focus.inference_backend", self.inference_backend, registry.backend_names())
        self._check_inference_backend()
        self._check_training_backend()
        self._check_key_groups()

    def pattern(self, **changes: Any) -> FocusPattern:
        """The attention pattern's settings of this recipe: every
        :class:`~focus_pretrain.focus.pattern_settings.FocusPattern` field this config has by
        the same name (window, top_k, the gate's parameters, sinks), with ``changes`` (a
        layer's own: mode, window, sinks, softcap, scale, local_only) in their place."""
        shared = {name: getattr(self, name) for name in PATTERN_FIELDS if name in CONFIG_FIELDS}
        return FocusPattern(**{**shared, **changes})

    @property
    def training_pattern(self) -> str:
        """The attention mode sparse or soft training computes (after any warm-up):
        ``"soft"`` or ``"hard_gated"``."""
        return "hard_gated" if self.training_mode == "hard" else "soft"

    def training_pattern_at(self, step: int) -> str:
        """The attention mode of the optimizer step ``step`` (0-based): the soft gate during
        the ``soft_warmup_steps``, then :attr:`training_pattern`."""
        return "soft" if step < self.soft_warmup_steps else self.training_pattern

    def _check_training_backend(self) -> None:
        """The named training backend computes ``training_mode``'s pattern."""
        name, mode = self.backend, self.training_pattern
        if self.gate_form == "dot":  # soft: plain causal attention; sparse: the hard pattern
            mode = dot_gate_pattern(mode)
        if name == "auto" or registry.get_backend(name).capabilities.computes(mode, self.top_k):
            return
        others = [
            other
            for other in registry.training_backend_names()[1:]
            if registry.get_backend(other).capabilities.computes(mode, self.top_k)
        ]
        computes = registry.get_backend(name).capabilities.describe()
        form = f" and focus.gate_form={self.gate_form!r}" if self.gate_form != "sigmoid" else ""
        raise ValueError(
            f"focus.backend {name!r} does not train with focus.training_mode="
            f"{self.training_mode!r}{form} (it computes {computes}); use 'auto' or one of "
            f"{others}, or focus.training_mode='soft'"
        )

    def _check_key_groups(self) -> None:
        """``key_groups``: a known rule, the sigmoid gate, and named backends that compute it."""
        check_choice("focus.key_groups", self.key_groups, KEY_GROUPS)
        if self.key_groups == "own":
            return
        if self.gate_form != "sigmoid":
            raise ValueError(
                f"focus.key_groups={self.key_groups!r} needs focus.gate_form='sigmoid', got "
                f"{self.gate_form!r}; set focus.key_groups=own or focus.gate_form=sigmoid"
            )

        def computes(name: str) -> bool:
            return self.key_groups in registry.get_backend(name).capabilities.key_groups

        for key in ("backend", "inference_backend"):
            name = getattr(self, key)
            if name == "auto" or computes(name):
                continue
            takes = [other for other in registry.backend_names()[1:] if computes(other)]
            raise ValueError(
                f"focus.{key} {name!r} does not compute focus.key_groups="
                f"{self.key_groups!r}; use 'auto' or one of {takes}"
            )

    def _check_inference_backend(self) -> None:
        """The named inference backend computes the ``eval()`` pattern (its capabilities)."""
        backend_names, get_backend = registry.backend_names, registry.get_backend

        def computes(name: str) -> bool:
            return get_backend(name).capabilities.computes(self.inference_mode, self.top_k)

        name = self.inference_backend
        if name == "auto" or computes(name):
            return
        others = [other for other in backend_names()[1:] if computes(other)]
        raise ValueError(
            f"focus.inference_backend {name!r} computes "
            f"{get_backend(name).capabilities.describe()} only, got top_k={self.top_k}, "
            f"inference_mode={self.inference_mode!r}; use 'auto' or one of {others}"
        )


CONFIG_FIELDS = frozenset(field.name for field in dataclasses.fields(FocusConfig))
