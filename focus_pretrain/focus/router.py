"""The Focus router: per-layer projection, learned centroids, balanced soft and hard groups.

Layout: the router reads the layer's *normalised* hidden states ``[b, s, d]`` (the same tensor
that feeds Q/K/V) and returns a :class:`Routing` holding the soft assignment ``[b, s, K]``.

Routing logits are ``a_ik = <W_g h_i, c_k> / tau`` (``W_g``: ``d -> d_g``, no bias; ``c``:
``K x d_g`` centroids), by default on unit vectors (cosine similarity, ``normalize=True``) so that
``tau`` sets the sharpness and Sinkhorn converges in the paper's 10 iterations. Two balance
modes:

* ``causal`` (default): ``g_i = softmax(a_i + b)`` from the token's own logits only, so routing
  never sees the future. ``b`` is a per-layer K-vector of *balance offsets*, not trained by
  gradient: while training, each forward runs log-domain Sinkhorn over the (detached) logits of
  the whole micro-batch and accumulates its column potentials, the offsets that would make
  ``softmax(a + b)`` exactly balanced on that batch; :meth:`FocusRouter.update_balance`, called
  after each optimizer step, moves ``b`` toward their mean by ``balance_rate``.
* ``sinkhorn`` (the paper's): log-domain Sinkhorn over the tokens of each sequence, rows summing
  to 1 and columns to ``n / K``. Token ``i``'s group depends on tokens after ``i`` through the
  column sums: **not causal**; perplexity measured with it leaks the future.

  With packed documents (``documents=``, document starts ``[b, s]``) Sinkhorn normalises each
  document on its own (columns to ``n_doc / K``), so a document is routed as if alone.

Packing never couples documents in ``causal`` mode: a token's groups depend on itself only,
and the balance statistic treats the whole micro-batch as one set of tokens, whether its
documents are packed or not.

* ``none`` (ablation): ``g_i = softmax(a_i)``, no balancing at all; the paper's point is that
  this collapses onto few groups.

The hard pattern keeps each token's ``top_k`` groups (:meth:`Routing.membership`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from focus_pretrain.focus.compiled import fused_on_cuda
from focus_pretrain.focus.pattern import compute_dtype, membership_bitmask
from focus_pretrain.validation import check_choice, check_int, check_positive

if TYPE_CHECKING:  # the config reads this module's limits: no import back at run time
    from focus_pretrain.focus.config import FocusConfig

BALANCE_MODES = ("causal", "sinkhorn", "none")
MAX_GROUPS = 64  # hard membership is an int64 bitmask, one bit per group

ColumnLogSumExp = Callable[[Tensor], Tensor]
GatherTokens = Callable[[Tensor], Tensor]


class Routing(NamedTuple):
    """One layer's routing.

    A ``NamedTuple`` so that module hooks that walk outputs (DeepSpeed ZeRO-3 re-gathers the
    router's partitioned weights for backward through such hooks) see the tensor inside.

    Attributes:
        probs: ``[b, s, K]`` soft group assignment ``g`` (each row sums to 1); differentiable.
    """

    probs: Tensor

    @property
    def num_groups(self) -> int:
        return self.probs.shape[-1]

    def top_groups(self, top_k: int) -> Tensor:
        """``[b, s, top_k]`` int64: each token's ``top_k`` most probable groups, best first."""
        check_int("top_k", top_k, low=1, high=self.num_groups, high_name="num_groups (K)")
        return self.probs.detach().topk(top_k, dim=-1).indices

    def membership(self, top_k: int) -> Tensor:
        """``[b, s]`` int64 bitmask of each token's ``top_k`` groups (the hard pattern); on CUDA
        the top-k and the packing run as one compiled program (:func:`hard_membership`)."""
        check_int("top_k", top_k, low=1, high=self.num_groups, high_name="num_groups (K)")
        return hard_membership(self.probs.detach(), top_k)


@fused_on_cuda
def hard_membership(probs: Tensor, top_k: int) -> Tensor:
    """``[b, s, K]`` soft assignments -> ``[b, s]`` int64 bitmask of each token's ``top_k`` most
    probable groups: top-k and bit packing fused on CUDA (a few launches become one), traced
    into a caller's compiled graph; eager elsewhere (:func:`~focus_pretrain.focus.compiled.
    fused_on_cuda`)."""
    return membership_bitmask(probs.topk(top_k, dim=-1).indices)  # [b, s, top_k] -> [b, s]


@dataclass
class GroupLoad:
    """How tokens spread over groups (for logging collapse).

    Attributes:
        fraction: ``[K]`` fraction of tokens whose top-1 group is ``k``.
        soft_fraction: ``[K]`` mean soft assignment per group.
        max_share: largest entry of ``fraction`` (``1/K`` is perfect balance, 1 is collapse).
    """

    fraction: Tensor
    soft_fraction: Tensor
    max_share: float


def group_load(routing: Routing | Tensor) -> GroupLoad:
    """Load statistics of a routing (or of soft assignments ``[b, s, K]``)."""
    probs = (routing.probs if isinstance(routing, Routing) else routing).detach().float()
    k = probs.shape[-1]
    flat = probs.reshape(-1, k)  # [b*s, K]
    counts = torch.bincount(flat.argmax(dim=-1), minlength=k).double()
    fraction = counts / max(flat.shape[0], 1)
    return GroupLoad(fraction, flat.mean(dim=0), float(fraction.max()))


def sinkhorn_log(
    logits: Tensor,
    iters: int,
    *,
    column_logsumexp: ColumnLogSumExp | None = None,
    num_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-domain Sinkhorn over the sequence: rows sum to 1, columns to ``n / K``.

    Args:
        logits: ``[b, s, K]`` routing logits (fp32 recommended).
        iters: number of (column, row) normalisation rounds; the last step normalises rows, so
            rows sum to 1 exactly and columns to ``n / K`` approximately.
        column_logsumexp: replaces ``logsumexp`` over the sequence dim (``[b, s, K] -> [b, 1, K]``),
            so a context-parallel caller can reduce over its whole sequence. Default: local.
        num_tokens: the ``n`` of the column target (default ``s``; the global length under CP).

    Returns:
        ``(log_p [b, s, K], column_potential [b, K])``: ``log_p`` is the log assignment;
        the potential ``v`` (centred) is such that ``softmax(logits + v)`` equals ``exp(log_p)``.
    """
    check_int("iters", iters, low=1)
    lse_columns = column_logsumexp or (lambda x: torch.logsumexp(x, dim=1, keepdim=True))
    n = logits.shape[1] if num_tokens is None else num_tokens
    log_target = math.log(n / logits.shape[-1])
    log_p = logits
    potential = torch.zeros_like(logits[:, :1, :])  # [b, 1, K]
    for _ in range(iters):
        shift = log_target - lse_columns(log_p)  # [b, 1, K]
        potential = potential + shift
        log_p = log_p + shift
        log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)  # rows sum to 1
    potential = potential.squeeze(1)  # [b, K]
    return log_p, potential - potential.mean(dim=-1, keepdim=True)


def document_logsumexp(x: Tensor, documents: Tensor) -> Tensor:
    """``logsumexp`` over the tokens of each document, broadcast back to its tokens.

    Args:
        x: ``[b, s, K]``; documents: ``[b, s]`` int64 document starts (positions in ``[0, s)``).

    Returns:
        ``[b, s, K]``: row ``t`` holds the column logsumexp of ``t``'s document. Differentiable.
    """
    index = documents[..., None].expand_as(x)  # [b, s, K]: each token's document slot
    top = torch.full_like(x, float("-inf")).scatter_reduce(1, index, x.detach(), "amax")
    top = top.gather(1, index)  # [b, s, K] per-document max (a constant for the gradient)
    sums = torch.zeros_like(x).scatter_add(1, index, torch.exp(x - top))
    return top + sums.gather(1, index).log()


def sinkhorn_documents(logits: Tensor, iters: int, documents: Tensor) -> Tensor:
    """:func:`sinkhorn_log` on each document of packed sequences: ``[b, s, K] -> log_p``.

    Columns sum to ``n_doc / K`` inside each document (``documents``: ``[b, s]`` int64 starts),
    rows to 1; equal to running :func:`sinkhorn_log` on every document alone.
    """
    check_int("iters", iters, low=1)
    ones = torch.ones_like(documents, dtype=logits.dtype)  # [b, s]
    sizes = torch.zeros_like(ones).scatter_add(1, documents, ones).gather(1, documents)
    log_target = torch.log(sizes / logits.shape[-1])[..., None]  # [b, s, 1]
    log_p = logits
    for _ in range(iters):
        log_p = log_p + (log_target - document_logsumexp(log_p, documents))
        log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)  # rows sum to 1
    return log_p


class FocusRouter(nn.Module):
    """Per-layer router: ``[b, s, d]`` normalised hidden states -> :class:`Routing`.

    Parameters: ``proj.weight`` ``[d_g, d]`` and ``centroids`` ``[K, d_g]``, i.e.
    ``d * d_g + K * d_g`` per layer. Buffer ``balance_offsets`` ``[K]`` (``causal`` mode; saved in
    checkpoints, never touched by the optimizer). Routing maths runs in fp32 whatever the
    parameter dtype.
    """

    def __init__(
        self,
        hidden_size: int,
        num_groups: int = 8,
        group_dim: int = 16,
        tau: float = 0.1,
        balance: str = "causal",
        sinkhorn_iters: int = 10,
        balance_rate: float = 0.1,
        normalize: bool = True,
        check_finite: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_int("hidden_size", hidden_size, low=1)
        check_int("num_groups (K)", num_groups, low=1, high=MAX_GROUPS)
        check_int("group_dim (d_g)", group_dim, low=1)
        check_int("sinkhorn_iters", sinkhorn_iters, low=1)
        check_positive("tau", tau)
        check_positive("balance_rate", balance_rate)
        if balance_rate > 1:
            raise ValueError(f"balance_rate must be in (0, 1], got {balance_rate}")
        check_choice("balance", balance, BALANCE_MODES)
        self.hidden_size, self.num_groups, self.group_dim = hidden_size, num_groups, group_dim
        self.tau, self.balance, self.sinkhorn_iters = tau, balance, sinkhorn_iters
        self.balance_rate, self.normalize, self.check_finite = balance_rate, normalize, check_finite
        factory = {"device": device, "dtype": dtype}
        self.proj = nn.Linear(hidden_size, group_dim, bias=False, **factory)
        self.centroids = nn.Parameter(torch.empty(num_groups, group_dim, **factory))
        self.register_buffer("balance_offsets", torch.zeros(num_groups, device=device))
        # Sinkhorn column potentials accumulated since the last update_balance (not saved).
        self.register_buffer("_target_sum", torch.zeros(num_groups, device=device), False)
        self.register_buffer("_target_count", torch.zeros((), device=device), False)
        # top-1 group counts of training forwards since the last pop_load (for logging)
        self.register_buffer("_load_counts", torch.zeros(num_groups, device=device), False)
        self.reset_parameters()

    @classmethod
    def from_config(cls, config: FocusConfig, hidden_size: int, **factory) -> FocusRouter:
        """Build from a :class:`FocusConfig` (``device``/``dtype`` may be passed through)."""
        return cls(
            hidden_size,
            num_groups=config.num_groups,
            group_dim=config.group_dim,
            tau=config.tau,
            balance=config.balance,
            sinkhorn_iters=config.sinkhorn_iters,
            balance_rate=config.balance_rate,
            normalize=config.normalize,
            check_finite=config.check_finite,
            **factory,
        )

    def reset_parameters(self) -> None:
        """``W_g ~ N(0, 1/d)`` (unit-variance projections of unit-RMS inputs) and centroids
        ``~ N(0, 1/d_g)`` (unit-norm on average); offsets and accumulators to zero."""
        nn.init.normal_(self.proj.weight, std=self.hidden_size**-0.5)
        nn.init.normal_(self.centroids, std=self.group_dim**-0.5)
        for buf in (self.balance_offsets, self._target_sum, self._target_count, self._load_counts):
            buf.zero_()

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, K={self.num_groups}, d_g={self.group_dim}, "
            f"tau={self.tau}, balance={self.balance!r}"
        )

    def logits(self, hidden: Tensor, gather_tokens: GatherTokens | None = None) -> Tensor:
        """Routing logits ``<W_g h_i, c_k> / tau``: ``[b, s, d] -> [b, s, K]``, at least fp32.

        ``gather_tokens`` (``[b, s_part, d_g] -> [b, s, d_g]``): ``hidden`` is one part of the
        sequence; its projection is gathered into the whole sequence before the rest.
        """
        if hidden.dim() != 3 or hidden.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden must be [batch, seq, hidden_size={self.hidden_size}], "
                f"got shape {tuple(hidden.shape)}"
            )
        dtype = compute_dtype(hidden.dtype, self.proj.weight.dtype)
        projected = F.linear(hidden.to(dtype), self.proj.weight.to(dtype))  # [b, s, d_g]
        if gather_tokens is not None:
            projected = gather_tokens(projected)  # [b, s_part, d_g] -> [b, s, d_g]
        # a NaN/inf in the input reaches its projection (d_g wide: a cheaper check); checked
        # after any gather, so that every rank of a split sequence raises together
        if self.check_finite and not torch.isfinite(projected).all():
            raise ValueError("hidden (router input) contains NaN or inf values")
        centroids = self.centroids.to(dtype)
        if self.normalize:
            projected = F.normalize(projected, dim=-1)
            centroids = F.normalize(centroids, dim=-1)
        return projected @ centroids.t() / self.tau  # [b, s, K]

    def forward(
        self,
        hidden: Tensor,
        *,
        column_logsumexp: ColumnLogSumExp | None = None,
        num_tokens: int | None = None,
        documents: Tensor | None = None,
        gather_tokens: GatherTokens | None = None,
    ) -> Routing:
        """Route ``hidden`` ``[b, s, d]``. ``column_logsumexp``/``num_tokens`` (see
        :func:`sinkhorn_log`) make Sinkhorn see a sequence split over ranks: the routing in
        ``sinkhorn`` mode, the balance statistic in ``causal`` mode. ``documents`` (``[b, s]``
        int64 document starts of packed sequences) makes ``sinkhorn`` routing per document.
        ``gather_tokens`` (``[b, s_part, d_g] -> [b, s, d_g]``): ``hidden`` is ``[b, s_part,
        d]``, one part of the sequence (Megatron sequence parallelism); the per-token
        projection ``W_g h`` runs on it and is gathered, everything after on the whole
        sequence, which the returned routing ``[b, s, K]`` covers. ``proj.weight``'s gradient
        is then this part's share only: the caller sums it over the parts' ranks."""
        logits = self.logits(hidden, gather_tokens)
        if self.balance == "sinkhorn" and documents is not None:
            if column_logsumexp is not None:
                raise ValueError(
                    "balance 'sinkhorn' with packed documents under context parallelism is not "
                    "supported (Sinkhorn would need per-document sums across ranks); use "
                    "model.focus.balance=causal (the default), or data.document_mask=false"
                )
            routing = Routing(sinkhorn_documents(logits, self.sinkhorn_iters, documents).exp())
        elif self.balance == "sinkhorn":
            log_p, _ = sinkhorn_log(
                logits,
                self.sinkhorn_iters,
                column_logsumexp=column_logsumexp,
                num_tokens=num_tokens,
            )
            routing = Routing(log_p.exp())
        else:
            if self.training and self.balance == "causal":
                self._accumulate_balance_target(logits.detach(), column_logsumexp, num_tokens)
            routing = Routing(torch.softmax(logits + self.balance_offsets, dim=-1))
        if self.training:
            self._count_load(routing.probs.detach())
        return routing

    @torch.no_grad()
    def _count_load(self, probs: Tensor) -> None:
        top1 = probs.reshape(-1, self.num_groups).argmax(dim=-1)  # [b*s]
        # index_add_ rather than bincount: bincount syncs with the host on CUDA (twice per
        # layer and micro-batch)
        ones = torch.ones_like(top1, dtype=self._load_counts.dtype)
        self._load_counts.index_add_(0, top1, ones)

    @torch.no_grad()
    def pop_load(self) -> Tensor:
        """Top-1 group counts ``[K]`` of training forwards since the last call (then reset)."""
        counts = self._load_counts.clone()
        self._load_counts.zero_()
        return counts

    @torch.no_grad()
    def _accumulate_balance_target(
        self,
        logits: Tensor,
        column_logsumexp: ColumnLogSumExp | None = None,
        num_tokens: int | None = None,
    ) -> None:
        b, s, _ = logits.shape
        flat = logits.reshape(1, b * s, self.num_groups)  # the micro-batch as one "sequence"
        _, potential = sinkhorn_log(
            flat,
            self.sinkhorn_iters,
            column_logsumexp=column_logsumexp,
            num_tokens=None if num_tokens is None else b * num_tokens,
        )
        self._target_sum += potential[0]
        self._target_count += 1

    @torch.no_grad()
    def balance_target(self) -> Tensor | None:
        """Mean column potential since the last update (``[K]``), or ``None`` if none seen.
        Reads a count back to the host: for inspection; a training step uses
        :meth:`balance_statistics` and :meth:`apply_balance`, which stay on the device."""
        if float(self._target_count) == 0:
            return None
        return self._target_sum / self._target_count

    @torch.no_grad()
    def balance_statistics(self) -> Tensor:
        """``[K + 1]`` on the device: the mean column potential since the last update (zeros if
        none was seen), then 1 if one was seen, else 0. Rows of several routers and ranks
        add up: sum them (one collective for every layer) and pass ``sum[:K] / sum[K]`` and
        ``sum[K] > 0`` to :meth:`apply_balance`. No host round trip."""
        seen = (self._target_count > 0).to(self._target_sum.dtype)
        mean = self._target_sum / self._target_count.clamp(min=1)
        return torch.cat([mean * seen, seen[None]])

    @torch.no_grad()
    def discard_balance_target(self) -> None:
        """Forget what was accumulated since the last update without moving the offsets (the
        trainer's skipped bad step: its batch must leave no trace)."""
        self._target_sum.zero_()
        self._target_count.zero_()

    @torch.no_grad()
    def apply_balance(self, target: Tensor, seen: Tensor | bool = True) -> None:
        """Move ``balance_offsets`` toward ``target`` (``[K]``) where ``seen`` (a device bool:
        the offsets stay put when no rank saw a batch), then clear the accumulators. No-op in
        ``sinkhorn`` mode. Never reads a value back to the host."""
        if self.balance != "causal":
            return
        step = self.balance_rate * (target.to(self.balance_offsets.dtype) - self.balance_offsets)
        self.balance_offsets += step * torch.as_tensor(seen, device=step.device)
        self.discard_balance_target()

    @torch.no_grad()
    def update_balance(self, target: Tensor | None = None) -> None:
        """Move ``balance_offsets`` toward equal load; call after each optimizer step.

        ``target`` defaults to this router's own statistics (:meth:`balance_statistics`; a
        data-parallel trainer sums them over ranks, :func:`~focus_pretrain.train.focus_stats.
        update_balance`). No-op in ``sinkhorn`` mode or when nothing was accumulated.
        """
        if target is not None:
            self.apply_balance(target)
            return
        stats = self.balance_statistics()
        self.apply_balance(stats[:-1], stats[-1] > 0)


def router_parameter_count(num_layers: int, hidden_size: int, group_dim: int, k: int) -> int:
    """Trainable parameters of a stack of routers: ``L * (d * d_g + K * d_g)``."""
    return num_layers * (hidden_size * group_dim + k * group_dim)
