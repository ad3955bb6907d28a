"""Context parallelism for Focus attention: the sequence split over a process group.

Each rank holds a zigzag shard of every sequence (:mod:`focus_pretrain.parallel.sharding`:
Megatron's convention, chunks ``r`` and ``2 * CP - 1 - r`` of ``2 * CP``).

**Modes** (:func:`context_parallel_attention`):

* ``"a2a"`` (Ulysses): an all-to-all turns sequence-sharded ``q, k, v`` into head-sharded ones
  over the whole sequence, every rank runs :func:`focus_pretrain.focus.focus_attention` (any
  backend) on its slice of heads, and a second all-to-all turns the output back. The soft
  assignments are all-gathered (they are ``K`` numbers per token). GQA with fewer KV heads than
  ranks replicates KV heads before the exchange (gradients sum back through the replication).
* ``"ring"`` (:mod:`focus_pretrain.parallel.ring`): K/V blocks travel around the ring.

Routing needs no communication in the default causal mode (a token's groups depend on itself
only). Attention sinks (``sinks=S``) are the first ``S`` *global* positions in both modes: after
the all-to-all every rank holds the whole sequence in global order; in the ring, positions are
global and the sink keys travel with the block of the rank that holds them.

**Packed documents** (``documents=``): each rank passes its zigzag shard ``[b, s_loc]`` of the
document *starts* of the full sequence (``shard_sequence(document_starts(ids), 1, CP, rank)``,
:func:`~focus_pretrain.focus.pattern.document_starts`). Starts are global positions, so they
mean the same on every rank; document ids cannot be normalised per shard (a shard does not
know where the documents it continues began). The all-to-all gathers them (integers, no
gradient) into global order for :func:`focus_attention`; the ring sends them with their K/V
block and skips the blocks that hold no same-document causal pair (with short documents, most).
In both, the sinks are the first ``S`` tokens of each document. The routers are unchanged: the
default causal routing is per token, and its balance statistic does not depend on packing.
Layout: ``[batch, seq_local, heads, head_dim]`` in and out.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import all_to_all, gather_from_sequence_parallel_region
from torch import Tensor

from focus_pretrain.focus import Routing, focus_attention
from focus_pretrain.focus.backends import get_backend, ring_backend_names
from focus_pretrain.focus.gate_forms import attend_with_dot_gate
from focus_pretrain.focus.pattern_settings import PATTERN_FIELDS, FocusPattern, with_settings
from focus_pretrain.model.attention import FocusCoreAttention, FocusSelfAttention
from focus_pretrain.parallel.config import check_cp_heads, check_cp_seq_length
from focus_pretrain.parallel.ring import RingStats, check_document_starts, ring_focus_attention
from focus_pretrain.parallel.sharding import gather_sequence, rank_major_orders


def _seq_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[b, s_loc, H, D]`` sequence shards -> ``[b, S, H / CP, D]`` in global order."""
    cp_size = dist.get_world_size(group)
    b, s_loc, h, d = x.shape
    chunks = x.reshape(b, s_loc, cp_size, h // cp_size, d).permute(2, 0, 1, 3, 4)
    # [b, s, H, D] -> [CP (destination), b, s_loc, H/CP, D]
    received = all_to_all(group, chunks.contiguous().reshape(cp_size * b, s_loc, h // cp_size, d))
    received = received.reshape(cp_size, b, s_loc, h // cp_size, d).permute(1, 0, 2, 3, 4)
    full = received.reshape(b, cp_size * s_loc, h // cp_size, d)  # rank-major token order
    _, to_global = rank_major_orders(cp_size * s_loc, cp_size, x.device)
    return full.index_select(1, to_global)


def _heads_to_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[b, S, H / CP, D]`` in global order -> ``[b, s_loc, H, D]`` sequence shards."""
    cp_size = dist.get_world_size(group)
    b, total, h_part, d = x.shape
    s_loc = total // cp_size
    order, _ = rank_major_orders(total, cp_size, x.device)
    rank_major = x.index_select(1, order).reshape(b, cp_size, s_loc, h_part, d)
    chunks = rank_major.permute(1, 0, 2, 3, 4).contiguous()  # [CP (destination), b, s_loc, ...]
    received = all_to_all(group, chunks.reshape(cp_size * b, s_loc, h_part, d))
    received = received.reshape(cp_size, b, s_loc, h_part, d)  # [CP (head chunk), b, s_loc, ...]
    return received.permute(1, 2, 0, 3, 4).reshape(b, s_loc, cp_size * h_part, d)


def _kv_for_a2a(k: Tensor, heads: int, cp_size: int) -> Tensor:
    """KV heads such that splitting them ``cp_size`` ways matches the query heads' split."""
    hkv = k.shape[2]
    if hkv % cp_size == 0:
        return k
    repeat = cp_size // math.gcd(hkv, cp_size)  # smallest replication that divides evenly
    if (hkv * repeat) % cp_size != 0 or heads % (hkv * repeat) != 0:
        repeat = heads // hkv  # fall back to one KV head per query head
    return k.repeat_interleave(repeat, dim=2)  # [b, s, Hkv, D] -> [b, s, Hkv * repeat, D]


def _gather_probs(probs: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[b, s_loc, K]`` -> ``[b, S, K]`` (global order); the backward sums over ranks."""
    cp_size = dist.get_world_size(group)
    gathered = gather_from_sequence_parallel_region(probs.transpose(0, 1).contiguous(), True, group)
    full = gathered.transpose(0, 1)  # [CP * s_loc, b, K] -> [b, S, K] rank-major
    _, to_global = rank_major_orders(full.shape[1], cp_size, probs.device)
    return full.index_select(1, to_global)


def a2a_focus_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor | None,
    pattern: FocusPattern | None = None,
    *,
    group: dist.ProcessGroup,
    documents: Tensor | None = None,
    **attention_kwargs,
) -> Tensor:
    """Ulysses context parallelism: ``[b, s_loc, H, D]`` -> ``[b, s_loc, H, D]``.

    ``documents``: ``[b, s_loc]`` int64 document starts of this rank's tokens, all-gathered to
    ``[b, S]`` in global order. ``pattern`` and ``attention_kwargs`` go to
    :func:`focus_attention` (the pattern's settings, backend, check_finite, ...).
    """
    cp_size = dist.get_world_size(group)
    heads = q.shape[2]
    k, v = _kv_for_a2a(k, heads, cp_size), _kv_for_a2a(v, heads, cp_size)
    q_h, k_h, v_h = (_seq_to_heads(t, group) for t in (q, k, v))  # [b, S, H/CP, D]
    routing = None if probs is None else Routing(_gather_probs(probs, group))
    if documents is not None:
        documents = gather_sequence(documents, 1, group)  # [b, s_loc] -> [b, S] global order
        total = documents.shape[1]  # the whole sequence: the starts are checked exactly
        check_document_starts(
            documents, documents[..., None, None], torch.arange(total, device=documents.device)
        )
    out = focus_attention(
        q_h, k_h, v_h, routing, pattern, documents=documents, **attention_kwargs
    )  # [b, S, H/CP, D]
    return _heads_to_seq(out, group)


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor | None,
    pattern: FocusPattern | None = None,
    *,
    group: dist.ProcessGroup,
    cp_mode: str,
    stats: RingStats | None = None,
    documents: Tensor | None = None,
    backend: str = "auto",
    **options: Any,
) -> Tensor:
    """Focus attention of this rank's tokens over the whole (sharded) sequence.

    Args:
        q: ``[b, s_loc, H, D]``; k, v: ``[b, s_loc, Hkv, D]`` (this rank's zigzag shard).
        probs: ``[b, s_loc, K]`` soft assignments of this rank's tokens, or ``None``
            (``local_only``).
        pattern: the pattern to compute (a :class:`~focus_pretrain.focus.pattern_settings.
            FocusPattern`); ``options`` may name any of its settings in place of its own, as
            for :func:`focus_attention`. The ``dot`` gate form's channels are appended to this
            rank's tokens before the exchange.
        group: the context-parallel process group.
        cp_mode: ``"a2a"`` or ``"ring"``.
        stats: a :class:`~focus_pretrain.parallel.ring.RingStats` to count skipped ring blocks.
        documents: packed documents: ``[b, s_loc]`` integer document *starts* of this rank's
            tokens, i.e. this rank's zigzag shard of ``document_starts(ids)`` computed on the
            full sequence (:func:`~focus_pretrain.parallel.sharding.shard_sequence`), not
            per-token ids (they cannot be normalised per shard); ``None``: one document per
            sequence. The ring checks them against its positions
            (:func:`~focus_pretrain.parallel.ring.check_document_starts`).
        backend: as for :func:`focus_attention`; the ring computes every block with the exact
            per-block attention, so it takes only the backends
            :func:`~focus_pretrain.focus.backends.ring_backend_names`.
        options: the pattern's settings by name, ``check_finite``, and the ring's
            ``block_kernel``.

    Returns:
        ``[b, s_loc, H, D]``.
    """
    settings = {name: options.pop(name) for name in PATTERN_FIELDS if name in options}
    pattern = with_settings(pattern, settings, caller="context_parallel_attention")
    if pattern.gate_form == "dot" and not pattern.local_only:
        call = dict(group=group, cp_mode=cp_mode, stats=stats, documents=documents)
        return attend_with_dot_gate(
            functools.partial(context_parallel_attention, **call), q, k, v, probs, pattern,
            backend=backend, **options,
        )  # fmt: skip
    cp_size = dist.get_world_size(group)
    check_cp_seq_length(q.shape[1] * cp_size, cp_size)
    check_cp_heads(q.shape[2], 1, cp_size, cp_mode)  # q holds this TP rank's heads
    if documents is not None:
        documents = check_document_starts(documents, q)  # [b, s_loc] int64
    if cp_mode == "a2a":
        options.pop("block_kernel", None)  # the ring's per-block kernel: no ring here
        return a2a_focus_attention(
            q, k, v, probs, pattern, group=group, documents=documents, backend=backend, **options
        )
    kernel = ring_block_kernel(backend)
    given = options.setdefault("block_kernel", kernel)
    if kernel != "auto" and given != kernel:
        raise ValueError(
            f"backend {backend!r} runs the ring's {kernel!r} block kernel, not "
            f"block_kernel={given!r}: name one of them"
        )
    return ring_focus_attention(
        q, k, v, probs, pattern, group=group, stats=stats, documents=documents, **options
    )


def ring_block_kernel(backend: str) -> str:
    """The ring steps' per-block kernel for the attention ``backend`` a recipe names: the one
    it names, never another (its ``ring_block`` in the backend table). ``"reference"``: the
    reference's exact blockwise PyTorch attention (on CUDA too); ``"flex"``: FlexAttention with
    a block mask; ``"triton"``: the fused Triton kernels (soft and sliding-window steps);
    ``"auto"``: the table's choice for each call
    (:func:`~focus_pretrain.focus.backends.select_ring_block`: FlexAttention on CUDA, blockwise
    elsewhere).

    Raises:
        ValueError: a backend that has no per-block form in the ring.
    """
    if backend == "auto":
        return "auto"
    if backend not in ring_backend_names():
        raise ValueError(
            f"backend {backend!r} cannot run inside the ring (each ring step runs the exact "
            f"per-block attention); use one of {', '.join(ring_backend_names())} or cp_mode "
            "'a2a'"
        )
    return get_backend(backend).ring_block


def _column_logsumexp(group: dist.ProcessGroup):
    """Sinkhorn's column ``logsumexp`` over the whole sequence: ``[b, s_loc, K] -> [b, 1, K]``."""

    def reduce(log_p: Tensor) -> Tensor:
        local = torch.logsumexp(log_p, dim=1, keepdim=True)  # [b, 1, K]
        gathered = gather_from_sequence_parallel_region(
            local.transpose(0, 1).contiguous(), True, group
        )
        return torch.logsumexp(gathered, dim=0, keepdim=True).transpose(0, 1)  # [b, 1, K]

    return reduce


def apply_context_parallel(model: torch.nn.Module, group: dist.ProcessGroup, cp_mode: str):
    """Make every Focus layer of ``model`` attend over the whole context-parallel sequence.

    Installs :func:`context_parallel_attention` as each core attention's ``attention_fn``
    (``documents=``, this rank's shard of the document starts, is passed through) and gives
    the routers Sinkhorn's column reduction over the group, so that CP = N routes
    (``sinkhorn`` mode) and collects balance statistics (``causal`` mode) exactly like CP = 1.
    The column reduction is over the whole sequence, not per document: per-document Sinkhorn
    with packed documents is the router's to refuse under context parallelism.
    The model must have been built with ``context_parallel_size`` equal to the group's size, and
    its inputs sharded with :func:`~focus_pretrain.parallel.sharding.shard_sequence`. Returns the
    :class:`~focus_pretrain.parallel.ring.RingStats` the layers count into (ring mode).
    """
    cp_size = dist.get_world_size(group)
    stats = RingStats()

    def attention(q, k, v, routing, pattern=None, documents=None, **kwargs) -> Tensor:
        probs = routing.probs if isinstance(routing, Routing) else routing
        return context_parallel_attention(
            q, k, v, probs, pattern, group=group, cp_mode=cp_mode, stats=stats,
            documents=documents, **kwargs,
        )  # fmt: skip

    def route_options(local_len: int) -> dict:
        return dict(column_logsumexp=_column_logsumexp(group), num_tokens=local_len * cp_size)

    found = 0
    for module in model.modules():
        if isinstance(module, FocusCoreAttention):
            if module.config.context_parallel_size != cp_size:
                raise ValueError(
                    f"the model was built with context_parallel_size "
                    f"{module.config.context_parallel_size}, the group has {cp_size} ranks"
                )
            module.attention_fn = attention
            found += 1
        if isinstance(module, FocusSelfAttention):
            module.route_options = route_options
    if not found:
        raise ValueError("apply_context_parallel found no Focus attention layer in the model")
    return stats
