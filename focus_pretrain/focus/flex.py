"""The FlexAttention backend: block-sparse hard Focus for any ``top_k``, soft gate as ``score_mod``.

* **hard** (any ``top_k``): the pattern is split like the decomposed backend's: pairs that share a
  group (causal) are computed on the :class:`~focus_pretrain.focus.sorted_layout.GroupSortedLayout`
  where they are block-sparse, and the cross-group local band (with the sink keys the groups do
  not cover) on the original layout; the two are merged by log-sum-exp. On the sorted layout the
  block mask keeps a (query block, key block) only when the blocks' OR-ed membership bitmasks
  intersect, their (sample, document) ranges overlap and some key is not after some query; a
  block is *full* (no per-pair mask) when both blocks hold one segment of one document and every
  key precedes every query. Tokens of equal bitmask are contiguous, so for ``top_k = 1`` this is
  a block-diagonal document mask, and for ``top_k = 2`` of ``K = 8`` a query block meets 13 of
  the 28 bitmask segments: the pair-count ideal, at block granularity. Block masks are built
  from per-block summaries (``O(n / B)`` work per block row; no ``n x n`` pair evaluation).
* **soft** (training): one causal call whose ``score_mod`` adds the gate
  (:func:`~focus_pretrain.focus.pattern.soft_gate`) to pairs beyond the window (sinks excepted),
  reading the soft assignments ``[K, b, n]`` by index: nothing ``n x n`` is materialised, and on
  GPU the gradient flows to ``q``, ``k``, ``v`` and the assignments.
* **local only**: one sliding-window call (with the sink keys).
* **sinks**: the sink keys beyond the window are part of the band call's ``mask_mod`` (cross-group
  only in hard mode, so the parts stay disjoint); their key blocks are added to the band's block
  mask.
* **documents** (packed sequences, ``[b, n]`` int64 document starts,
  :func:`~focus_pretrain.focus.pattern.document_starts`): every ``mask_mod`` also requires one
  document, the sinks are each document's first ``S`` tokens, and every block mask drops the
  block pairs that hold no same-document pair. Document starts never decrease along a sequence,
  so a block's documents are the range between its first and last token's; two blocks share a
  document exactly when these ranges overlap. For the causal mask (soft mode) and the
  sliding-window band with its sinks the kept blocks are then exactly those holding an allowed
  pair: short packed documents cost what each document alone costs, at block granularity. The
  block masks are then per sample (``[b, 1, nb, nb]``). Hard mode sorts each sample by
  ``(document, bitmask)`` (the layout's segments are (sample, document, bitmask) runs), so blocks
  on the sorted layout are document-tight too; there the range test runs on the
  (sample, document) key of the packed tokens, valid for any sort order.

On CUDA ``flex_attention`` is compiled (Triton kernels that skip the blocks the mask leaves out).
On CPU it runs eagerly: exact and forward-only (PyTorch has no CPU FlexAttention backward), and
the eager path evaluates the masks densely, so it serves tests, not speed.
Layout: ``[batch, seq, heads, head_dim]`` at this module's boundary; FlexAttention's own is
``[batch, heads, seq, head_dim]``.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention, noop_mask

try:  # PyTorch >= 2.9 asks for auxiliary outputs this way (return_lse is deprecated)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - older PyTorch
    AuxRequest = None

from focus_pretrain.focus.backends import AttentionPattern
from focus_pretrain.focus.compiled import dispatch_mode_on, fused_on_cuda, raise_recompile_limit
from focus_pretrain.focus.flex_mods import gate_score_mod, softcap_mod
from focus_pretrain.focus.lse import merge_by_lse
from focus_pretrain.focus.pattern import (
    compute_dtype,
    groups_intersect,
    member_bits,
    pair_rule,
)
from focus_pretrain.focus.pattern_blocks import (
    block_bounds,
    block_predicates,
    ranges_overlap,
    summarise_blocks,
)
from focus_pretrain.focus.pattern_settings import FocusPattern
from focus_pretrain.focus.sorted_layout import GroupSortedLayout

DEFAULT_BLOCK = 128  # FlexAttention's sparse block size
MAX_CACHED_MASKS = 64
# block structure of the masks that depend on shapes only (no documents): built once per
# (kind, length, window, sinks, block, device) and shared by every layer and call; the cached
# copy holds no mask_mod (its closure would keep a call's tensors alive)
_STATIC_MASKS: dict[tuple, BlockMask] = {}


def _static_mask(key: tuple, mask_mod, build) -> BlockMask:
    """``build()``'s block mask from the cache (with ``mask_mod``): eager calls only; inside a
    compiled graph it is built in the graph (a static input to a CUDA graph either way)."""
    if torch.compiler.is_compiling():
        return build()
    cached = _STATIC_MASKS.get(key)
    if cached is None:
        if len(_STATIC_MASKS) >= MAX_CACHED_MASKS:
            _STATIC_MASKS.clear()
        cached = _STATIC_MASKS[key] = _with_mask_mod(build(), noop_mask)
    return _with_mask_mod(cached, mask_mod)


def _with_mask_mod(mask: BlockMask, mask_mod) -> BlockMask:
    """``mask``'s blocks (shared, not copied) with another ``mask_mod``: a new ``BlockMask``
    from the same fields (every torch version's own list of them). Not ``copy.copy``: torch
    2.11's dynamo refuses it inside a captured graph (issue 42), later versions trace it."""
    fields = {name: getattr(mask, name) for name in (*mask._TENSOR_ATTRS, *mask._CONTEXT_ATTRS)}
    fields["mask_mod"] = mask_mod
    return type(mask)(**fields)


_TRITON_FOUND = importlib.util.find_spec("triton") is not None  # at import: not in a graph


def flex_available_on(device: str) -> bool:
    """FlexAttention can run here: CUDA with Triton (compiled), or CPU (eager, forward only)."""
    if device == "cuda":
        return torch.cuda.is_available() and _TRITON_FOUND
    return device == "cpu"


@functools.cache
def _compiled_flex():
    # every (length, mask kind, GQA) is a specialisation; past dynamo's default of 8 it would
    # fall back to eager FlexAttention, which materialises n x n scores (out of memory at 1M)
    raise_recompile_limit()
    return torch.compile(flex_attention)


def _call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_mask: BlockMask,
    scale: float,
    score_mod=None,
) -> tuple[Tensor, Tensor]:
    """``q [B, Lq, H, D]``, ``k/v [B, Lk, Hkv, D]`` -> ``(out [B, Lq, H, D], lse [B, Lq, H])``
    with ``lse`` in at least fp32 (fp64 for fp64 inputs)."""
    compiling = torch.compiler.is_compiling()  # inside a caller's graph: trace straight through
    fn = (
        _compiled_flex()
        if q.is_cuda and not compiling and not dispatch_mode_on()
        else flex_attention
    )
    q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))  # [B, L, H, D] -> [B, H, L, D]
    lse_request = {"return_aux": AuxRequest(lse=True)} if AuxRequest else {"return_lse": True}
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, **lse_request)
    kwargs["enable_gqa"] = k.shape[2] != q.shape[2]
    if compiling:
        out, aux = fn(q4, k4, v4, **kwargs)  # [B, H, L, D], [B, H, L]
    else:
        with warnings.catch_warnings():  # CPU runs eagerly on purpose (exact; tests, not speed)
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.co")
            out, aux = fn(q4, k4, v4, **kwargs)  # [B, H, L, D], [B, H, L]
    lse = aux.lse if AuxRequest else aux
    lse = lse.to(compute_dtype(q.dtype)).transpose(1, 2)  # [B, H, L] -> [B, L, H], >= fp32
    return out.transpose(1, 2), lse  # [B, L, H, D], [B, L, H]


