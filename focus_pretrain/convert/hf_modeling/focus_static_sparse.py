"""Sparse steps on transformers' static KV cache: the group-sorted layout and a block-sparse step.

Shipped inside exported directories next to ``modeling_focus.py``; imports only torch and
transformers.

A static cache has fixed shapes, so a compiled decode step cannot gather a variable number of
keys; it can skip blocks of keys. With the hard pattern a query needs its window, its sinks and
the keys that share one of its groups, but in cache order every block of 128 keys holds keys of
every group. So after an eager prefill (:func:`sort_by_groups`) each Focus layer permutes the
prompt's slots, keys and values with their routing, by group membership (stable: positions stay
in order inside a group). Every slot then carries the cache position it was written at
(``FocusStaticLayer.focus_origin``), which every rule reads instead of the slot index, and HF's
mask is read through it too. A later token is written at its own position, after the prompt, in
order. :func:`crop_sorted` puts the order back before transformers crops into the prompt.

A decode step under ``torch.compile`` (:func:`sparse_static_attention`) then evaluates the hard
pattern per slot on the device (``[b, q, L]``, what the masked path builds too:
``focus_static.hard_keep``), reduces it to the blocks holding a kept key (the blocks of the
query's groups, the last blocks of each group for the window, the tail of generated tokens,
the sinks' blocks) and runs FlexAttention on those blocks only (``BlockMask.from_kv_blocks``:
no host read, fixed shapes, capturable), blocks whose every key is kept without a mask. The
same result as the masked path, exactly (the mask inside the blocks is the pattern itself);
eager steps, the soft pattern, the ``dense`` backend and a torch without FlexAttention's block
API take the masked path.

Layouts: HF ``[b, heads, seq, d]`` for queries, keys and values; slots ``[b, L]``.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

try:  # FlexAttention with block masks built on the device from tensors
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    _FLEX = {"seq_lengths", "compute_q_blocks"} <= set(
        inspect.signature(BlockMask.from_kv_blocks).parameters
    )
except ImportError:  # pragma: no cover - older torch: the masked path
    BlockMask = flex_attention = None
    _FLEX = False

KEY_BLOCK = 128  # keys per block of the block mask (FlexAttention's default tile)
MAX_SPARSE_QUERIES = 64  # steps of more queries (a prefill) take the masked or whole-sequence path
_LAST = torch.iinfo(torch.int64).max  # sort key of padding: after every real token


def flex_ready() -> bool:
    """Whether this torch has FlexAttention with block masks built from tensors."""
    return _FLEX


def _permute(layer, count: int, order: Tensor) -> None:
    """Reorder the first ``count`` slots of every row by ``order [b, count]`` (slot indices):
    keys and values ``[b, G, L, d]`` and the routing buffers ``[b, L(, K)]``, in place (their
    addresses stay: static, CUDA-graph safe)."""
    for cache in (layer.keys, layer.values):
        b, heads, _, d = cache.shape
        index = order[:, None, :, None].expand(b, heads, count, d)  # [b, G, count, d]
        cache[:, :, :count].copy_(torch.gather(cache[:, :, :count], 2, index))
    for buffer in layer.focus_buffers():
        index = order if buffer.dim() == 2 else order[..., None].expand(-1, -1, buffer.shape[-1])
        buffer[:, :count].copy_(torch.gather(buffer[:, :count], 1, index))


def sort_by_groups(layer, count: int, key_groups: str = "own") -> None:
    """After an eager step of several tokens, the last written at slot ``count - 1``: sort
    the first ``count`` slots by the groups their keys count in (the int64 bitmask; with
    ``key_groups="own_and_previous"`` their own and their predecessor's), positions
    ascending inside a group, padding last (two stable sorts: by position, then by group)."""
    origin = layer.focus_origin[:, :count]  # [b, count]
    by_position = torch.sort(origin, dim=1, stable=True).indices
    keys = layer.keys_routing(key_groups, with_probs=False)[1][:, :count]  # [b, count]
    members = torch.where(layer.focus_valid[:, :count], keys, _LAST)
    by_group = torch.sort(members.gather(1, by_position), dim=1, stable=True).indices
    _permute(layer, count, by_position.gather(1, by_group))  # [b, count] slot indices
    layer.focus_sorted = count


def crop_sorted(layer, keep: int) -> None:
    """Before transformers crops a static layer to ``keep`` tokens: if the prompt's sorted
    slots reach past ``keep``, put them back in cache order (the crop then overwrites slots
    ``keep ..``, as in an unsorted cache)."""
    count = getattr(layer, "focus_sorted", 0)
    if count > keep and layer.focus_origin is not None:
        order = torch.sort(layer.focus_origin[:, :count], dim=1).indices  # [b, count]
        _permute(layer, count, order)
        layer.focus_sorted = 0


def key_blocks(keep: Tensor, block: int = KEY_BLOCK) -> BlockMask:
    """A FlexAttention block mask of the kept pairs ``keep [b, q, L]`` (one query block; the
    keys in blocks of ``block``): a block is visited when some pair in it is kept, and without
    a mask when every pair in it is; inside the others ``keep`` itself is the mask."""
    b, q_len, length = keep.shape
    blocks = -(-length // block)
    padded = torch.nn.functional.pad(keep, (0, blocks * block - length))  # [b, q, nb * block]
    per_block = padded.view(b, q_len, blocks, block)  # [b, q, L'] -> [b, q, nb, block]
    full = per_block.all(dim=3).all(dim=1)  # [b, nb]: every pair kept
    partial = per_block.any(dim=3).any(dim=1) & ~full  # [b, nb]: some
    counts, indices = [], []
    for chosen in (partial, full):
        counts.append(chosen.sum(dim=1, dtype=torch.int32)[:, None, None])  # [b, 1, 1]
        order = torch.sort((~chosen).to(torch.int8), dim=1, stable=True).indices  # chosen first
        indices.append(order.to(torch.int32)[:, None, None, :])  # [b, 1, 1, nb]

    def mask_mod(batch, head, q_idx, kv_idx):
        return keep[batch, q_idx, kv_idx]

    return BlockMask.from_kv_blocks(
        counts[0],
        indices[0],
        counts[1],
        indices[1],
        BLOCK_SIZE=(128, block),  # one query block: q <= MAX_SPARSE_QUERIES
        mask_mod=mask_mod,
        seq_lengths=(q_len, length),
        compute_q_blocks=False,  # the backward's tables: inference needs none
    )


def _own_buffer(tensor: Tensor) -> Tensor:
    """``tensor`` contiguous in a buffer of its own shape when compiled (``as_strided`` makes
    inductor realize it); eagerly a view."""
    tensor = tensor.contiguous()
    return tensor.as_strided(tensor.shape, tensor.stride())


def sparse_static_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    keep: Tensor,
    *,
    scale: float,
    softcap: float | None,
    probs_q: Tensor | None = None,
    probs_k: Tensor | None = None,
    dot_lambda: float | None = None,
) -> Tensor:
    """Attention over the kept pairs only: ``query [b, H, q, d]``, ``key/value [b, G, L, d]``
    (the static cache), ``keep [b, q, L]`` (the hard pattern per slot) -> ``[b, q, H, d]``; a
    query with no key outputs zeros. ``dot_lambda``: the dot gate form's term
    ``lambda g_q . g_k`` on every pair (``probs_q [b, q, K]``, ``probs_k [b, L, K]``), added
    before soft-capping."""
    groups = probs_q.shape[-1] if dot_lambda is not None else 0

    def score_mod(score, batch, head, q_idx, kv_idx):
        for c in range(groups):  # the dot gate's term, one group at a time (K scalars)
            score = score + dot_lambda * probs_q[batch, q_idx, c] * probs_k[batch, kv_idx, c]
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        return score

    plain = dot_lambda is None and softcap is None
    # compiled, `keep` and the query must be buffers of their own: inductor's CPU FlexAttention
    # (torch 2.11 to 2.13) reads the mask's captured tensors before it realizes them (no
    # choice for a small elementwise one: a window-only twin's), and takes the query's buffer
    # for 4-D (GPT-2's is a view of the fused [b, 3 * hidden] projection)
    keep, query = _own_buffer(keep), _own_buffer(query)  # [b, q, L], [b, H, q, d]
    if probs_k is not None:
        probs_q, probs_k = probs_q.float(), probs_k.float()
    out = flex_attention(
        query,
        key.to(query.dtype),
        value.to(query.dtype),
        score_mod=None if plain else score_mod,
        block_mask=key_blocks(keep),
        scale=scale,
        enable_gqa=key.shape[1] != query.shape[1],
    )  # [b, H, q, d]
    return out.transpose(1, 2).contiguous()  # [b, H, q, d] -> [b, q, H, d]
