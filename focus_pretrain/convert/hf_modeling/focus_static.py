"""Focus attention with transformers' static KV cache: fixed shapes, no host reads, capturable.

Shipped inside exported directories next to ``modeling_focus.py``; imports only torch and
transformers.

With a ``StaticCache`` (``generate(..., cache_implementation="static")``, or a ``StaticCache``
passed as the cache) the routing of the cached keys lives on the cache layer
(:class:`FocusStaticLayer`, the class a ``StaticLayer`` becomes on its first Focus call) in
buffers of length ``L`` written at the step's slots with ``index_copy_``, with the cache
position each slot holds (``focus_origin``) and whether it is a sink. An eager prefill (several
tokens written from slot 0) runs its tokens among themselves (``whole_sequence``: the caller's
fast or dense path) and, with the hard pattern, sorts a Focus layer's prompt slots by group
(``focus_static_sparse``). Every other step attends over the cache's whole preallocated length
``L``, as transformers' own static-cache attention does, with the Focus pattern built on the
device from the slots' positions: causal, real keys only (not padding), HF's mask read through
the positions, and then, for a Focus layer's hard pattern, the local window, the keys sharing
one of the query's top-k groups and the row's first ``S`` real tokens (the sinks); the soft
pattern gates the rest (an eager chunk after the prompt in blocks of query rows,
``MASKED_STEP_ELEMENTS`` scores each). So a step has the same shapes every time, reads no
tensor on the host and has no per-row Python loop: the decode step compiles whole
(``torch.compile(fullgraph=True)``) and can be captured in a CUDA graph; compiled, a hard
step runs block-sparse (``focus_static_sparse.sparse_static_attention``: the blocks holding a
kept key only), and so does a window-only twin's step (its window's and sinks' blocks).

The step's cache slots come from the cache layer's ``cumulative_length`` tensor where the
release counts the cached tokens on the device (5.24: the keys were just written at its previous
value) or else from the ``cache_position`` the attention module received (5.0: captured by its
forward pre-hook; the keys were written there). Only a static layer of full attention can hold
the routing: a sliding-window static layer (Gemma-2/3's local layers) is refused.

Layouts: HF ``[b, heads, seq, d]`` for queries, keys and values; routing ``[b, L, K]``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import StaticLayer

from .focus_rules import dot_gate, groups_intersect, key_routing, soft_cap, soft_gate
from .focus_static_sparse import (
    MAX_SPARSE_QUERIES,
    crop_sorted,
    flex_ready,
    sort_by_groups,
    sparse_static_attention,
)

# an eager step of several tokens after the prompt attends over the cache in blocks of query
# rows of at most this many fp32 scores each (2**26: 256 MiB)
MASKED_STEP_ELEMENTS = 2**26

try:  # is the running code being traced by dynamo (then no static-address marks)?
    from torch.compiler import is_compiling as _is_compiling
except ImportError:  # pragma: no cover - older torch
    from torch._dynamo import is_compiling as _is_compiling


class FocusStaticLayer(StaticLayer):
    """``StaticLayer`` that also holds the Focus routing of its keys, preallocated.

    Attributes:
        focus_probs: ``[b, L, K]`` group probabilities of the cached keys (``None`` before the
            first Focus call).
        focus_members: ``[b, L]`` int64 bitmask of each key's top-k groups.
        focus_valid: ``[b, L]`` bool, False for padding and for slots never written.
        focus_origin: ``[b, L]`` int64, the cache position each slot holds: the slot itself,
            until a prefill's slots are sorted by group (``focus_static_sparse``).
        focus_sink: ``[b, L]`` bool, the row's first ``S`` real tokens (attention sinks).
        focus_sorted: how many leading slots are sorted by group (a host int).
    """

    _layer_type = None  # never registered as the default layer of a cache type

    def focus_init(self) -> None:
        """No routing yet (allocated by the first :meth:`focus_store`)."""
        self.focus_probs = self.focus_members = self.focus_valid = None
        self.focus_origin = self.focus_sink = None
        self.focus_sorted = 0

    def focus_buffers(self) -> tuple[Tensor, ...]:
        """The routing buffers, each ``[b, L, ...]`` (none before the first Focus call)."""
        if self.focus_probs is None:
            return ()
        return (
            self.focus_probs,
            self.focus_members,
            self.focus_valid,
            self.focus_origin,
            self.focus_sink,
        )

    def _focus_allocate(self, probs: Tensor) -> None:
        b, _, groups = probs.shape
        length, device = self.max_cache_len, probs.device
        self.focus_probs = probs.new_zeros(b, length, groups)  # [b, L, K]
        self.focus_members = torch.zeros(b, length, dtype=torch.long, device=device)
        self.focus_valid = torch.zeros(b, length, dtype=torch.bool, device=device)
        self.focus_origin = torch.arange(length, device=device).repeat(b, 1)  # [b, L]
        self.focus_sink = torch.zeros(b, length, dtype=torch.bool, device=device)
        if not _is_compiling():  # fixed addresses: no recompilation, CUDA-graph safe
            for buffer in self.focus_buffers():
                torch._dynamo.mark_static_address(buffer)

    def focus_store(
        self, slots: Tensor, probs: Tensor, members: Tensor, valid: Tensor, sinks: int = 0
    ) -> None:
        """Write the routing of this step's tokens (``[b, q, K]``, ``[b, q]``, ``[b, q]``) at the
        cache ``slots [q]`` (allocating the ``[b, L]`` buffers on the first call). A step at
        slot 0 starts a new sequence: the earlier routing is forgotten first (on the device,
        for a cache refilled without ``reset()``). A new token is a sink when fewer than
        ``sinks`` real tokens come before it."""
        if self.focus_probs is None:
            self._focus_allocate(probs)
        first = slots[:1]  # [1]
        restart = first == 0  # [1], on the device: no host read
        self.focus_valid.masked_fill_(restart, False)
        identity = torch.arange(self.max_cache_len, device=slots.device)  # [L]
        self.focus_origin.copy_(torch.where(restart, identity, self.focus_origin))
        before = (self.focus_valid & (self.focus_origin < first)).sum(dim=1, keepdim=True)
        sink = valid & (before + valid.long().cumsum(dim=1) <= sinks)  # [b, q]
        origin = slots[None].expand(valid.shape[0], -1)  # [b, q]: written at its position
        new = (probs.to(self.focus_probs.dtype), members, valid, origin, sink)
        for buffer, values in zip(self.focus_buffers(), new, strict=True):
            buffer.index_copy_(1, slots, values)

    def keys_routing(
        self, key_groups: str, with_probs: bool = True
    ) -> tuple[Tensor | None, Tensor]:
        """``(probs [b, L, K], members [b, L])``: the groups each slot's key counts in under
        ``key_groups``: its own (``"own"``: the buffers themselves), or with
        ``"own_and_previous"`` also its predecessor's (``focus_rules.key_routing`` applied in
        position order: the slots' positions ``focus_origin`` are a permutation of ``0 .. L-1``
        per row, so the routing is gathered by position and the keys' put back by slot; on the
        device, fixed shapes). ``with_probs=False``: the bitmasks only (probs ``None``)."""
        if key_groups == "own":
            return self.focus_probs if with_probs else None, self.focus_members
        origin = self.focus_origin  # [b, L]: the position each slot holds
        slots = torch.arange(origin.shape[1], device=origin.device).expand_as(origin)  # [b, L]
        slot = torch.empty_like(origin).scatter_(1, origin, slots)  # [b, L]: each position's
        groups = self.focus_probs.shape[-1]
        probs = None
        if with_probs:  # by position
            probs = self.focus_probs.gather(1, slot[..., None].expand(-1, -1, groups))
        members, valid = self.focus_members.gather(1, slot), self.focus_valid.gather(1, slot)
        probs, members = key_routing(probs, members, valid, key_groups)  # [b, L, K], [b, L]
        if probs is not None:  # by slot again
            probs = probs.gather(1, origin[..., None].expand(-1, -1, groups))
        return probs, members.gather(1, origin)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the keys (transformers) and their routing (in place) for beam search."""
        super().reorder_cache(beam_idx)
        for buffer in self.focus_buffers():
            buffer.copy_(buffer.index_select(0, beam_idx.to(buffer.device)))

    def crop(self, tokens_to_remove: int) -> None:
        """Crop (transformers >= 5.x's static layers), first putting a prompt's group-sorted
        slots back in cache order where the crop reaches into them."""
        if tokens_to_remove < 0 and self.focus_sorted:
            crop_sorted(self, int(self.get_seq_length()) + tokens_to_remove)
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        """Reset the keys (transformers) and forget the routing (buffers kept, zeroed)."""
        super().reset()
        for buffer in self.focus_buffers():
            buffer.zero_()
        if self.focus_origin is not None:
            self.focus_origin.copy_(
                torch.arange(self.max_cache_len, device=self.focus_origin.device)
            )
        self.focus_sorted = 0