def block_mask_from_predicates(
    candidate: Tensor,
    full: Tensor | None,
    mask_mod,
    block: int,
    q_len: int,
    k_len: int | None = None,
) -> BlockMask:
    """A ``BlockMask`` from dense block predicates ``[nq, nk]`` (one mask for every sample) or
    ``[B, nq, nk]`` (one per sample; :func:`~focus_pretrain.focus.pattern_blocks.
    block_predicates`); partial blocks are ``candidate & ~full``, visited with ``mask_mod``."""

    def ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
        dense = dense if dense.dim() == 3 else dense[None]  # [B, nq, nk]
        num = dense.sum(dim=-1, dtype=torch.int32)  # [B, nq]
        idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
        return num[:, None], idx.to(torch.int32)[:, None]  # [B, 1, nq], [B, 1, nq, nk]

    partial = candidate if full is None else candidate & ~full
    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full) if full is not None else (None, None)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(q_len, q_len if k_len is None else k_len),
    )


class SortedSide(NamedTuple):
    """One side (queries or keys) of the packed sorted layout, as the block masks read it:
    ``[T]`` bitmasks, flattened positions (``sample * n + position``), (sample, document)
    keys, segment table entries, and the segment table ``cu_seqlens [S + 1]``."""

    member: Tensor
    gpos: Tensor
    unit: Tensor
    segment: Tensor
    cu_seqlens: Tensor

    @classmethod
    def of(cls, layout: GroupSortedLayout) -> SortedSide:
        gpos = layout.sample * layout.seq + layout.position  # [T] position in the batch
        doc = layout.position.new_zeros(()) if layout.document is None else layout.document
        unit = (layout.sample * layout.seq + doc).expand_as(gpos)  # [T] (sample, document)
        return cls(layout.member, gpos, unit, layout.segment, layout.cu_seqlens)


