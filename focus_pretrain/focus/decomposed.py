"""The decomposed backend: hard top-1 Focus attention as varlen causal attention plus a band.

With ``top_k = 1`` the hard pattern is the disjoint union of

* A, same-group causal pairs: stably sort each sample's tokens by group (the
  :class:`~focus_pretrain.focus.sorted_layout.GroupSortedLayout`); every (sample, group) is then a
  contiguous segment in causal order, and A is ordinary causal attention inside each segment:
  **one varlen call** over all segments of the batch (cost ``~ n^2 / K``);
* B, the cross-group local band (``O(n w)``, :func:`~focus_pretrain.focus.band.band_attention`),
* C, with attention sinks, the sink keys neither A nor B covers (``O(n S)``,
  :func:`~focus_pretrain.focus.band.sink_attention`),

merged per query by log-sum-exp (exact: the parts are disjoint and their union is the pattern),
then unsorted. No Python loop over groups, samples or documents. A sliding-window layer is B
without the group test, plus C.

**Packed documents** (``documents``: ``[b, n]`` int64 document starts,
:func:`~focus_pretrain.focus.pattern.document_starts`): the sort key becomes ``(document start,
group)``, so the segments are the (sample, document, group) runs and A's one varlen call never
crosses a document; B keeps only pairs of one document; C uses each document's own first ``S``
tokens as sinks (``S`` gathered keys per query, ``O(n S)``). Each document then gets exactly
the attention it would get alone.

The varlen call, best first: ``flash_attn_varlen_func`` (CUDA, when ``flash-attn`` is
importable; it also takes Gemma-2's soft-capping), PyTorch's own FlashAttention varlen kernel
``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16, no soft-capping; it returns the
log-sum-exp), FlexAttention with a document mask on the sorted layout (CUDA), or PyTorch's
fused SDPA kernel on the segments right-padded per length bucket (CPU; it returns the
log-sum-exp the merge needs). On CUDA the band is a
FlexAttention sliding-window call; elsewhere the blockwise PyTorch band.

Inference only: the log-sum-exp of the fused kernels carries no gradient, so the backend
declines requests that need one (``backend="auto"`` then picks another).
Layout: ``[batch, seq, heads, head_dim]``.
"""

from __future__ import annotations

import importlib.util
import inspect
import math

import torch
from torch import Tensor

from focus_pretrain.focus import flex
from focus_pretrain.focus.backends import AttentionPattern
from focus_pretrain.focus.band import band_attention, with_sinks
from focus_pretrain.focus.lse import merge_by_lse
from focus_pretrain.focus.sorted_layout import GroupSortedLayout

# looked up once at import: backend selection runs inside compiled (and CUDA-graph captured)
# calls, where dynamo refuses ``importlib.util.find_spec`` (seen on an H200, 2026-11-26)
_FLASH_ATTN_FOUND = importlib.util.find_spec("flash_attn") is not None


def flash_attn_available() -> bool:
    """Whether the optional ``flash-attn`` package is importable (CUDA only)."""
    return torch.cuda.is_available() and _FLASH_ATTN_FOUND


def _load_torch_varlen():
    """PyTorch's varlen FlashAttention (``torch.nn.attention.varlen.varlen_attn``) and the names
    of its parameters, or ``None`` where this PyTorch has none."""
    try:
        from torch.nn.attention.varlen import AuxRequest, varlen_attn
    except ImportError:
        return None
    return varlen_attn, AuxRequest, frozenset(inspect.signature(varlen_attn).parameters)


_TORCH_VARLEN = _load_torch_varlen()  # once, outside any graph (as above)


def _torch_varlen():
    """:func:`_load_torch_varlen`'s answer, looked up at import."""
    return _TORCH_VARLEN


def torch_varlen_installed() -> bool:
    """Whether this PyTorch has ``torch.nn.attention.varlen.varlen_attn`` and CUDA is there."""
    return torch.cuda.is_available() and _torch_varlen() is not None


