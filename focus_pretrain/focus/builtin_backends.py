"""The built-in attention backends, registered in one table (:mod:`~focus_pretrain.focus.backends`):
each one's function, what it computes (:class:`~focus_pretrain.focus.backends.Capabilities`),
where ``auto`` prefers it (its priority) and its ring step kernel, if any.

This module imports the backends' modules and nothing that imports it back, so the config
(:mod:`focus_pretrain.focus.config`) and the dispatcher
(:func:`~focus_pretrain.focus.attention.focus_attention`) both import it at module level: the
registry is full whichever is imported first. A new backend is its module plus one
``register_backend`` call here (docs/architecture.md).
"""

from __future__ import annotations

import torch

from focus_pretrain.focus import flex
from focus_pretrain.focus.backends import (
    AttentionRequest,
    Backend,
    Capabilities,
    register_backend,
)
from focus_pretrain.focus.decomposed import (
    decomposed_attention,
    flash_attn_available,
    torch_varlen_installed,
)
from focus_pretrain.focus.flex import flex_focus_attention
from focus_pretrain.focus.pattern_settings import KEY_GROUPS
from focus_pretrain.focus.reference import reference_attention
from focus_pretrain.focus.sdpa import sdpa_attention, sdpa_priority, sdpa_refusal
from focus_pretrain.focus.segments import segments_attention
from focus_pretrain.focus.soft_triton import cuda_refusal, runs_on, supports
from focus_pretrain.focus.soft_triton_launch import precision_class
from focus_pretrain.focus.sorted_triton import triton_attention
from focus_pretrain.focus.triton_tiles import TRAINING_MODES, triton_fastest_here

CPU_DECOMPOSED_MIN_SEQ = 1024  # below it the reference is as fast on CPU (docs/benchmarks.md)
_FAST_GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _decomposed_priority(r: AttentionRequest) -> int | None:
    # packed documents (r.documents) are exact here: segments, band and sinks are per document
    if r.device == "cuda":
        # a FlashAttention varlen kernel (flash-attn, or PyTorch's without soft-capping) beats
        # flex for hard top-1 at 4K-64K and ties at 256K (H100, docs/benchmarks.md)
        varlen = flash_attn_available() or (torch_varlen_installed() and not r.softcap)
        if varlen and r.dtype in (torch.float16, torch.bfloat16):
            return 30
        return 15 if flex.flex_available_on(r.device) and r.dtype in _FAST_GPU_DTYPES else None
    if r.softcap and not r.local_only:  # CPU: its padded SDPA segments take no soft-capping
        return None
    return 10 if r.seq >= CPU_DECOMPOSED_MIN_SEQ and not r.local_only else -10


def _flex_priority(r: AttentionRequest) -> int | None:
    if r.device == "cuda":
        return 20 if flex.flex_available_on(r.device) and r.dtype in _FAST_GPU_DTYPES else None
    return -20  # CPU FlexAttention: eager, exact, never automatic


def _segments_priority(r: AttentionRequest) -> int | None:
    # differentiable top-1 on the sorted layout: CPU sparse training's path at length (on
    # CUDA flex is block-sparse and compiled; this one reads block starts on the host)
    if r.device == "cuda":
        return -5
    return 5 if r.seq >= CPU_DECOMPOSED_MIN_SEQ else -5


def _triton_priority(r: AttentionRequest) -> int | None:
    if not runs_on(r.device, r.dtype) or not supports(r.head_dim) or _triton_unavailable(r):
        return None
    # ``auto`` trains on it (the soft gate, sparse training) where the tile table measured it
    # fastest for this GPU at the nearest length (focus/triton_tiles.json, tools/tune_triton.py);
    # elsewhere by name only
    fastest = r.kind in TRAINING_MODES and r.needs_grad and r.device == "cuda"
    if fastest and triton_fastest_here(precision_class(r.dtype), r.head_dim, r.kind, r.seq):
        return 40
    return -30


def _triton_unavailable(r: AttentionRequest) -> str | None:
    if r.device != "cuda":
        return None
    packed = r.kind in ("hard", "hard_gated")  # top-1 on the group-sorted layout
    return cuda_refusal(r.dtype, r.head_dim, packed=packed)


_ALL_MODES = frozenset({"soft", "hard", "hard_gated", "local"})
_CPU_CUDA = frozenset({"cpu", "cuda"})
_ALL_KEY_GROUPS = frozenset(KEY_GROUPS)
register_backend(
    Backend(
        "reference",
        reference_attention,
        Capabilities(_ALL_MODES, key_groups=_ALL_KEY_GROUPS),
        lambda r: 0,
        "blockwise",
    )
)
register_backend(
    Backend(
        "decomposed",
        decomposed_attention,
        Capabilities(
            frozenset({"hard", "local"}), max_top_k=1, devices=_CPU_CUDA, gradients_on=frozenset()
        ),
        _decomposed_priority,
    )
)
register_backend(
    Backend(
        "flex",
        flex_focus_attention,
        Capabilities(
            _ALL_MODES,
            devices=_CPU_CUDA,
            gradients_on=frozenset({"cuda"}),
            key_groups=_ALL_KEY_GROUPS,
        ),
        _flex_priority,
        "flex",  # the ring's fused step on CUDA (compiled FlexAttention with a block mask)
    )
)
register_backend(
    Backend(
        "segments",
        segments_attention,
        Capabilities(frozenset({"hard", "hard_gated"}), max_top_k=1),
        _segments_priority,
    )
)
register_backend(  # plain causal attention (the dense twin, the dot gate's soft pattern)
    Backend(
        "sdpa",
        sdpa_attention,
        Capabilities(frozenset({"local"}), documents=False, softcap=False),
        sdpa_priority,
        None,
        sdpa_refusal,
    )
)
register_backend(
    Backend(
        "triton",
        triton_attention,
        Capabilities(frozenset({"soft", "local", "hard", "hard_gated"}), max_top_k=1),
        _triton_priority,
        "triton",
        _triton_unavailable,
        ring_modes=frozenset({"soft", "local"}),  # its ring step: the soft gate and windows
        ring_priority=lambda r: None,  # in the ring by name only (its tiles: whole sequences)
    )
)
