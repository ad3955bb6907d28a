"""The routing of cached keys, kept inside HuggingFace's KV cache, and the sparse decode step.

Shipped inside exported directories next to ``modeling_focus.py``; imports only torch and
transformers.

**Routing beside the keys.** A Focus layer needs, for every cached key, its group probabilities
(soft gate), its group membership (hard pattern) and whether it is a real token or padding. They
live on the layer's own cache object (:class:`FocusDynamicLayer`, a ``DynamicLayer`` whose class
the first Focus call swaps in), so every operation ``generate`` applies to the keys applies to
them too: beam reordering, cropping (assisted and prompt-lookup decoding), batch selection and
repetition, resetting, and ``copy.deepcopy`` of a prompt cache.

**Sparse decode.** With the hard pattern, a one-token step needs only the keys in its window and
the keys that share one of its groups. :class:`GroupIndex` keeps, per sequence and group, the
sorted positions of the cached real tokens of that group (grown by doubling, rebuilt after a
reorder); :func:`sparse_decode` gathers exactly those keys and attends to them, so a step reads
``window + 1 + |same-group keys|`` keys instead of the whole cache. With attention sinks the
index also keeps each sequence's first ``S`` real positions, and a step reads those of them that
are neither in its window nor in one of its groups (each key once: ``S`` more at most).

**Packed inputs** cannot be continued: a forward over packed documents may fill a cache (the
default ``use_cache=True``), but :func:`check_packed_cache` refuses any later step on it.

Layouts: HF ``[b, heads, seq, d]`` for keys and values; routing ``[b, seq, K]``.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from .focus_rules import dot_gate, key_routing, soft_cap


class GroupPositions:
    """Sorted positions of one sequence's cached keys in one group (an int64 growable buffer)."""

    def __init__(self, positions: Tensor) -> None:
        self.buffer = positions.clone()
        self.count = positions.numel()

    def append(self, position: int) -> None:
        if self.count == self.buffer.numel():  # double the capacity: amortised O(1) appends
            size = max(16, 2 * self.count)
            grown = torch.empty(size, dtype=torch.long, device=self.buffer.device)
            grown[: self.count] = self.buffer[: self.count]
            self.buffer = grown
        self.buffer[self.count] = position
        self.count += 1

    def before(self, limit: int) -> Tensor:
        """Positions ``< limit`` (a view of the sorted buffer)."""
        used = self.buffer[: self.count]
        cut = int(torch.searchsorted(used, torch.tensor(limit, device=used.device)))
        return used[:cut]


class GroupIndex:
    """Per sequence and group, where the cached real tokens counted in that group as keys are
    (their own top-k groups; with ``key_groups="own_and_previous"`` their predecessor's too);
    per sequence, its first ``sinks`` real positions (the attention sinks)."""

    def __init__(
        self,
        members: Tensor,
        valid: Tensor,
        num_groups: int,
        sinks: int = 0,
        key_groups: str = "own",
    ) -> None:
        """``members [b, n]`` the tokens' own int64 group bitmasks, ``valid [b, n]`` (False:
        padding)."""
        self.key_groups = key_groups
        keys = key_routing(None, members, valid, key_groups)[1]  # [b, n]: the keys' groups
        self.rows = [
            [
                GroupPositions(torch.nonzero(((row >> g) & 1).bool() & ok).flatten())
                for g in range(num_groups)
            ]
            for row, ok in zip(keys, valid, strict=True)
        ]
        self.num_sinks = sinks
        self.sinks = [torch.nonzero(ok).flatten()[:sinks] for ok in valid] if sinks else []

    def append(
        self, members: Tensor, valid: Tensor, position: int, before: tuple[Tensor, Tensor]
    ) -> None:
        """Add one new token per sequence (own ``members [b]``, ``valid [b]``) at ``position``;
        ``before``: the own bitmasks and validity of the tokens at ``position - 1``
        (``[b]`` each), its predecessors."""
        if self.key_groups != "own":  # also in its predecessor's groups, when that is real
            members = members | torch.where(before[1], before[0], 0)
        for r, (groups, bits, ok) in enumerate(
            zip(self.rows, members.tolist(), valid.tolist(), strict=True)
        ):
            if not ok:
                continue
            if self.num_sinks and self.sinks[r].numel() < self.num_sinks:  # a row's first S
                self.sinks[r] = torch.cat([self.sinks[r], self.sinks[r].new_tensor([position])])
            for g, positions in enumerate(groups):
                if bits >> g & 1:
                    positions.append(position)