def torch_varlen_available(q: Tensor, softcap: float | None) -> bool:
    """Whether :func:`torch_varlen_causal` can take ``q`` (CUDA fp16/bf16, no soft-capping)."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and softcap is None
        and _torch_varlen() is not None
    )


def torch_varlen_causal(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, scale: float
) -> tuple[Tensor, Tensor]:
    """Causal attention inside each segment through ``varlen_attn``: packed ``q [T, H, D]``,
    ``k, v [T, Hkv, D]`` -> ``(out [T, H, D], lse [T, H] fp32)``.

    Adapts to the signature of the installed PyTorch: causality as ``is_causal`` (2.10-2.11)
    or ``window_size=(-1, 0)`` (later), GQA natively or by repeating K/V heads, the scale as an
    argument or folded into ``q``; the log-sum-exp is returned ``[T, H]`` or ``[H, T]``."""
    fn, aux_request, params = _torch_varlen()
    h, hkv = q.shape[1], k.shape[1]
    kwargs: dict = {"return_aux": aux_request(lse=True)}
    if "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    if hkv != h:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(h // hkv, dim=1)  # [T, Hkv, D] -> [T, H, D]
            v = v.repeat_interleave(h // hkv, dim=1)
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # the kernel's own scale is 1 / sqrt(D)
        q = q * (scale * math.sqrt(q.shape[-1]))
    out, lse = fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)
    if lse.shape[0] != q.shape[0]:
        lse = lse.transpose(0, 1)  # [H, T] -> [T, H]
    return out, lse.float()


def decomposed_attention(
    q: Tensor, k: Tensor, v: Tensor, pattern: AttentionPattern
) -> tuple[Tensor, Tensor]:
    """Hard top-1 (or sliding-window) Focus attention; see the module docstring.

    Args:
        q: ``[b, n, H, D]``; k, v: ``[b, n, Hkv, D]``.
        pattern: the pattern (:class:`~focus_pretrain.focus.backends.AttentionPattern`): hard
            mode with ``member`` ``[b, n]`` int64 one-bit memberships (``top_k = 1``), or a
            sliding-window layer; sinks (the first ``sinks`` positions of each document);
            ``documents`` ``[b, n]`` int64 document starts, or ``None``.

    Returns:
        ``(out [b, n, H, D], lse [b, n, H] fp32)``.
    """
    member, documents, sinks = pattern.member, pattern.documents, pattern.sinks
    common = dict(
        window=pattern.window, scale=pattern.scale, softcap=pattern.softcap, documents=documents
    )
    if pattern.local_only:
        result = _band(q, k, v, member=None, **common)
        return with_sinks(result, q, k, v, sinks=sinks, **common)
    if pattern.mode != "hard" or member is None:
        raise ValueError("the decomposed backend computes hard top-1 attention only")
    scale, softcap = pattern.scale, pattern.softcap
    layout = GroupSortedLayout.of_pattern(pattern)
    q_p, k_p, v_p = (layout.pack(t) for t in (q, k, v))  # [b * n, H|Hkv, D]
    out_a, lse_a = _segments_causal(q_p, k_p, v_p, layout, scale=scale, softcap=softcap)
    same_group = (layout.unpack(out_a), layout.unpack(lse_a))  # [b, n, H, D], [b, n, H]
    return with_cross_group_pairs(same_group, q, k, v, pattern)


def with_cross_group_pairs(
    same_group: tuple[Tensor, Tensor], q: Tensor, k: Tensor, v: Tensor, pattern: AttentionPattern
) -> tuple[Tensor, Tensor]:
    """A top-1 pattern's same-group part ``(out [b, n, H, D], lse [b, n, H])`` merged with the
    rest of its pairs: the cross-group local band (FlexAttention on CUDA, else PyTorch) and the
    cross-group sink pairs beyond the window; differentiable (flex on CUDA)."""
    common = dict(
        window=pattern.window, scale=pattern.scale, softcap=pattern.softcap,
        documents=pattern.documents,
    )  # fmt: skip
    cross_band = _band(q, k, v, member=pattern.member, **common)
    result = merge_by_lse(same_group, cross_band)
    return with_sinks(result, q, k, v, sinks=pattern.sinks, member=pattern.member, **common)


def _band(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    scale: float,
    softcap: float | None,
    member: Tensor | None,
    documents: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """The (cross-group with ``member``) local band inside each document: ``[b, n, H, D]``."""
    kwargs = dict(window=window, scale=scale, softcap=softcap, member=member, documents=documents)
    if q.is_cuda and flex.flex_available_on(q.device.type):
        return flex.band(q, k, v, **kwargs)
    return band_attention(q, k, v, **kwargs)


def _segments_causal(
    q: Tensor, k: Tensor, v: Tensor, layout: GroupSortedLayout, *, scale: float, softcap
) -> tuple[Tensor, Tensor]:
    """Causal attention inside each segment: packed ``[T, H|Hkv, D]`` -> ``([T, H, D], [T, H])``.

    The segments (``layout.cu_seqlens``) are the (sample, document, group) runs, so no call
    here crosses a document. The varlen kernels take the layout's fixed table (``b * C(K,
    top_k)`` entries, empty ones included) and its static ``max_seqlen``: no host sync. With
    packed documents the table would need an entry per token (a grid of ``b * n`` segments), so
    documents go through FlexAttention's document mask on the sorted layout instead; so does a
    CPU call under ``torch.compile`` (the padded SDPA buckets are read from the data)."""
    varlen = layout.document is None
    if varlen and flash_attn_available() and q.dtype in (torch.float16, torch.bfloat16):
        from flash_attn import flash_attn_varlen_func

        out, lse, _ = flash_attn_varlen_func(
            q,
            k,
            v,
            layout.cu_seqlens,
            layout.cu_seqlens,
            layout.max_seqlen,
            layout.max_seqlen,
            softmax_scale=scale,
            causal=True,
            softcap=0.0 if softcap is None else softcap,
            return_attn_probs=True,
        )
        return out, lse.transpose(0, 1).float()  # [H, T] -> [T, H]
    if varlen and torch_varlen_available(q, softcap):
        return torch_varlen_causal(q, k, v, layout.cu_seqlens, layout.max_seqlen, scale=scale)
    if flex.flex_available_on(q.device.type) and (q.is_cuda or torch.compiler.is_compiling()):
        return flex.same_group(q, k, v, layout, scale=scale, softcap=softcap)
    if softcap is not None:
        raise ValueError("soft-capping needs flash-attn or FlexAttention in the decomposed backend")
    return _padded_sdpa(q, k, v, layout, scale=scale)


def _padded_sdpa(
    q: Tensor, k: Tensor, v: Tensor, layout: GroupSortedLayout, *, scale: float
) -> tuple[Tensor, Tensor]:
    """CPU: segments right-padded per length bucket, one fused causal SDPA call per bucket.

    Right padding is exact under the causal mask: a real query never sees a later (padded) key.
    """
    h, hkv = q.shape[1], k.shape[1]
    if hkv != h:  # GQA: the fused CPU kernel wants one KV head per query head
        k = k.repeat_interleave(h // hkv, dim=1)  # [T, Hkv, D] -> [T, H, D]
        v = v.repeat_interleave(h // hkv, dim=1)
    out = torch.empty_like(q)  # [T, H, D]
    lse = q.new_empty(q.shape[:2], dtype=torch.float32)  # [T, H]
    for bucket in layout.padded_buckets():  # at most log2(n) + 1 calls
        padded = [bucket.to_padded(t).transpose(1, 2) for t in (q, k, v)]  # [S_v, H, L, D]
        seg_out, seg_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *padded, 0.0, True, scale=scale
        )  # [S_v, H, L, D], [S_v, H, L]
        bucket.scatter(seg_out.transpose(1, 2), out)  # [S_v, L, H, D] -> rows of [T, H, D]
        bucket.scatter(seg_lse.transpose(1, 2).float(), lse)  # [S_v, L, H] -> rows of [T, H]
    return out, lse