def same_group_block_mask(
    layout: GroupSortedLayout,
    block: int = DEFAULT_BLOCK,
    keys: GroupSortedLayout | None = None,
) -> BlockMask:
    """Block mask of the pairs that share a group (causal, one document), on the packed sorted
    layout; the documents are ``layout.document`` (``None``: one per sample). ``keys``: the
    keys' own layout, sorted by the keys' bitmasks where they differ from the queries'
    (``key_groups``; ``None``: the keys are the queries' layout): queries are rows in
    ``layout``'s order, keys columns in ``keys``' order.

    Built on the device from fixed-shape tensors (no host sync). On CUDA, outside a caller's
    compiled graph, the block computation runs compiled (:func:`same_group_blocks`,
    :func:`~focus_pretrain.focus.compiled.fused_on_cuda`): its ~100 small operators fused into
    a few kernels."""
    rows = SortedSide.of(layout)
    cols = None if keys is None else SortedSide.of(keys)  # None: the rows' (no aliases)

    def mask_mod(b, h, q_idx, kv_idx):  # the sorted layouts: positions and documents by index
        k_side = rows if cols is None else cols
        shares = groups_intersect(rows.member[q_idx], k_side.member[kv_idx])
        units = dict(q_doc=rows.unit[q_idx], k_doc=k_side.unit[kv_idx])
        causal, _ = pair_rule(rows.gpos[q_idx], k_side.gpos[kv_idx], window=0, **units)
        return shares & causal

    mask = same_group_blocks(rows, cols, block)
    return _with_mask_mod(mask, mask_mod)