class FocusDynamicLayer(DynamicLayer):
    """``DynamicLayer`` that also holds the Focus routing of its keys.

    Attributes:
        focus_probs: ``[b, n, K]`` group probabilities of the cached keys.
        focus_members: ``[b, n]`` int64 bitmask of each key's top-k groups.
        focus_valid: ``[b, n]`` bool, False for padding.
        focus_index: :class:`GroupIndex` for sparse decoding (built on first use).
    """

    _layer_type = None  # never registered as the default layer of a cache type

    def focus_init(self) -> None:
        self.focus_probs = self.focus_members = self.focus_valid = None
        self.focus_index = None
        self._buffers = self._view = None

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        """Append ``[b, G, q, d]`` keys and values; returns all cached ``[b, G, n, d]``.

        Unlike ``DynamicLayer``, which concatenates (copies the whole cache every step), the
        keys and values live in token-major ``[b, capacity, G, d]`` buffers grown by doubling
        (a step writes only its token; a sparse step gathers whole token rows) and ``keys`` /
        ``values`` are ``[b, G, n, d]`` views of them. After an operation that replaced
        ``keys`` (reorder, crop, batch selection, offloading) the next update adopts them.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, added = self.get_seq_length(), key_states.shape[-2]
        if self._view is not self.keys or self._buffers[0].shape[1] < n + added:
            size = max(256, 2 * (n + added))
            grown = []
            for old, new in ((self.keys, key_states), (self.values, value_states)):
                b, heads, _, d = new.shape
                buffer = new.new_empty(b, size, heads, d)  # [b, capacity, G, d]
                if n:
                    buffer[:, :n] = old.transpose(1, 2)  # [b, G, n, d] -> [b, n, G, d]
                grown.append(buffer)
            self._buffers = tuple(grown)
        key_buffer, value_buffer = self._buffers
        key_buffer[:, n : n + added] = key_states.transpose(1, 2)  # [b, q, G, d]
        value_buffer[:, n : n + added] = value_states.transpose(1, 2)
        self.keys = key_buffer[:, : n + added].transpose(1, 2)  # [b, G, n, d] view
        self.values = value_buffer[:, : n + added].transpose(1, 2)
        self._view = self.keys
        return self.keys, self.values

    def token_rows(self, row: int, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of sequence ``row`` at ``positions``, ``[G, m, d]`` each."""
        if self._view is self.keys:  # gather whole token rows of the token-major buffers
            n = self.keys.shape[2]
            k, v = (buf[row, :n].index_select(0, positions) for buf in self._buffers)  # [m, G, d]
            return k.transpose(0, 1), v.transpose(0, 1)
        return self.keys[row][:, positions], self.values[row][:, positions]  # [G, m, d]

    def focus_length(self) -> int:
        return 0 if self.focus_probs is None else self.focus_probs.shape[1]

    def _focus_apply(self, fn) -> None:
        if self.focus_probs is not None:
            self.focus_probs = fn(self.focus_probs)
            self.focus_members = fn(self.focus_members)
            self.focus_valid = fn(self.focus_valid)
        self.focus_index = None  # rebuilt from the members on the next sparse step

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._focus_apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        keep = self.get_seq_length()
        if self.focus_length() > keep:
            self._focus_apply(lambda t: t[:, :keep])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._focus_apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        self._focus_apply(lambda t: t[indices])

    def reset(self) -> None:
        # Dropped rather than zeroed (transformers < 5.24 zeroes them in place and keeps their
        # length, so a reset cache would still count its old tokens); clearing
        # ``is_initialized`` first makes ``super().reset()`` skip the zeroing.
        self.keys = self.values = None
        self.is_initialized = False
        super().reset()
        self.focus_init()