def static_focus_layer(cache, layer_idx: int) -> FocusStaticLayer | None:
    """This layer's :class:`FocusStaticLayer` when ``cache`` is a static one, else ``None`` (no
    cache, or a dynamic one: ``focus_cache`` handles those).

    Raises:
        ValueError: a static layer kind that cannot hold the routing (sliding-window, indexed).
    """
    if cache is None:
        return None
    cache = getattr(cache, "self_attention_cache", cache)  # GPT-2's EncoderDecoderCache
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    layer = layers[layer_idx]
    if type(layer) is StaticLayer:  # adopted once, eagerly (the prefill)
        layer.__class__ = FocusStaticLayer
        layer.focus_init()
    if isinstance(layer, FocusStaticLayer):
        return layer
    if isinstance(layer, StaticLayer):
        raise ValueError(
            "Focus attention keeps each key's routing in the KV cache, which "
            f"{type(layer).__name__} ({type(cache).__name__}) cannot hold; use the default "
            "dynamic cache (DynamicCache, generate's default) or a StaticCache of "
            "full-attention layers, not a sliding one"
        )
    return None


def step_slots(layer: FocusStaticLayer, q_len: int, cache_position: Tensor | None) -> Tensor:
    """``[q]`` int64 cache slots of this step's tokens, on the device, without a host read.

    Raises:
        ValueError: neither a device length on the layer nor a ``cache_position``.
    """
    count = getattr(layer, "cumulative_length", None)
    if isinstance(count, Tensor):  # already advanced past this step's tokens
        return count - q_len + torch.arange(q_len, device=count.device)
    if cache_position is not None:
        return cache_position.reshape(-1)[-q_len:].long()  # [q]
    raise ValueError(
        "a static cache step without cache_position: this transformers release passes the "
        "attention neither; use the default dynamic cache"
    )