def _side_blocks(
    member: Tensor, gpos: Tensor, unit: Tensor, segment: Tensor, cu_seqlens: Tensor, block: int
) -> tuple[Tensor, ...]:
    """Per block of one side (:class:`SortedSide`'s tensors): the OR of its bitmasks as bits
    ``[nb, 64]``, its flattened positions' and (sample, document) keys' bounds ``[nb]`` each,
    and whether it is *pure* (one segment of one document, no padding) ``[nb]``."""
    total = member.numel()
    nb = -(-total // block)
    device = member.device
    # OR of the bitmasks in each block, through segments (a block holds few of them)
    seg_start = cu_seqlens[:-1].long()  # [S] table entries, empty ones included
    seg_member = member[seg_start.clamp(max=total - 1)]  # [S]
    seg_used = (cu_seqlens[1:] > cu_seqlens[:-1]).to(torch.int32)  # [S]
    seg_bits = member_bits(seg_member).to(torch.int32) * seg_used[:, None]  # [S, 64]
    first_block = (seg_start // block).clamp(max=nb - 1)  # [S] (empty entries: no bits)
    last_block = ((cu_seqlens[1:].long() - 1) // block).clamp(min=first_block)
    delta = torch.zeros(nb + 1, 64, dtype=torch.int32, device=device)
    delta.index_add_(0, first_block, seg_bits)
    delta.index_add_(0, last_block + 1, -seg_bits)
    bits = torch.cumsum(delta[:nb], dim=0) > 0  # [nb, 64]
    (gpos_min,), (gpos_max,) = block_bounds(gpos[None], block)  # [nb] each
    (unit_min,), (unit_max,) = block_bounds(unit[None], block)  # any sort order
    seg_first = segment[torch.arange(nb, device=device) * block]
    seg_last = segment[torch.clamp(torch.arange(1, nb + 1, device=device) * block, max=total) - 1]
    pure = (seg_first == seg_last) & (unit_min == unit_max)  # one segment of one document
    pure[-1] &= nb * block == total
    return bits, gpos_min, gpos_max, unit_min, unit_max, pure


@fused_on_cuda
def same_group_blocks(rows: SortedSide, cols: SortedSide | None, block: int) -> BlockMask:
    """The blocks of :func:`same_group_block_mask` (``mask_mod``: none yet) from the queries'
    (``rows``) and the keys' (``cols``; ``None``: the queries') packed tokens."""
    q_blocks = _side_blocks(*rows, block)
    q_bits, q_min, q_max, qu_min, qu_max, q_pure = q_blocks
    k_bits, k_min, k_max, ku_min, ku_max, k_pure = (
        q_blocks if cols is None else _side_blocks(*cols, block)
    )
    shares = (q_bits.to(torch.float32) @ k_bits.t().to(torch.float32)) > 0  # [nb, nb]
    units = ranges_overlap(qu_min[None], qu_max[None], ku_min[None], ku_max[None])[0]
    candidate = shares & units & (k_min[None, :] <= q_max[:, None])
    # pure blocks hold one bitmask each: sharing a group is then true of every pair
    full = candidate & q_pure[:, None] & k_pure[None, :] & (qu_min[:, None] == ku_min[None, :])
    full &= k_max[None, :] <= q_min[:, None]
    return block_mask_from_predicates(candidate, full, noop_mask, block, rows.member.numel())


def band_block_mask(
    seq_len: int,
    window: int,
    member: Tensor | None,
    device: torch.device,
    block: int = DEFAULT_BLOCK,
    *,
    sinks: int = 0,
    documents: Tensor | None = None,
    key_member: Tensor | None = None,
) -> BlockMask:
    """Block mask of ``0 <= i - j <= window`` or a sink key (``j < sinks``; ``j - d_j < sinks``
    with document starts ``documents [b, n]``, which also require one document) and, with
    ``member [b, n]``, disjoint groups (the keys' bitmasks ``key_member [b, n]`` where they
    differ from the queries', ``key_groups``)."""

    def mask_mod(b, h, q_idx, kv_idx):  # reads each tensor once (no aliases: dynamo's guards)
        docs = _pair_documents(documents, b, q_idx, kv_idx)
        causal, near = pair_rule(q_idx, kv_idx, window=window, sinks=sinks, **docs)
        if member is None:
            return causal & near
        keys = member[b, kv_idx] if key_member is None else key_member[b, kv_idx]
        return causal & near & ~groups_intersect(member[b, q_idx], keys)

    def build() -> BlockMask:
        positions = torch.arange(seq_len, device=device)  # [n]
        blocks = summarise_blocks(positions, None, documents, block=block, sinks=sinks)
        candidate, full = block_predicates(blocks, blocks, kind="local", window=window, sinks=sinks)
        # the cross-group band (``member``): the groups decide inside every block, none is full
        return block_mask_from_predicates(
            candidate, full if member is None else None, mask_mod, block, seq_len
        )

    if documents is not None:
        return build()
    key = ("band", seq_len, window, sinks, block, str(device), member is None)
    return _static_mask(key, mask_mod, build)


def _pair_documents(documents: Tensor | None, b, q_idx, kv_idx) -> dict:
    """Inside a ``mask_mod`` / ``score_mod``: the pair's document starts for
    :func:`~focus_pretrain.focus.pattern.pair_rule` (none without ``documents [b, n]``)."""
    if documents is None:
        return {}
    return dict(q_doc=documents[b, q_idx], k_doc=documents[b, kv_idx])


def causal_block_mask(
    seq_len: int,
    device: torch.device,
    block: int = DEFAULT_BLOCK,
    *,
    documents: Tensor | None = None,
) -> BlockMask:
    """Block mask of causal attention (blocks strictly below the diagonal are full), inside each
    document with document starts ``documents [b, n]``."""

    def mask_mod(b, h, q_idx, kv_idx):
        return pair_rule(q_idx, kv_idx, window=0, **_pair_documents(documents, b, q_idx, kv_idx))[0]

    def build() -> BlockMask:
        positions = torch.arange(seq_len, device=device)  # [n]
        blocks = summarise_blocks(positions, None, documents, block=block, sinks=0)
        candidate, full = block_predicates(blocks, blocks, kind="causal", window=0, sinks=0)
        return block_mask_from_predicates(candidate, full, mask_mod, block, seq_len)

    if documents is not None:
        return build()
    return _static_mask(("causal", seq_len, block, str(device)), mask_mod, build)


def same_group(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: GroupSortedLayout,
    *,
    scale: float,
    softcap: float | None,
    block: int = DEFAULT_BLOCK,
    keys: GroupSortedLayout | None = None,
) -> tuple[Tensor, Tensor]:
    """Pairs sharing a group (inside one document when ``layout.document`` is set) on the packed
    layout: ``[T, H|Hkv, D]`` -> ``([T, H, D], [T, H])``; ``k, v`` packed in ``keys``' order
    where the keys have their own layout (``key_groups``; :func:`same_group_block_mask`)."""
    mask = same_group_block_mask(layout, block, keys)
    out, lse = _call(
        q[None], k[None], v[None], block_mask=mask, scale=scale, score_mod=softcap_mod(softcap, q)
    )  # [1, T, H, D], [1, T, H]
    return out[0], lse[0]


def same_group_gated(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: GroupSortedLayout,
    probs: Tensor,
    pattern: FocusPattern,
    *,
    block: int = DEFAULT_BLOCK,
    keys: GroupSortedLayout | None = None,
    key_probs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`same_group` with the soft gate on the pairs beyond the window whose key is not a
    sink (the hard_gated mode's routed pairs): ``[T, H|Hkv, D]`` and the packed soft assignments
    ``probs [T, K]`` -> ``([T, H, D], [T, H])``; differentiable in ``probs`` through the gate.
    ``pattern``: the window, sinks, gate, soft-capping and (resolved) scale. ``keys``,
    ``key_probs [T, K]``: the keys' layout and soft assignments (packed in its order) where
    they differ from the queries' (``key_groups``)."""
    # [T] positions in the sample (pairs are of one sample), the keys' in their own order; no
    # tensor read under two names (dynamo's aliasing guard breaks on it between calls)
    position = layout.position
    k_position = None if keys is None else keys.position
    doc = layout.document if keys is None else keys.document
    score_mod = gate_score_mod(
        pattern, probs[None], None if key_probs is None else key_probs[None], q,
        q_pos=lambda b, i: position[i],
        k_pos=lambda b, i: position[i] if k_position is None else k_position[i],
        k_doc=None if doc is None else lambda b, i: doc[i],
    )  # fmt: skip
    mask = same_group_block_mask(layout, block, keys)
    out, lse = _call(
        q[None], k[None], v[None], block_mask=mask, scale=pattern.scale, score_mod=score_mod
    )  # [1, T, H, D], [1, T, H]
    return out[0], lse[0]


def band(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    scale: float,
    softcap: float | None,
    member: Tensor | None,
    block: int = DEFAULT_BLOCK,
    sinks: int = 0,
    documents: Tensor | None = None,
    key_member: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The local band (cross-group only with ``member [b, n]``; the keys' own bitmasks
    ``key_member [b, n]`` with ``key_groups``): ``[b, n, H, D]`` layout.

    With ``sinks`` also the sink keys beyond the window (cross-group only with ``member``);
    with ``documents`` (``[b, n]`` int64 document starts) only pairs of one document, and the
    sinks are each document's first ``sinks`` tokens."""
    n = q.shape[1]
    mask = band_block_mask(
        n, min(window, n), member, q.device, block, sinks=sinks, documents=documents,
        key_member=key_member,
    )  # fmt: skip
    return _call(q, k, v, block_mask=mask, scale=scale, score_mod=softcap_mod(softcap, q))


def soft(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor,
    pattern: FocusPattern,
    *,
    documents: Tensor | None = None,
    block: int = DEFAULT_BLOCK,
    key_probs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Soft-gated causal attention; the gate is a ``score_mod`` reading ``probs [b, n, K]``
    (the keys' ``key_probs [b, n, K]`` where they differ, ``key_groups``), applied beyond the
    window to keys that are not sinks (positions ``>= sinks``, counted from the document start
    with ``documents [b, n]``, which also confine each query to its document). ``pattern``:
    the window, sinks, gate, soft-capping and (resolved) scale."""
    score_mod = gate_score_mod(
        pattern, probs, key_probs, q, q_pos=lambda b, i: i, k_pos=lambda b, i: i,
        k_doc=None if documents is None else lambda b, i: documents[b, i],
    )  # fmt: skip
    mask = causal_block_mask(q.shape[1], q.device, block, documents=documents)
    return _call(q, k, v, block_mask=mask, scale=pattern.scale, score_mod=score_mod)


def flex_focus_attention(
    q: Tensor, k: Tensor, v: Tensor, pattern: AttentionPattern, *, block: int = DEFAULT_BLOCK
) -> tuple[Tensor, Tensor]:
    """Backend entry (:class:`~focus_pretrain.focus.backends.Backend`): ``q [b, n, H, D]``,
    ``k, v [b, n, Hkv, D]`` and the :class:`~focus_pretrain.focus.backends.AttentionPattern`."""
    member, documents = pattern.member, pattern.documents
    scale, softcap = pattern.scale, pattern.softcap
    band_kwargs = dict(
        window=pattern.window, scale=scale, softcap=softcap, block=block, sinks=pattern.sinks,
        documents=documents,
    )  # fmt: skip
    if pattern.local_only:
        return band(q, k, v, member=None, **band_kwargs)
    if pattern.mode == "soft":
        return soft(
            q, k, v, pattern.probs, pattern, documents=documents, block=block,
            key_probs=pattern.key_probs,
        )  # fmt: skip
    layout = GroupSortedLayout.of_pattern(pattern)
    # key_groups: the keys sorted by their own bitmasks (k, v in that order), else the queries'
    own_keys = pattern.key_member is None
    keys = None if own_keys else GroupSortedLayout.of_pattern(pattern, keys=True)
    key_layout = layout if own_keys else keys
    packed = (layout.pack(q), key_layout.pack(k), key_layout.pack(v))  # [b * n, H|Hkv, D]
    if pattern.mode == "hard_gated":  # sparse training: the routed pairs gated
        key_probs = None if own_keys else keys.pack(pattern.keys_probs)  # [b * n, K]
        out_a, lse_a = same_group_gated(
            *packed, layout, layout.pack(pattern.probs), pattern, block=block, keys=keys,
            key_probs=key_probs,
        )  # fmt: skip
    else:
        out_a, lse_a = same_group(
            *packed, layout, scale=scale, softcap=softcap, block=block, keys=keys
        )
    shared = (layout.unpack(out_a), layout.unpack(lse_a))  # [b, n, H, D], [b, n, H]
    cross = band(q, k, v, member=member, key_member=pattern.key_member, **band_kwargs)
    return merge_by_lse(shared, cross)