def cache_kwargs(model, cache) -> dict:
    """``{keyword: cache}`` for calling ``model`` (or its ``generate``) with a KV cache: the
    model's own keyword, ``cache`` from transformers 5.24 and ``past_key_values`` before (an
    older release silently ignores a keyword it does not know). E.g.
    ``model(ids, **cache_kwargs(model, DynamicCache(config=model.config)))``."""
    parameters = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in parameters else "past_key_values": cache}


def returned_cache(output):
    """The KV cache a forward returned: ``output.cache`` from transformers 5.24,
    ``output.past_key_values`` before."""
    fields = getattr(output, "__dataclass_fields__", {})  # a ModelOutput is a dataclass
    return getattr(output, "cache" if "cache" in fields else "past_key_values", None)


def _adopt_dynamic_layer(layer):
    """A plain ``DynamicLayer`` becomes a :class:`FocusDynamicLayer` (same state, plus the
    routing; see the module docstring), so that every layer of a Focus export's dynamic cache
    behaves alike under every transformers release (``reset`` among others); other layer kinds
    are returned as they are."""
    if type(layer) is DynamicLayer:
        layer.__class__ = FocusDynamicLayer
        layer.focus_init()
    return layer


def focus_cache_layer(cache, layer_idx: int) -> FocusDynamicLayer | None:
    """This layer's cache object with routing storage (``None`` without a cache).

    Raises:
        ValueError: a cache kind that cannot hold the routing (sliding-window, quantized,
            offloaded to another structure): Focus exports support the default dynamic cache
            and full-attention static caches (``focus_static``, handled before this is called).
    """
    if cache is None:
        return None
    cache = getattr(cache, "self_attention_cache", cache)  # GPT-2's EncoderDecoderCache
    layer = _adopt_dynamic_layer(cache.layers[layer_idx])
    if not isinstance(layer, FocusDynamicLayer):
        raise ValueError(
            "Focus attention keeps each key's routing in the KV cache, which "
            f"{type(layer).__name__} ({type(cache).__name__}) cannot hold; use the default "
            "dynamic cache (DynamicCache, generate's default) or a StaticCache, not a sliding "
            "or quantized one"
        )
    return layer


def check_packed_cache(cache, layer_idx: int, docs: Tensor | None, q_len: int, kv_len: int) -> None:
    """Mark this layer's cache as filled by packed documents (``docs [b, q]`` document starts)
    or not, on a forward into an empty cache; refuse continuing a packed one.

    A packed row ends in the middle of its last document's context (and its other documents
    are unrelated text), so no next token of it is meaningful: decode each document alone.

    Raises:
        ValueError: packed documents after cached tokens, or any step after a packed forward.
    """
    if cache is None:
        return
    cache = getattr(cache, "self_attention_cache", cache)  # GPT-2's EncoderDecoderCache
    layer = _adopt_dynamic_layer(cache.layers[layer_idx])  # (window-only layers, too)
    if kv_len == q_len:  # a fresh fill (after reset or crop to nothing, too)
        layer.focus_packed = docs is not None
        return
    if docs is not None:
        raise ValueError(
            f"packed inputs (position_ids restarting within a row) after {kv_len - q_len} cached "
            "tokens are not supported: run packed documents with an empty cache or use_cache=False"
        )
    if getattr(layer, "focus_packed", False):
        raise ValueError(
            "this KV cache was filled by packed documents (position_ids restarting within a "
            "row), which cannot be continued: generate from each document alone (one row per "
            "prompt, left-padded), or run packed forwards with use_cache=False"
        )


