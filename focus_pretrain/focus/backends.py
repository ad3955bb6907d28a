"""The attention backends' registry: what each backend computes, how to call it, and which of
the ring's per-block kernels serves it.

A backend is a :class:`Backend`: a name, a function with one signature (:data:`BackendFn`: ``q,
k, v`` and the :class:`AttentionPattern` to compute), its :class:`Capabilities` (modes,
``top_k``, documents, sinks, soft-capping, devices, gradients) and a ``priority`` that says, for
a request the capabilities allow, whether the backend is available here (``None``: not, e.g.
no FlexAttention or no Triton) and how fast it is (``auto`` picks the highest). A backend named
by the user is used, or refused with the reason (:meth:`Backend.refusal`); nothing is
substituted.

Every list of backend names is derived from the registry: :func:`backend_names` (what
``focus.inference_backend`` accepts), :func:`training_backend_names` (the differentiable soft
pattern: ``focus.backend``), :func:`ring_backend_names` (the backends a ring step can run, by
their ``ring_block`` kernel). The built-in backends register in
:mod:`focus_pretrain.focus.builtin_backends`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from focus_pretrain.focus.pattern_settings import FocusPattern

# local: a sliding-window layer (no routing); hard_gated: the hard pattern with the soft gate on
# its routed pairs (sparse training)
MODES = ("soft", "hard", "hard_gated", "local")


@dataclass(frozen=True, kw_only=True)
class AttentionPattern(FocusPattern):
    """The Focus pattern one call computes (:mod:`focus_pretrain.focus.pattern`): its settings
    (:class:`~focus_pretrain.focus.pattern_settings.FocusPattern`: window, mode, ``top_k``, the
    gate's parameters, sinks, soft-capping, ``scale`` resolved to a number) and the call's
    tensors, validated by :func:`~focus_pretrain.focus.attention.focus_attention`. Built with
    :meth:`of`.

    Attributes:
        probs: ``[b, s, K]`` soft assignments (soft and hard_gated modes), else ``None``.
        member: ``[b, s]`` int64 membership bitmasks (hard and hard_gated modes), else
            ``None``.
        documents: ``[b, s]`` int64 document starts, or ``None`` (one document per sample).
        groups: ``K``, the number of groups (0 for a sliding-window layer); with ``top_k``, a
            static int that bounds the group-sorted layout's segment table
            (:func:`~focus_pretrain.focus.sorted_layout.segment_slots`).
        key_probs, key_member: the keys' side of ``probs`` and ``member`` when it differs from
            the queries' (``key_groups="own_and_previous"``:
            :func:`~focus_pretrain.focus.pattern.key_assignments`,
            :func:`~focus_pretrain.focus.pattern.key_memberships`), else ``None``.
    """

    probs: Tensor | None = None
    member: Tensor | None = None
    documents: Tensor | None = None
    groups: int = 0
    key_probs: Tensor | None = None
    key_member: Tensor | None = None

    def __post_init__(self) -> None:
        if self.scale is None:  # a backend multiplies by it: resolved by the caller
            raise ValueError("AttentionPattern needs a number for scale (e.g. head_dim ** -0.5)")

    @classmethod
    def of(cls, settings: FocusPattern, **tensors) -> AttentionPattern:
        """``settings`` with the call's ``tensors`` (``probs``, ``member``, ``documents``,
        ``groups``, ``key_probs``, ``key_member``)."""
        return cls(**settings.settings(), **tensors)

    @property
    def keys_probs(self) -> Tensor | None:
        """The keys' soft assignments: :attr:`key_probs`, or the queries' :attr:`probs`."""
        return self.probs if self.key_probs is None else self.key_probs

    @property
    def keys_member(self) -> Tensor | None:
        """The keys' membership bitmasks: :attr:`key_member`, or the queries' :attr:`member`."""
        return self.member if self.key_member is None else self.key_member


BackendFn = Callable[[Tensor, Tensor, Tensor, AttentionPattern], tuple[Tensor, Tensor]]


class BlockSide(NamedTuple):
    """One side (queries or keys) of a block for the per-block kernels
    (:func:`~focus_pretrain.focus.reference.attend_block`, the ring's fused kernels).

    Attributes:
        pos: ``[L]`` (or ``[b, L]``) global positions: any increasing positions (a ring step's
            zigzag chunks); keys of a document's first ``sinks`` positions are sinks.
        probs: ``[b, L, K]`` soft assignments (soft mode), else ``None``.
        member: ``[b, L]`` int64 membership bitmasks (hard mode), else ``None``.
        doc: ``[b, L]`` int64 document starts, or ``None``.
    """

    pos: Tensor
    probs: Tensor | None = None
    member: Tensor | None = None
    doc: Tensor | None = None


# a per-block kernel: ``(q [b, Lq, H, D], k, v [b, Lk, Hkv, D], pattern, queries, keys) -> (out,
# lse)``; it reads the pattern's parameters (window, mode, ...), the sides carry the tokens' data
BlockFn = Callable[
    [Tensor, Tensor, Tensor, AttentionPattern, BlockSide, BlockSide], tuple[Tensor, Tensor]
]


@dataclass(frozen=True)
class AttentionRequest:
    """What a backend is asked to compute (enough to decide whether it can, and how fast).

    Attributes:
        device: ``"cpu"``, ``"cuda"``, ...; dtype: the inputs' dtype.
        batch, seq, heads, heads_kv, head_dim: the shapes.
        mode: ``"soft"`` or ``"hard"``; top_k: groups per token (hard mode).
        local_only: a sliding-window layer; window: the local window.
        softcap: whether Gemma-2 soft-capping is on.
        needs_grad: whether autograd will differentiate through the call.
        sinks: attention sinks (every built-in backend is exact for any number).
        documents: whether the sequences are packed documents (``documents=`` given).
        needs_lse: whether the caller wants the log-sum-exp back (``return_lse``; unknown:
            ``True``).
        key_groups: which groups a key counts as in (``"own"``: the method's symmetric rule).
    """

    device: str
    dtype: torch.dtype
    batch: int
    seq: int
    heads: int
    heads_kv: int
    head_dim: int
    mode: str
    top_k: int
    local_only: bool
    window: int
    softcap: bool
    needs_grad: bool
    sinks: int = 0
    documents: bool = False
    needs_lse: bool = True
    key_groups: str = "own"

    @property
    def kind(self) -> str:
        """``"local"``, ``"soft"``, ``"hard"`` or ``"hard_gated"``."""
        return "local" if self.local_only else self.mode

    @classmethod
    def of(
        cls,
        q: Tensor,
        k: Tensor,
        pattern: FocusPattern,
        *,
        needs_grad: bool,
        documents: bool = False,
        needs_lse: bool = True,
    ) -> AttentionRequest:
        """What a call on ``q`` ``[b, s, H, D]`` and ``k`` ``[b, s_k, Hkv, D]`` under
        ``pattern`` asks (the dispatcher's call, or one ring step)."""
        return cls(
            device=q.device.type, dtype=q.dtype, batch=q.shape[0], seq=q.shape[1],
            heads=q.shape[2], heads_kv=k.shape[2], head_dim=q.shape[3], mode=pattern.mode,
            top_k=pattern.top_k, local_only=pattern.local_only, window=pattern.window,
            softcap=pattern.softcap is not None, needs_grad=needs_grad, sinks=pattern.sinks,
            documents=documents, needs_lse=needs_lse,
            key_groups="own" if pattern.local_only else pattern.key_groups,
        )  # fmt: skip


def differentiated(*tensors: Tensor | None) -> bool:
    """Whether autograd will differentiate through any of ``tensors`` (``None`` skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@dataclass(frozen=True)
class Capabilities:
    """What a backend computes exactly (every backend computes the same function where it runs).

    Attributes:
        modes: a subset of :data:`MODES`.
        max_top_k: the largest ``top_k`` of the hard modes (``None``: any).
        documents, sinks, softcap: whether it takes packed documents, sinks, soft-capping.
        devices: the device types it runs on (``None``: any).
        gradients_on: the device types where it differentiates (``None``: wherever it runs).
        key_groups: the ``key_groups`` rules it computes (every backend: ``"own"``).
    """

    modes: frozenset[str]
    max_top_k: int | None = None
    documents: bool = True
    sinks: bool = True
    softcap: bool = True
    devices: frozenset[str] | None = None
    gradients_on: frozenset[str] | None = None
    key_groups: frozenset[str] = frozenset({"own"})

    def refusal(self, r: AttentionRequest) -> str | None:
        """Why ``r`` is outside these capabilities (``None``: it is inside)."""
        checks = (
            (r.kind not in self.modes, f"mode {r.kind!r} (it computes {sorted(self.modes)})"),
            (
                r.kind in ("hard", "hard_gated")
                and self.max_top_k is not None
                and r.top_k > self.max_top_k,
                f"top_k={r.top_k} (at most {self.max_top_k})",
            ),
            (r.documents and not self.documents, "packed documents"),
            (r.sinks > 0 and not self.sinks, "attention sinks"),
            (r.softcap and not self.softcap, "soft-capping"),
            (r.key_groups not in self.key_groups, f"key_groups={r.key_groups!r}"),
            (
                self.devices is not None and r.device not in self.devices,
                f"device {r.device!r} (it runs on {sorted(self.devices or ())})",
            ),
            (
                r.needs_grad and not self.differentiates_on(r.device),
                f"gradients on {r.device!r}",
            ),
        )
        reasons = [why for failed, why in checks if failed]
        return ", ".join(reasons) if reasons else None

    def computes(self, mode: str, top_k: int) -> bool:
        """Whether it computes the routed pattern ``mode`` (``"soft"``/``"hard"``) at
        ``top_k``."""
        routed = mode in ("hard", "hard_gated")
        too_many = routed and self.max_top_k is not None and top_k > self.max_top_k
        return mode in self.modes and not too_many

    def describe(self) -> str:
        """The routed patterns it computes, in words (``"hard top-1 attention"``, ...)."""
        hard = (
            "hard attention" if self.max_top_k is None else f"hard top-{self.max_top_k} attention"
        )
        words = {"soft": "the soft pattern", "hard": hard, "hard_gated": f"gated {hard}"}
        routed = [words[m] for m in ("soft", "hard", "hard_gated") if m in self.modes]
        if not routed:
            return "sliding-window layers"
        return " and ".join([", ".join(routed[:-1]), routed[-1]] if len(routed) > 1 else routed)

    def differentiates_on(self, device: str) -> bool:
        """Whether it differentiates on ``device`` (a device type)."""
        return self.gradients_on is None or device in self.gradients_on


@dataclass(frozen=True)
class Backend:
    """An attention backend.

    Attributes:
        name: what ``backend=`` selects.
        fn: ``fn(q, k, v, pattern) -> (out [b, s, H, D], lse [b, s, H] fp32)``
            (:data:`BackendFn`).
        capabilities: what it computes (:class:`Capabilities`).
        priority: ``priority(request) -> int | None`` for a request inside the capabilities:
            ``None`` when the backend is not available for it here (a missing library, a dtype
            or head dim its kernels do not take); otherwise ``auto`` picks the highest.
        ring_block: the ring step kernel that computes this backend's attention per block
            (:mod:`focus_pretrain.parallel.ring_kernels`), or ``None``: not in the ring.
        unavailable: ``unavailable(request) -> str | None``: for a request ``priority`` turns
            down, the specific reason and fix, when there is one more helpful than "not
            available here".
        ring_modes: the patterns its ring step computes (``None``: its capabilities' modes).
        ring_priority: how the ring's ``auto`` ranks its ring step for a request (``None``:
            :attr:`priority`; returning ``None``: never automatic in the ring), so that the
            ring's ``auto`` and the model's read this one table (:func:`select_ring_block`).
    """

    name: str
    fn: BackendFn
    capabilities: Capabilities
    priority: Callable[[AttentionRequest], int | None]
    ring_block: str | None = None
    unavailable: Callable[[AttentionRequest], str | None] | None = None
    ring_modes: frozenset[str] | None = None
    ring_priority: Callable[[AttentionRequest], int | None] | None = None

    def refusal(self, request: AttentionRequest) -> str | None:
        """Why this backend cannot run ``request`` exactly (``None``: it can)."""
        reason = self.capabilities.refusal(request)
        if reason is None and self.priority(request) is None:
            reason = self.unavailable(request) if self.unavailable is not None else None
            reason = reason or (
                f"{request.dtype} with head_dim {request.head_dim} on {request.device} here "
                "(its library or kernels are not available for these)"
            )
        return reason


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add (or replace) a backend under ``backend.name``."""
    if backend.name == "auto":
        raise ValueError("'auto' is the automatic choice, not a backend name")
    _BACKENDS[backend.name] = backend


def available_backends() -> list[str]:
    """Names accepted by ``backend=`` (besides ``"auto"``), sorted."""
    return sorted(_BACKENDS)


def get_backend(name: str) -> Backend:
    """The registered backend ``name`` (``ValueError`` naming the choices otherwise)."""
    if name not in _BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {available_backends()}, got {name!r}")
    return _BACKENDS[name]


def backend_names() -> tuple[str, ...]:
    """``"auto"`` and every registered backend, in registration order."""
    return ("auto", *_BACKENDS)


def training_backend_names() -> tuple[str, ...]:
    """``"auto"`` and the backends of a training pattern (soft or hard_gated) that
    differentiate somewhere."""
    trains = {"soft", "hard_gated"}
    return (
        "auto",
        *(
            b.name
            for b in _BACKENDS.values()
            if trains & b.capabilities.modes and b.capabilities.gradients_on != frozenset()
        ),
    )


def ring_backend_names() -> tuple[str, ...]:
    """``"auto"`` and the backends a ring step computes (those with a ``ring_block``)."""
    return ("auto", *(b.name for b in _BACKENDS.values() if b.ring_block is not None))


def select_ring_block(request: AttentionRequest) -> str:
    """The ring's ``auto``: the ring step kernel (:attr:`Backend.ring_block`) of the backend
    whose ring step computes ``request`` (:attr:`Backend.ring_modes`, its capabilities) and
    ranks highest (:attr:`Backend.ring_priority`, else its priority); the reference's
    ``blockwise`` step runs everything."""
    ranked = []
    for backend in _BACKENDS.values():
        modes = backend.ring_modes or backend.capabilities.modes
        if backend.ring_block is None or request.kind not in modes:
            continue
        if backend.capabilities.refusal(request) is not None:
            continue
        rank = (backend.ring_priority or backend.priority)(request)
        if rank is not None:
            ranked.append((rank, backend.name))
    return _BACKENDS[max(ranked)[1]].ring_block


def select_backend(name: str, request: AttentionRequest) -> Backend:
    """The backend ``name``, checked to run ``request`` exactly (``ValueError`` with the reason
    otherwise), or for ``"auto"`` the fastest that can."""
    if name == "auto":
        ranked = [
            (b.priority(request), b.name)
            for b in _BACKENDS.values()
            if b.capabilities.refusal(request) is None
        ]
        available = [(p, n) for p, n in ranked if p is not None]  # a list: dynamo traces it
        return _BACKENDS[max(available)[1]]
    chosen = get_backend(name)
    reason = chosen.refusal(request)
    if reason is not None:
        raise ValueError(
            f"backend {name!r} cannot run mode={request.mode!r}, top_k={request.top_k}, "
            f"local_only={request.local_only}, softcap={request.softcap}, sinks={request.sinks}, "
            f"documents={request.documents}, needs_grad={request.needs_grad}, "
            f"head_dim={request.head_dim} on {request.device} with {request.dtype}: it does not "
            f"take {reason}; use backend='auto'"
        )
    return chosen
