"""The FlexAttention backend: block-sparse hard Focus for any ``top_k``, soft gate as ``score_mod``.

* **hard** (any ``top_k``): the pattern is split like the decomposed backend's: pairs that share a
  group (causal) are computed on the :class:`~focus_pretrain.focus.sorted_layout.GroupSortedLayout`
  where they are block-sparse, and the cross-group local band on the original layout; the two are
  merged by log-sum-exp. On the sorted layout the block mask keeps a (query block, key block)
  only when the blocks' OR-ed membership bitmasks intersect, their samples overlap and some key
  is not after some query; a block is *full* (no per-pair mask) when both blocks hold one sample
  and one bitmask and every key precedes every query. Tokens of equal bitmask are contiguous, so
  for ``top_k = 1`` this is a block-diagonal document mask, and for ``top_k = 2`` of ``K = 8``
  a query block meets 13 of the 28 bitmask segments: the pair-count ideal, at block granularity.
  Block masks are built from per-block summaries (``O(n / B)`` work per block row; no ``n x n``
  pair evaluation).
* **soft** (training): one causal call whose ``score_mod`` adds the gate
  ``log sigmoid(lambda (g_i . g_j - 1/2))`` to pairs beyond the window (sink keys excepted),
  reading the soft assignments ``[K, b, n]`` by index: nothing ``n x n`` is materialised, and on
  GPU the gradient flows to ``q``, ``k``, ``v`` and the assignments.
* **local only**: one sliding-window call.
* **sinks** (hard and local only): the sink keys neither the window nor the groups cover are a
  third part, :func:`~focus_pretrain.focus.band.sink_attention` (``O(n S)``), merged likewise.

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

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

try:  # PyTorch >= 2.9 asks for auxiliary outputs this way (return_lse is deprecated)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - older PyTorch
    AuxRequest = None

from focus_pretrain.focus.band import merge_by_lse, with_sinks
from focus_pretrain.focus.pattern import member_bits
from focus_pretrain.focus.sorted_layout import GroupSortedLayout

DEFAULT_BLOCK = 128  # FlexAttention's sparse block size


def flex_available_on(device: str) -> bool:
    """FlexAttention can run here: CUDA with Triton (compiled), or CPU (eager, forward only)."""
    if device == "cuda":
        return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
    return device == "cpu"


@functools.cache
def _compiled_flex():
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
    """``q [B, L, H, D]``, ``k/v [B, L, Hkv, D]`` -> ``(out [B, L, H, D], lse [B, L, H] fp32)``."""
    fn = _compiled_flex() if q.is_cuda else flex_attention
    q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))  # [B, L, H, D] -> [B, H, L, D]
    lse_request = {"return_aux": AuxRequest(lse=True)} if AuxRequest else {"return_lse": True}
    with warnings.catch_warnings():  # CPU runs eagerly on purpose (exact; tests, not speed)
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        out, aux = fn(
            q4,
            k4,
            v4,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=k.shape[2] != q.shape[2],
            **lse_request,
        )  # [B, H, L, D], [B, H, L]
    lse = aux.lse if AuxRequest else aux
    return out.transpose(1, 2), lse.transpose(1, 2).float()  # [B, L, H, D], [B, L, H]


def _block_mask(
    candidate: Tensor, full: Tensor | None, mask_mod, seq_len: int, block: int
) -> BlockMask:
    """A ``BlockMask`` from dense block predicates ``[nb, nb]`` (partial = candidate & ~full)."""

    def ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
        num = dense.sum(dim=-1, dtype=torch.int32)  # [nb]
        idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
        return num[None, None], idx.to(torch.int32)[None, None]  # [1, 1, nb], [1, 1, nb, nb]

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
        seq_lengths=(seq_len, seq_len),
    )


def same_group_block_mask(layout: GroupSortedLayout, block: int = DEFAULT_BLOCK) -> BlockMask:
    """Block mask of the pairs that share a group (causal), on the packed sorted layout."""
    total = layout.order.numel()
    nb = -(-total // block)
    pad = nb * block - total
    device = layout.order.device
    member, sample = layout.member, layout.sample
    gpos = sample * layout.seq + layout.position  # [T] position in the flattened batch

    def mask_mod(b, h, q_idx, kv_idx):
        shares = (member[q_idx] & member[kv_idx]) != 0
        return shares & (sample[q_idx] == sample[kv_idx]) & (gpos[q_idx] >= gpos[kv_idx])

    # OR of the bitmasks in each block, through segments (a block holds few of them)
    seg_member = member[layout.cu_seqlens[:-1].long()]  # [S]
    seg_bits = member_bits(seg_member).to(torch.int32)  # [S, 64]
    first_block = layout.cu_seqlens[:-1].long() // block  # [S]
    last_block = (layout.cu_seqlens[1:].long() - 1) // block
    delta = torch.zeros(nb + 1, 64, dtype=torch.int32, device=device)
    delta.index_add_(0, first_block, seg_bits)
    delta.index_add_(0, last_block + 1, -seg_bits)
    block_bits = torch.cumsum(delta[:nb], dim=0) > 0  # [nb, 64]
    shares = (block_bits.to(torch.float32) @ block_bits.t().to(torch.float32)) > 0  # [nb, nb]

    big = torch.iinfo(torch.int64).max
    gpos_blocks = F.pad(gpos, (0, pad), value=big).view(nb, block)
    gpos_min = gpos_blocks.amin(dim=1)
    gpos_max = F.pad(gpos, (0, pad), value=-1).view(nb, block).amax(dim=1)
    sample_first = sample[torch.arange(nb, device=device) * block]  # packed sample-major
    sample_last = sample[torch.clamp(torch.arange(1, nb + 1, device=device) * block, max=total) - 1]
    candidate = (
        shares
        & (sample_first[:, None] <= sample_last[None, :])
        & (sample_first[None, :] <= sample_last[:, None])
        & (gpos_min[None, :] <= gpos_max[:, None])
    )
    seg_first = layout.segment[torch.arange(nb, device=device) * block]
    seg_last = layout.segment[
        torch.clamp(torch.arange(1, nb + 1, device=device) * block, max=total) - 1
    ]
    pure = seg_first == seg_last  # one sample and one bitmask
    pure[-1] &= pad == 0
    full = candidate & pure[:, None] & pure[None, :] & (gpos_max[None, :] <= gpos_min[:, None])
    return _block_mask(candidate, full, mask_mod, total, block)


def band_block_mask(
    seq_len: int,
    window: int,
    member: Tensor | None,
    device: torch.device,
    block: int = DEFAULT_BLOCK,
) -> BlockMask:
    """Block mask of ``0 <= i - j <= window`` (and, with ``member [b, n]``, disjoint groups)."""
    nb = -(-seq_len // block)
    first = torch.arange(nb, device=device) * block  # [nb] first position of each block
    last = first + block - 1
    candidate = (first[None, :] <= last[:, None]) & (last[None, :] >= first[:, None] - window)

    if member is None:

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

        full = (
            candidate
            & (last[None, :] <= first[:, None])
            & (last[:, None] - first[None, :] <= window)
        )
        return _block_mask(candidate, full, mask_mod, seq_len, block)

    def cross_mask_mod(b, h, q_idx, kv_idx):
        local = (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
        return local & ((member[b, q_idx] & member[b, kv_idx]) == 0)

    return _block_mask(candidate, None, cross_mask_mod, seq_len, block)


def causal_block_mask(seq_len: int, device: torch.device, block: int = DEFAULT_BLOCK) -> BlockMask:
    """Block mask of causal attention (blocks strictly below the diagonal are full)."""
    nb = -(-seq_len // block)
    blocks = torch.arange(nb, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return _block_mask(
        blocks[None, :] <= blocks[:, None],
        blocks[None, :] < blocks[:, None],
        mask_mod,
        seq_len,
        block,
    )


def _softcap_mod(softcap: float | None):
    if softcap is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def same_group(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: GroupSortedLayout,
    *,
    scale: float,
    softcap: float | None,
    block: int = DEFAULT_BLOCK,
) -> tuple[Tensor, Tensor]:
    """Pairs sharing a group on the packed layout: ``[T, H|Hkv, D]`` -> ``([T, H, D], [T, H])``."""
    mask = same_group_block_mask(layout, block)
    out, lse = _call(
        q[None], k[None], v[None], block_mask=mask, scale=scale, score_mod=_softcap_mod(softcap)
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
) -> tuple[Tensor, Tensor]:
    """The local band (cross-group only with ``member [b, n]``): ``[b, n, H, D]`` layout."""
    n = q.shape[1]
    mask = band_block_mask(n, min(window, n), member, q.device, block)
    return _call(q, k, v, block_mask=mask, scale=scale, score_mod=_softcap_mod(softcap))


def soft(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor,
    *,
    window: int,
    gate_lambda: float,
    scale: float,
    softcap: float | None,
    sinks: int = 0,
    block: int = DEFAULT_BLOCK,
) -> tuple[Tensor, Tensor]:
    """Soft-gated causal attention; the gate is a ``score_mod`` reading ``probs [b, n, K]``,
    applied beyond the window to keys that are not sinks (positions ``>= sinks``)."""
    g = probs.float().permute(2, 0, 1).contiguous()  # [b, n, K] -> [K, b, n]
    num_groups = g.shape[0]

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        affinity = g[0, b, q_idx] * g[0, b, kv_idx]
        for c in range(1, num_groups):
            affinity = affinity + g[c, b, q_idx] * g[c, b, kv_idx]
        x = gate_lambda * (affinity - 0.5)
        gate = torch.clamp(x, max=0.0) - torch.log1p(torch.exp(-torch.abs(x)))  # log sigmoid
        gated = q_idx - kv_idx > window
        if sinks:
            gated = gated & (kv_idx >= sinks)
        return score + torch.where(gated, gate, torch.zeros_like(gate))

    mask = causal_block_mask(q.shape[1], q.device, block)
    return _call(q, k, v, block_mask=mask, scale=scale, score_mod=score_mod)


def flex_focus_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    probs: Tensor | None,
    member: Tensor | None,
    window: int,
    mode: str,
    gate_lambda: float,
    softcap: float | None,
    scale: float,
    local_only: bool,
    sinks: int = 0,
    block: int = DEFAULT_BLOCK,
) -> tuple[Tensor, Tensor]:
    """Backend entry (see :class:`focus_pretrain.focus.attention.Backend`): ``[b, n, H, D]``."""
    sink_kwargs = dict(window=window, sinks=sinks, scale=scale, softcap=softcap)
    if local_only:
        result = band(
            q, k, v, window=window, scale=scale, softcap=softcap, member=None, block=block
        )
        return with_sinks(result, q, k, v, **sink_kwargs)
    if mode == "soft":
        return soft(
            q,
            k,
            v,
            probs,
            window=window,
            gate_lambda=gate_lambda,
            scale=scale,
            softcap=softcap,
            sinks=sinks,
            block=block,
        )
    layout = GroupSortedLayout.build(member)
    packed = (layout.pack(t) for t in (q, k, v))  # [b * n, H|Hkv, D]
    out_a, lse_a = same_group(*packed, layout, scale=scale, softcap=softcap, block=block)
    shared = (layout.unpack(out_a), layout.unpack(lse_a))  # [b, n, H, D], [b, n, H]
    cross = band(q, k, v, window=window, scale=scale, softcap=softcap, member=member, block=block)
    return with_sinks(merge_by_lse(shared, cross), q, k, v, member=member, **sink_kwargs)