def store_routing(
    layer: FocusDynamicLayer | None,
    probs: Tensor,
    members: Tensor,
    valid: Tensor,
    kv_len: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Append the new tokens' routing (``[b, q, K]``, ``[b, q]``, ``[b, q]``) to the cached keys'
    and return all ``kv_len`` keys' ``(probs, members, valid)``."""
    q_len = probs.shape[1]
    if layer is None:
        if q_len != kv_len:
            raise ValueError(f"{kv_len} keys for {q_len} queries but no KV cache to route them")
        return probs, members, valid
    past = kv_len - q_len
    if past == 0 or layer.focus_probs is None:
        if past:
            raise ValueError(
                f"the KV cache holds {past} keys without their Focus routing (filled by another "
                "model or attention implementation); fill it with this model"
            )
        layer.focus_probs, layer.focus_members, layer.focus_valid = probs, members, valid
        layer.focus_index = None
        return probs, members, valid
    if layer.focus_length() != past:
        raise ValueError(
            f"the KV cache holds {past} keys but routing for {layer.focus_length()}: it was "
            "changed outside the cache API (reorder_cache, crop, batch_select_indices)"
        )
    if layer.focus_index is not None and q_len == 1:
        before = (layer.focus_members[:, -1], layer.focus_valid[:, -1])  # [b] each
        layer.focus_index.append(members[:, 0], valid[:, 0], past, before)
    else:
        layer.focus_index = None
    layer.focus_probs = torch.cat([layer.focus_probs, probs], dim=1)  # [b, kv, K]
    layer.focus_members = torch.cat([layer.focus_members, members], dim=1)
    layer.focus_valid = torch.cat([layer.focus_valid, valid], dim=1)
    return layer.focus_probs, layer.focus_members, layer.focus_valid


def sparse_decode(
    layer: FocusDynamicLayer,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    window: int,
    num_groups: int,
    scale: float,
    softcap: float | None,
    sinks: int = 0,
    dot_lambda: float | None = None,
    key_groups: str = "own",
) -> tuple[Tensor, int]:
    """One decode step over the keys the hard pattern keeps.

    ``query [b, H, 1, d]``, ``key/value [b, G, n, d]`` (the whole cache, this step's token last)
    -> ``([b, 1, H, d], keys read)``. Key ``j`` is read when it is real (not padding) and
    ``n - 1 - j <= window``, or when one of the groups it counts in as a key (``key_groups``:
    its own, or its own and its predecessor's) is one of the query's, or when it is one of
    the row's first ``sinks`` real tokens; each key at most once. ``dot_lambda``: the dot gate
    form's ``lambda`` (its term ``lambda g_q . g_j`` on every key read, before soft-capping).
    """
    b, heads, _, d = query.shape
    groups, n = key.shape[1], key.shape[2]
    index = layer.focus_index
    if index is None or index.num_sinks != sinks or index.key_groups != key_groups:
        index = GroupIndex(layer.focus_members, layer.focus_valid, num_groups, sinks, key_groups)
        layer.focus_index = index
    start = max(0, n - 1 - window)
    window_positions = torch.arange(start, n, device=key.device)
    valid = layer.focus_valid
    query_bits = layer.focus_members[:, -1].tolist()  # the step's own groups
    members = key_routing(None, layer.focus_members, valid, key_groups)[1]  # [b, n]: as keys
    dtype = torch.promote_types(query.dtype, torch.float32)
    out = query.new_zeros(b, 1, heads, d)
    reads = 0
    for r in range(b):
        bits, taken = query_bits[r], 0
        parts = [window_positions[valid[r, start:]]]
        for g in range(num_groups):
            if not bits >> g & 1:
                continue
            far = index.rows[r][g].before(start)
            if taken:  # top-k > 1: a key in two of the query's groups is read once
                far = far[(members[r, far] & taken) == 0]
            parts.append(far)
            taken |= 1 << g
        if sinks:  # sinks beyond the window and in none of the query's groups (not read yet)
            sink = index.sinks[r]
            sink = sink[sink < start]
            parts.append(sink[(members[r, sink] & bits) == 0])
        positions = torch.cat(parts)  # [m]
        reads += positions.numel()
        k, v = (t.to(dtype) for t in layer.token_rows(r, positions))  # [G, m, d]
        q = query[r, :, 0].to(dtype).reshape(groups, heads // groups, d)  # [H, d] -> [G, H/G, d]
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [G, H/G, m]
        if dot_lambda is not None:
            probs = layer.focus_probs[r]  # [n, K]
            term = dot_gate(probs[None, -1:], probs[None, positions], dot_lambda)  # [1, 1, m]
            scores = scores + term[0].to(dtype)  # broadcast over [G, H/G]
        scores = soft_cap(scores, softcap)
        mixed = torch.matmul(torch.softmax(scores, dim=-1), v)  # [G, H/G, d]
        out[r, 0] = mixed.reshape(heads, d).to(query.dtype)  # [G, H/G, d] -> [H, d]
    return out, reads