def row_sinks(valid: Tensor, sinks: int) -> Tensor:
    """``[b, L]`` bool: each row's first ``sinks`` real keys (``valid [b, L]``, slots in cache
    order: a layer without routing, never sorted)."""
    return valid & (valid.long().cumsum(dim=1) <= sinks)


def static_mask(
    slots: Tensor,
    origin: Tensor,
    allowed: Tensor | None,
    valid: Tensor,
    sink: Tensor,
    *,
    window: int | None,
    sliding_window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``(causal, local)``: the pairs of this step's queries (``slots [q]``) and the ``L``
    cache slots (holding positions ``origin [b|1, L]``) that may be attended, ``[b, q, L]`` bool
    (causal w.r.t. the positions, HF's mask ``allowed [b, q, L]`` read through ``origin`` when
    given, real keys ``valid [b, L]``; a family's sliding window), and those in the Focus
    window (``window=None``: all of ``causal``) or sinks (``sink [b, L]``)."""
    distance = slots[None, :, None] - origin[:, None, :]  # [b|1, q, L]
    causal = (distance >= 0) & valid[:, None, :]  # [b, q, L]
    if sliding_window is not None:  # HF's window counts the token itself
        causal = causal & (distance < sliding_window)
    if allowed is not None:
        causal = causal & allowed
    near = (distance <= window) if window is not None else torch.ones_like(causal)
    local = causal & (near | sink[:, None, :])  # [b, q, L]
    return causal, local


def static_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: Tensor,
    *,
    scale: float,
    softcap: float | None,
    term: Tensor | None = None,
) -> Tensor:
    """Masked attention over the whole static length: ``query [b, H, q, d]``, ``key/value
    [b, G, L, d]``, ``bias [b, q, L]`` (0 / gate where attended, ``-inf`` elsewhere) ->
    ``[b, q, H, d]``; a query with no key outputs zeros. GQA without repeating the keys.
    ``term [b, q, L]``: the dot gate form's logit term, added before soft-capping."""
    b, heads, q_len, d = query.shape
    groups = key.shape[1]
    dtype = torch.promote_types(query.dtype, torch.float32)
    q = query.to(dtype).reshape(b, groups, heads // groups * q_len, d)  # [b, G, H/G*q, d]
    scores = torch.matmul(q, key.to(dtype).transpose(2, 3)) * scale  # [b, G, H/G*q, L]
    scores = scores.reshape(b, heads, q_len, -1)  # [b, G, H/G*q, L] -> [b, H, q, L]
    if term is not None:
        scores = scores + term[:, None].to(dtype)
    scores = soft_cap(scores, softcap) + bias[:, None].to(dtype)
    weights = torch.softmax(scores, dim=-1)
    attends = bias.amax(dim=-1, keepdim=True) > float("-inf")  # [b, q, 1]: some key allowed
    weights = torch.where(attends[:, None], weights, 0.0)  # no key: zero output, no NaN
    weights = weights.reshape(b, groups, heads // groups * q_len, -1)  # [b, G, H/G*q, L]
    out = torch.matmul(weights, value.to(dtype))  # [b, G, H/G*q, d]
    out = out.reshape(b, heads, q_len, d)  # [b, G, H/G*q, d] -> [b, H, q, d]
    return out.to(query.dtype).transpose(1, 2).contiguous()  # [b, q, H, d]


def static_focus_forward(
    layer: FocusStaticLayer,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    allowed: Tensor | None,
    routing: tuple[Tensor, Tensor] | None,
    focus: dict,
    *,
    mode: str,
    scale: float,
    softcap: float | None,
    sliding_window: int | None,
    focus_window: int | None,
    sinks: int,
    cache_position: Tensor | None,
    whole_sequence=None,
) -> Tensor:
    """One forward of a layer on a static cache: ``query [b, H, q, d]``, ``key/value
    [b, G, L, d]`` (the whole preallocated cache), HF's mask ``allowed [b, q, L]`` or ``None``,
    the step's ``routing`` ``(probs [b, q, K], members [b, q])`` for a Focus layer (``None``:
    a window-only twin's ``focus_window``, a family's ``sliding_window`` or plain causal) ->
    ``[b, q, H, d]``. Fixed shapes, no host reads (see the module docstring), except in an
    eager step of several tokens: written from slot 0 (a prefill), they run
    ``whole_sequence(q, valid [b, q])`` (their attention among themselves, ``[b, q, H, d]``);
    after any such step a Focus layer's hard pattern sorts the written slots by group
    (``focus_static_sparse.sort_by_groups``)."""
    b, _, q_len, _ = query.shape
    slots = step_slots(layer, q_len, cache_position)  # [q]
    kw = dict(mode=mode, scale=scale, softcap=softcap, sliding_window=sliding_window)
    kw.update(focus_window=focus_window, sinks=sinks)
    several = q_len > 1 and whole_sequence is not None and not _is_compiling()
    first = int(slots[0]) if several else None  # eager steps of several tokens: a host read
    if allowed is None:
        new_valid = torch.ones(b, q_len, dtype=torch.bool, device=query.device)
    else:  # a real token is a key its own row attends; padding is a key nobody attends
        new_valid = allowed.index_select(2, slots).any(dim=1)  # [b, q, q] -> [b, q]
    if routing is not None:
        layer.focus_store(slots, *routing, new_valid, sinks)
    if first == 0:
        out = whole_sequence(q_len, new_valid)
    elif first is not None:  # an eager chunk after the prompt: bounded memory, row blocks
        out = _cached_rows(layer, query, key, value, allowed, routing, focus, slots, new_valid, kw)
    else:
        out = _cached_step(
            layer, query, key, value, allowed, routing, focus, slots, new_valid, **kw
        )
    sparse = mode == "hard" and focus["inference_backend"] != "dense"
    if first is not None and routing is not None and sparse:
        sort_by_groups(layer, first + q_len, focus["key_groups"])  # every written slot
    return out


def _cached_rows(layer, query, key, value, allowed, routing, focus, slots, new_valid, kw):
    """:func:`_cached_step` over blocks of query rows, each with at most
    ``MASKED_STEP_ELEMENTS`` scores (``[b, H, rows, L]``): an eager chunk of thousands of
    tokens over a long cache would otherwise hold its whole ``[b, H, q, L]`` scores at once."""
    b, heads, q_len, _ = query.shape
    rows = max(1, MASKED_STEP_ELEMENTS // (b * heads * key.shape[2]))
    outs = []
    for start in range(0, q_len, rows):
        part = slice(start, start + rows)
        part_allowed = None if allowed is None else allowed[:, part]  # [b, rows, L]
        part_routing = None if routing is None else tuple(t[:, part] for t in routing)
        args = (layer, query[:, :, part], key, value, part_allowed, part_routing, focus)
        outs.append(_cached_step(*args, slots[part], new_valid[:, part], **kw))  # [b, rows, H, d]
    return torch.cat(outs, dim=1)  # [b, q, H, d]


def _cached_step(layer, query, key, value, allowed, routing, focus, slots, new_valid, **kw):
    """A step over the whole static length (:func:`static_focus_forward`'s keywords)."""
    b, length = query.shape[0], key.shape[2]
    mode, sliding_window, focus_window = kw["mode"], kw["sliding_window"], kw["focus_window"]
    if routing is None:  # no routing kept: cache order, validity from HF's mask alone
        valid = new_valid.new_ones(b, length) if allowed is None else allowed.any(dim=1)
        origin = torch.arange(length, device=query.device)[None]  # [1, L]
        sink, window = row_sinks(valid, kw["sinks"]), focus_window
        causal, local = static_mask(
            slots, origin, allowed, valid, sink, window=window, sliding_window=sliding_window
        )
    else:
        causal, local = routed_pairs(layer, slots, allowed, focus["window"], sliding_window)
    return _masked_step(
        layer, query, key, value, causal, local, routing, focus, mode, kw["scale"],
        kw["softcap"], focus_window,
    )  # fmt: skip


def routed_pairs(
    layer: FocusStaticLayer,
    slots: Tensor,
    allowed: Tensor | None,
    window: int,
    sliding_window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`static_mask` of a Focus layer's cache: the slots' positions
    (``focus_origin``: a sorted prefill), real keys, sinks, and HF's mask ``allowed
    [b, q, L]`` read through the positions -> ``(causal, local)`` ``[b, q, L]``."""
    origin = layer.focus_origin  # [b, L]
    if allowed is not None:
        allowed = allowed.gather(2, origin[:, None, :].expand(-1, slots.numel(), -1))
    return static_mask(
        slots, origin, allowed, layer.focus_valid, layer.focus_sink,
        window=window, sliding_window=sliding_window,
    )  # fmt: skip


def hard_keep(
    layer: FocusStaticLayer,
    slots: Tensor,
    members: Tensor,
    allowed: Tensor | None,
    *,
    window: int,
    sliding_window: int | None = None,
    key_groups: str = "own",
) -> Tensor:
    """``[b, q, L]`` bool: the hard pattern's pairs of queries at cache ``slots [q]`` with
    group bitmasks ``members [b, q]`` on a Focus layer's static cache: causal real keys in the
    window, sinks, or counted in one of the query's groups (``key_groups``)."""
    causal, local = routed_pairs(layer, slots, allowed, window, sliding_window)
    keys = layer.keys_routing(key_groups, with_probs=False)[1]  # [b, L]: each key's groups
    shares = groups_intersect(members[:, :, None], keys[:, None, :])  # [b, q, L]
    return local | (causal & shares)


def _masked_step(
    layer, query, key, value, causal, local, routing, focus, mode, scale, softcap, focus_window
) -> Tensor:
    """The step's attention given its pairs (``causal``, ``local``: ``[b, q, L]``): the
    block-sparse FlexAttention step (compiled hard decode steps) or the masked one."""
    neg_inf = torch.tensor(float("-inf"), device=query.device)
    if routing is None:
        keep = local if focus_window is not None else causal
        if focus_window is not None and _sparse_step(query, "hard", focus):  # the window's blocks
            return sparse_static_attention(query, key, value, keep, scale=scale, softcap=softcap)
        return static_attention(
            query, key, value, torch.where(keep, 0.0, neg_inf), scale=scale, softcap=softcap
        )
    probs, members = routing  # the queries' own
    dot = focus["gate_form"] == "dot"
    with_probs = dot or mode == "soft"  # the hard pattern's masks read the bitmasks only
    keys_probs, keys_members = layer.keys_routing(focus["key_groups"], with_probs)  # [b, L(, K)]
    if mode == "hard" or dot:
        if dot and mode == "soft":
            local = causal  # the dot form's soft pattern: every causal pair, ungated
        shares = groups_intersect(members[:, :, None], keys_members[:, None, :])  # [b, q, L]
        keep = local | (causal & shares)
        dot_lambda = focus["gate_lambda"] if dot else None
        if _sparse_step(query, mode, focus):
            return sparse_static_attention(
                query, key, value, keep, scale=scale, softcap=softcap,
                probs_q=probs, probs_k=keys_probs, dot_lambda=dot_lambda,
            )  # fmt: skip
        term = None if not dot else dot_gate(probs, keys_probs, dot_lambda)  # [b, q, L]
        bias = torch.where(keep, 0.0, neg_inf)
        return static_attention(query, key, value, bias, scale=scale, softcap=softcap, term=term)
    affinity = torch.einsum("bqk,bjk->bqj", probs, keys_probs.to(probs.dtype))
    gate = soft_gate(affinity, focus["gate_lambda"])  # [b, q, L]
    bias = torch.where(local, 0.0, torch.where(causal, gate, neg_inf))
    return static_attention(query, key, value, bias, scale=scale, softcap=softcap)


def _sparse_step(query: Tensor, mode: str, focus: dict) -> bool:
    """Whether a step runs block-sparse (``focus_static_sparse``): the hard pattern, a few
    queries, under ``torch.compile`` (eager FlexAttention computes every pair anyway), a torch
    with FlexAttention's block masks, and not the ``dense`` backend."""
    few = query.shape[2] <= MAX_SPARSE_QUERIES
    return (
        mode == "hard"
        and few
        and _is_compiling()
        and flex_ready()
        and (focus["inference_backend"] != "dense")
    )
