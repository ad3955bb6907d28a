"""The ``triton`` backend: soft-gated training attention as one fused kernel per pass.

FlexAttention's soft gate (:func:`focus_pretrain.focus.flex.soft`) reads the ``2K`` assignment
tables in its ``score_mod`` and, in the backward pass, accumulates their gradient with atomic
adds per score: on an H100 that made a 1B Focus training step 4x its dense twin's
(docs/benchmarks.md). Here the gate is part of the tile computation
(:mod:`~focus_pretrain.focus.soft_triton_kernels`): the affinities ``G_q G_k^T`` and the
assignment gradients ``dA G_k``, ``dA^T G_q`` are small matrix products in the tile, with no
atomics. The function is exactly the reference's: causal attention, the soft gate
(:func:`~focus_pretrain.focus.pattern.soft_gate`) on pairs beyond the window whose key is not a
sink, optional soft-capping before the gate, packed documents (no pair across documents; the sinks
are each document's first ``S`` tokens). Sliding-window layers (``local_only``: no router; the
dense twin is one with an unlimited window) run through the same kernels without the gate, so a
model configured with ``focus.backend: triton`` runs every layer on them.

Runs on CUDA (fp16/bf16; fp32 at head dim <= 64, or at any head dim with TF32 allowed:
:func:`fp32_products`, :func:`cuda_refusal`) wherever Triton is installed, and on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported: the CPU tests
do this), where it is exact and slow. ``auto`` does not pick it yet: it is selected with
``backend="triton"`` (model config ``focus.backend: triton``) until its GPU speed is measured
(docs/benchmarks.md).
Layout: ``[batch, seq, heads, head_dim]``.

The launches are operators (``torch.ops.focus_pretrain.soft_attention_forward`` and
``soft_attention_backward``, :func:`torch.library.custom_op`) with fake (meta) implementations
and the backward registered as the forward's autograd formula: eager calls, autograd and
``torch.compile(fullgraph=True)`` (which traces through them as opaque nodes) run the same code.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from focus_pretrain.focus.backends import AttentionPattern

HEAD_DIMS = (16, 32, 64, 128, 256)  # tl.arange needs a power of two (and tl.dot >= 16)


# looked up once (without importing Triton); a constant, so that dynamo traces the check
_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    """Whether the ``triton`` package is importable."""
    return _TRITON_FOUND


def interpreter_on() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def runs_on(device: str, dtype: torch.dtype) -> bool:
    """Whether the kernels can run here: CUDA with Triton (fp16/bf16/fp32), or CPU tensors under
    Triton's interpreter (fp32/fp16: NumPy has no bfloat16)."""
    if not triton_installed():
        return False
    if device == "cuda":
        return torch.cuda.is_available() and dtype in (torch.float16, torch.bfloat16, torch.float32)
    return device == "cpu" and interpreter_on() and dtype in (torch.float32, torch.float16)


def supports(head_dim: int) -> bool:
    """Head dims the kernels take: powers of two, 16-256 (:data:`HEAD_DIMS`)."""
    return head_dim in HEAD_DIMS


# (forward, dK/dV, dQ) tiles (BM, BN) per head dim, none spilling a register on sm_90
# (docs/benchmarks.md "Triton kernels on sm_90"; tests/unit/test_triton_registers.py).
# fp16/bf16: 4 warps and 3 stages at D <= 64, else 8 warps and 2 stages
HALF_TILES = {
    64: ((64, 32), (16, 32), (32, 32)),
    128: ((64, 32), (32, 32), (32, 32)),
    256: ((32, 64), (16, 32), (16, 64)),
}
# fp32 inputs with TF32 products (the user allowed TF32 for fp32 matmuls): one stage, 4 warps at
# D <= 64, else 8
TF32_TILES = {
    64: ((64, 32), (16, 32), (64, 16)),
    128: ((32, 32), (32, 32), (32, 16)),
    256: ((32, 32), (16, 32), (16, 32)),
}
# fp32 inputs with 3xTF32 products (PyTorch's default fp32 precision): one stage, 4 warps. Only
# D <= 64: at D >= 128 the backward spills at every tile from 16x16 up with 1-8 warps (each
# operand is held split in two), so the backend refuses those (:func:`cuda_refusal`)
FP32_TILES = {64: ((64, 32), (16, 16), (64, 16))}


@torch.compiler.assume_constant_result
def fp32_products() -> str:
    """How the kernels multiply fp32 inputs on CUDA: ``"tf32"`` when the user allowed TF32 for
    fp32 matmuls (``torch.backends.cuda.matmul.fp32_precision = "tf32"``,
    ``torch.set_float32_matmul_precision("high")`` or ``allow_tf32 = True``, as for cuBLAS),
    else ``"tf32x3"`` (fp32-class accuracy, PyTorch's default)."""
    try:
        allowed = torch.backends.cuda.matmul.fp32_precision == "tf32"
    except (AttributeError, RuntimeError):  # torch without the fp32_precision API
        allowed = bool(torch.backends.cuda.matmul.allow_tf32)
    return "tf32" if allowed else "tf32x3"


def _tile_size(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def cuda_refusal(dtype: torch.dtype, head_dim: int, packed: bool = False) -> str | None:
    """Why the kernels are not launched on CUDA for ``dtype`` at ``head_dim`` (``None``: they
    are): fp32 with 3xTF32 products at head dims above 64, or fp32 at head dim 256 on the
    group-sorted layout (``packed``: sparse training), would spill registers."""
    if packed and dtype == torch.float32 and _tile_size(head_dim) > 128:
        return (
            f"fp32 at head_dim {head_dim} on the group-sorted layout (hard top-1): its dQ kernel "
            "spills registers at every tile (docs/benchmarks.md); train in bf16/fp16 or use "
            "backend 'flex'"
        )
    if dtype != torch.float32 or fp32_products() != "tf32x3" or _tile_size(head_dim) in FP32_TILES:
        return None
    return (
        f"fp32 at head_dim {head_dim} with PyTorch's default fp32 matmul precision: the 3xTF32 "
        "backward kernels spill registers above head_dim 64 (docs/benchmarks.md); train in "
        "bf16/fp16, allow TF32 (torch.backends.cuda.matmul.fp32_precision = 'tf32'), or use "
        "backend 'flex'"
    )


# the group-sorted layout's calls (PACKED) at half precision: the dK/dV kernel's loop bounds
# cost registers; its 32 x 32 tile spilled 4 bytes at head dim 128, 16 x 32 spills none
PACKED_HALF_TILES = {128: {"kv": (16, 32)}}


def _blocks(
    device: str, head_dim: int, dtype: torch.dtype = torch.bfloat16, packed: bool = False
) -> dict:
    """Tile sizes ``(BM, BN)`` of each kernel and launch options.

    CUDA: per head dim and input precision (:data:`HALF_TILES`; fp32: :data:`TF32_TILES` or
    :data:`FP32_TILES` by :func:`fp32_products`): tiles that compile for sm_90 with no register
    spill within an H100's shared memory
    (``tools/compile_triton_kernels.py`` reads both from Triton's compiler and ``ptxas``, no GPU
    needed); not yet tuned for speed. ``FOCUS_TRITON_BLOCKS`` overrides them for tuning, e.g.
    ``fwd=128x64,kv=64x128,q=128x64,warps=8,stages=2`` (any subset). Interpreter: small square
    tiles (``FOCUS_TRITON_TEST_BLOCK``, default 16: many blocks on small tests)."""
    if device != "cuda":
        block = int(os.environ.get("FOCUS_TRITON_TEST_BLOCK", "16"))
        return {"fwd": (block, block), "kv": (block, block), "q": (block, block), "opts": {}}
    half = dtype != torch.float32
    size = _tile_size(head_dim)
    tiles = HALF_TILES if half else TF32_TILES if fp32_products() == "tf32" else FP32_TILES
    blocks = dict(zip(("fwd", "kv", "q"), tiles.get(size, TF32_TILES[size]), strict=True))
    if packed and half:
        blocks.update(PACKED_HALF_TILES.get(size, {}))
    opts = {
        "num_warps": 4 if size == 64 else 8,
        "num_stages": (3 if size == 64 else 2) if half else 1,
    }
    override = os.environ.get("FOCUS_TRITON_BLOCKS", "")
    for item in filter(None, (part.strip() for part in override.split(","))):
        key, _, value = item.partition("=")
        try:
            if key in blocks:
                bm, bn = (int(x) for x in value.split("x"))
                blocks[key] = (bm, bn)
            elif key in ("warps", "stages"):
                opts[f"num_{key}"] = int(value)
            else:
                raise ValueError(key)
        except ValueError:
            raise ValueError(
                f"FOCUS_TRITON_BLOCKS: bad item {item!r}; expected fwd|kv|q=BMxBN (powers of "
                "two >= 16) or warps|stages=N, comma-separated"
            ) from None
    return {**blocks, "opts": opts}


def _precisions(q: Tensor) -> tuple[str, str]:
    """``(QK_PREC, GATE_PREC)``: on CUDA fp32 inputs' products follow PyTorch's fp32 matmul
    precision (:func:`fp32_products`: 3xTF32 by default, TF32 when allowed); the gate's
    assignments always use 3xTF32; fp16/bf16 inputs are tensor-core native. The interpreter
    computes in IEEE fp32."""
    if not q.is_cuda:
        return "ieee", "ieee"
    return (fp32_products() if q.dtype == torch.float32 else "tf32"), "tf32x3"


def _document_ends(starts: Tensor) -> Tensor:
    """``[b, n]`` document starts -> ``[b, n]`` int64 start of the next document (``n`` for the
    last): where each token's document ends."""
    b, n = starts.shape
    positions = torch.arange(n, device=starts.device).expand(b, n)
    is_start = starts == positions  # [b, n]
    next_start = torch.where(is_start, positions, torch.full_like(positions, n))
    next_start = torch.cat([next_start[:, 1:], next_start.new_full((b, 1), n)], dim=1)
    ends = torch.flip(torch.cummin(torch.flip(next_start, [1]), dim=1).values, [1])  # [b, n]
    return ends.contiguous()


def _strided(t: Tensor) -> Tensor:
    """``t`` itself when the kernels can read it in place (unit stride on the head dim, and a
    dense layout that ``empty_like`` reproduces, so that gradients get the same strides), else a
    contiguous copy. Megatron's ``[s, b, h, d]`` viewed as ``[b, s, h, d]`` is read in place."""
    if t.stride(-1) == 1 and torch.empty_like(t).stride() == t.stride():
        return t
    return t.contiguous()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclass(frozen=True)
class _Settings:
    """What the kernels of one call share besides the tensors."""

    window: int
    lam: float
    softcap: float | None
    scale: float
    sinks: int
    num_groups: int
    kp: int
    local: bool
    documents: bool
    positions: bool
    packed: bool = False  # positions for the pair rule, loops bounded by index (one sequence)

    def scalars(self) -> tuple:
        """``(scale, lam, window, sinks, cap)`` in the kernels' argument order."""
        cap = 1.0 if self.softcap is None else float(self.softcap)
        return float(self.scale), float(self.lam), int(self.window), int(self.sinks), cap

    def constants(self, q: Tensor) -> dict:
        """The kernels' compile-time arguments and launch options."""
        qk_prec, gate_prec = _precisions(q)
        return dict(
            D=q.shape[-1],
            KP=self.kp,
            HAS_DOCS=self.documents,
            HAS_POS=self.positions,
            SOFTCAP=self.softcap is not None,
            LOCAL=self.local,
            QK_PREC=qk_prec,
            GATE_PREC=gate_prec,
            PACKED=self.packed,
            **_blocks(q.device.type, q.shape[-1], q.dtype, self.packed)["opts"],
        )


def _table(probs: Tensor | None, kp: int) -> Tensor | None:
    """``[b, L, K]`` assignments -> ``[b, L, KP]`` fp32, zero-padded (``None`` stays)."""
    if probs is None:
        return None
    g = probs.new_zeros(*probs.shape[:2], kp, dtype=torch.float32)
    g[..., : probs.shape[-1]] = probs.detach()
    return g


def _positions(pos: Tensor | None, b: int) -> tuple[Tensor | None, int]:
    """``[L]`` or ``[b, L]`` positions -> (int64 contiguous, batch stride: 0 when shared)."""
    if pos is None:
        return None, 0
    pos = pos.to(torch.int64).contiguous()
    return pos, (0 if pos.dim() == 1 or (pos.shape[0] == 1 and b > 1) else pos.shape[-1])


@dataclass(frozen=True)
class _Launch:
    """One call's kernel inputs, made launchable: ``q, k, v`` readable in place (or copied),
    the assignments as padded fp32 tables, documents and positions contiguous, and the
    shared :class:`_Settings`. Built by both ops from their own arguments."""

    q: Tensor
    k: Tensor
    v: Tensor
    g_q: Tensor | None
    g_k: Tensor | None
    doc_q: Tensor | None
    doc_k: Tensor | None
    pos_q: Tensor | None
    pos_k: Tensor | None
    pos_strides: tuple[int, int]
    settings: _Settings

    @staticmethod
    def build(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        probs_q: Tensor | None,
        probs_k: Tensor | None,
        doc_q: Tensor | None,
        doc_k: Tensor | None,
        pos_q: Tensor | None,
        pos_k: Tensor | None,
        options: tuple,
    ) -> _Launch:
        """``options``: ``(window, gate_lambda, softcap, scale, sinks, packed)``."""
        b, lq = q.shape[:2]
        local = probs_q is None  # a sliding-window layer: no gate, pairs beyond the window cut
        num_groups = 0 if local else probs_q.shape[-1]
        kp = max(16, _next_pow2(num_groups))
        q, k, v = (_strided(t) for t in (q, k, v))  # views kept (e.g. Megatron's [s, b, ...])
        g_q = _table(probs_q, kp)
        g_k = g_q if probs_k is probs_q else _table(probs_k, kp)
        doc_q, doc_k = (None if t is None else t.contiguous() for t in (doc_q, doc_k))
        (pos_q, stride_pq), (pos_k, stride_pk) = _positions(pos_q, b), _positions(pos_k, b)
        window, gate_lambda, softcap, scale, sinks, packed = options
        positions = pos_q is not None
        if packed and (not positions or doc_q is None or lq != k.shape[1]):
            raise ValueError("packed=True needs positions, document starts and Lq == Lk")
        settings = _Settings(
            window=window if positions else min(window, lq), lam=gate_lambda, softcap=softcap,
            scale=scale, sinks=sinks, num_groups=num_groups, kp=kp, local=local,
            documents=doc_q is not None, positions=positions, packed=packed,
        )  # fmt: skip
        return _Launch(
            q, k, v, g_q, g_k, doc_q, doc_k, pos_q, pos_k, (stride_pq, stride_pk), settings
        )


def _check_launch(q: Tensor, k: Tensor, probs_q: Tensor | None) -> None:
    """Raise ``ValueError`` before any work when the kernels' grid or 32-bit offsets cannot
    hold the call (shapes only: checked eagerly and while tracing)."""
    b, lq, h = q.shape[:3]
    lk = k.shape[1]
    kp = max(16, _next_pow2(0 if probs_q is None else probs_q.shape[-1]))
    if b * h > 65535:  # the grid's second axis
        raise ValueError(
            f"the triton backend launches batch x heads = {b * h} programs on a grid axis "
            "limited to 65535; split the batch or use backend='flex'"
        )
    if max(q.numel(), k.numel(), b * h * max(lq, lk) * kp) >= 2**31:
        raise ValueError(
            f"the triton backend indexes with 32-bit offsets; q {tuple(q.shape)} is too large: "
            "shard the sequence (context parallelism) or use backend='flex'"
        )


@torch.library.custom_op("focus_pretrain::soft_attention_forward", mutates_args=())
def soft_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs_q: Tensor | None,
    probs_k: Tensor | None,
    doc_q: Tensor | None,
    doc_k: Tensor | None,
    pos_q: Tensor | None,
    pos_k: Tensor | None,
    window: int,
    gate_lambda: float,
    softcap: float | None,
    scale: float,
    sinks: int,
    packed: bool,
) -> tuple[Tensor, Tensor]:
    """The forward kernel as an operator: ``(out [b, Lq, H, D] (q's strides when read in
    place), lse [b, H, Lq] fp32)``. Arguments as :func:`attend`'s; ``probs_q=None``: a
    sliding-window layer. Differentiable (:func:`_setup_context`, :func:`_backward`)."""
    from focus_pretrain.focus import soft_triton_kernels as kernels

    run = _Launch.build(
        q, k, v, probs_q, probs_k, doc_q, doc_k, pos_q, pos_k,
        (window, gate_lambda, softcap, scale, sinks, packed),
    )  # fmt: skip
    q, k, v = run.q, run.k, run.v
    b, lq, h, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    out = torch.empty_like(q)  # [b, Lq, H, D]
    lse = torch.empty(b, h, lq, device=q.device, dtype=torch.float32)  # [b, H, Lq]
    sides = [q if t is None else t for t in (run.g_q, run.g_k, run.doc_q, run.doc_k)]
    sides += [q if t is None else t for t in (run.pos_q, run.pos_k)]
    bm, bn = _blocks(q.device.type, d, q.dtype, packed)["fwd"]
    kernels.soft_forward_kernel[(_cdiv(lq, bm), b * h)](
        q, k, v, *sides, out, lse,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        *run.pos_strides, lq, lk, h, h // hkv, *run.settings.scalars(),
        BM=bm, BN=bn, **run.settings.constants(q),
    )  # fmt: skip
    return out, lse


@soft_attention_forward.register_fake
def _forward_fake(q, k, v, probs_q, probs_k, doc_q, doc_k, pos_q, pos_k, *options):
    """Shapes, dtypes and strides of :func:`soft_attention_forward`'s outputs."""
    b, lq, h = q.shape[:3]
    return torch.empty_like(_strided(q)), q.new_empty(b, h, lq, dtype=torch.float32)


@torch.library.custom_op("focus_pretrain::soft_attention_backward", mutates_args=())
def soft_attention_backward(
    d_out: Tensor,
    d_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs_q: Tensor | None,
    probs_k: Tensor | None,
    doc_q: Tensor | None,
    doc_k: Tensor | None,
    pos_q: Tensor | None,
    pos_k: Tensor | None,
    out: Tensor,
    lse: Tensor,
    window: int,
    gate_lambda: float,
    softcap: float | None,
    scale: float,
    sinks: int,
    packed: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The two backward kernels as an operator: ``(dq, dk, dv, d_probs_q, d_probs_k)`` from
    the gradients of ``out [b, Lq, H, D]`` and ``lse [b, H, Lq]`` (``None``: unused), the
    forward's inputs and its outputs. ``dq`` has q's strides (read in place), ``dk, dv`` are
    dense; the assignment gradients (summed over heads) are ``[b, Lq|Lk, K]`` in the
    assignments' dtypes, or empty ``[0]`` for a sliding-window layer."""
    from focus_pretrain.focus import soft_triton_kernels as kernels

    run = _Launch.build(
        q, k, v, probs_q, probs_k, doc_q, doc_k, pos_q, pos_k,
        (window, gate_lambda, softcap, scale, sinks, packed),
    )  # fmt: skip
    q, k, v, settings = run.q, run.k, run.v, run.settings
    b, lq, h, d = q.shape
    lk, hkv, kp = k.shape[1], k.shape[2], settings.kp
    if d_out.stride() != q.stride():  # the kernels read dO (and write dQ) with q's strides
        d_out = torch.empty_like(q).copy_(d_out)
    delta = (d_out.float() * out.float()).sum(-1).transpose(1, 2)  # [b, Lq, H] -> [b, H, Lq]
    if d_lse is not None:  # lse_i = log sum_j exp(t_ij): dt_ij gets p_ij d_lse_i
        delta = delta - d_lse.float()
    delta = delta.contiguous()  # [b, H, Lq]
    dq = torch.empty_like(q)  # q's strides (_strided)
    dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (k, v))  # dense
    dg_q = dg_k = q  # not written by a LOCAL kernel
    if not settings.local:
        dg_q = torch.empty(b, h, lq, kp, device=q.device, dtype=torch.float32)
        dg_k = torch.empty(b, hkv, lk, kp, device=q.device, dtype=torch.float32)
    doc_end = q
    if run.doc_q is not None and (settings.packed or not settings.positions):
        doc_end = _document_ends(run.doc_q)
    sides = [q if t is None else t for t in (run.g_q, run.g_k, run.doc_q, run.doc_k)]
    pos = [q if t is None else t for t in (run.pos_q, run.pos_k)]
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *run.pos_strides)
    blocks = _blocks(q.device.type, d, q.dtype, packed)
    bm, bn = blocks["kv"]
    kernels.soft_backward_kv_kernel[(_cdiv(lk, bn), b * hkv)](
        q, k, v, *sides, doc_end, *pos, d_out, lse, delta, dk, dv, dg_k,
        *strides, lq, lk, h, hkv, h // hkv, *settings.scalars(), BM=bm, BN=bn,
        **settings.constants(q),
    )  # fmt: skip
    bm, bn = blocks["q"]
    kernels.soft_backward_q_kernel[(_cdiv(lq, bm), b * h)](
        q, k, v, *sides, *pos, d_out, lse, delta, dq, dg_q,
        *strides, lq, lk, h, h // hkv, *settings.scalars(), BM=bm, BN=bn,
        **settings.constants(q),
    )  # fmt: skip
    if settings.local:
        return dq, dk, dv, _no_grad(q), _no_grad(q)
    groups = settings.num_groups
    d_pq = dg_q.sum(dim=1)[..., :groups].to(probs_q.dtype).contiguous()  # [b, Lq, K]
    d_pk = dg_k.sum(dim=1)[..., :groups].to(probs_k.dtype).contiguous()  # [b, Lk, K]
    return dq, dk, dv, d_pq, d_pk


def _no_grad(q: Tensor) -> Tensor:
    """The empty ``[0]`` fp32 placeholder for an assignment gradient a layer does not have."""
    return q.new_empty(0, dtype=torch.float32)


@soft_attention_backward.register_fake
def _backward_fake(d_out, d_lse, q, k, v, probs_q, probs_k, *rest):
    """Shapes, dtypes and strides of :func:`soft_attention_backward`'s outputs."""
    dq = torch.empty_like(_strided(q))
    dk, dv = (t.new_empty(t.shape) for t in (k, v))  # dense
    d_pq, d_pk = (_no_grad(q) if p is None else p.new_empty(p.shape) for p in (probs_q, probs_k))
    return dq, dk, dv, d_pq, d_pk


_TENSORS = 9  # q, k, v, probs_q, probs_k, doc_q, doc_k, pos_q, pos_k; then the options


def _setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    """Saves what :func:`_backward` hands the backward operator: the forward's tensors, its
    outputs and its options (window, gate lambda, softcap, scale, sinks, packed)."""
    ctx.save_for_backward(*inputs[:_TENSORS], *output)
    ctx.options = tuple(inputs[_TENSORS:])


def _backward(ctx, d_out: Tensor, d_lse: Tensor | None) -> tuple:
    """Gradients of :func:`soft_attention_forward`'s inputs through the backward operator:
    ``q``, ``k``, ``v`` and the assignments (``None`` for a sliding-window layer's absent
    ones); documents, positions and options get none."""
    saved = ctx.saved_tensors
    dq, dk, dv, d_pq, d_pk = torch.ops.focus_pretrain.soft_attention_backward(
        d_out, d_lse, *saved, *ctx.options
    )
    probs_q, probs_k = saved[3], saved[4]
    d_pq, d_pk = (None if p is None else g for p, g in ((probs_q, d_pq), (probs_k, d_pk)))
    return (dq, dk, dv, d_pq, d_pk) + (None,) * (_TENSORS - 5 + len(ctx.options))


soft_attention_forward.register_autograd(_backward, setup_context=_setup_context)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs_q: Tensor | None,
    probs_k: Tensor | None,
    *,
    window: int,
    gate_lambda: float,
    scale: float,
    softcap: float | None = None,
    sinks: int = 0,
    doc_q: Tensor | None = None,
    doc_k: Tensor | None = None,
    pos_q: Tensor | None = None,
    pos_k: Tensor | None = None,
    packed: bool = False,
) -> tuple[Tensor, Tensor]:
    """Queries against keys through the fused kernels: soft-gated, or a sliding window when
    ``probs_q`` is ``None``; differentiable in ``q``, ``k``, ``v``, the assignments and
    through the returned ``lse``.

    Args:
        q: ``[b, Lq, H, D]``; k, v: ``[b, Lk, Hkv, D]`` (one dtype, ``D`` in :data:`HEAD_DIMS`).
        probs_q, probs_k: ``[b, Lq|Lk, K]`` soft assignments (the same tensor for
            self-attention), or ``None`` for a sliding-window layer.
        doc_q, doc_k: ``[b, Lq|Lk]`` int64 document starts (global positions), or ``None``.
        pos_q, pos_k: ``[Lq]``/``[b, Lq]`` and ``[Lk]``/``[b, Lk]`` increasing global
            positions (a ring step's blocks), or ``None``: one sequence, positions ``0..L-1``
            (then ``Lq = Lk`` and the loops skip the blocks no query may see).
        packed: one packed sequence (``Lq = Lk``, the same tokens) whose ``doc_q``/``doc_k``
            are its document starts as indices: the positions serve the pair rule only and the
            loops skip blocks as on one sequence (the group-sorted layout, :func:`hard_top1`).

    Returns:
        ``(out [b, Lq, H, D] in q.dtype, lse [b, Lq, H] fp32)``; a query with no allowed key
        gets ``out = 0`` and ``lse = -inf``.
    """
    _check_launch(q, k, probs_q)
    out, lse = torch.ops.focus_pretrain.soft_attention_forward(
        q, k, v, probs_q, probs_k, doc_q, doc_k, pos_q, pos_k, int(window), float(gate_lambda),
        None if softcap is None else float(softcap), float(scale), int(sinks), bool(packed),
    )  # fmt: skip
    return out, lse.transpose(1, 2)  # [b, H, Lq] -> [b, Lq, H]


def soft_gated_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor | None,
    *,
    window: int,
    gate_lambda: float,
    scale: float,
    softcap: float | None = None,
    sinks: int = 0,
    documents: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Soft-gated causal Focus attention through the fused Triton kernels.

    Args:
        q: ``[b, n, H, D]``; k, v: ``[b, n, Hkv, D]`` (one dtype, ``D`` in :data:`HEAD_DIMS`).
        probs: ``[b, n, K]`` soft assignments (differentiable), or ``None`` for a
            sliding-window layer (keys at most ``window`` back, plus the sinks; no gate).
        documents: ``[b, n]`` int64 document starts, or ``None``.

    Returns:
        ``(out [b, n, H, D] in q.dtype, lse [b, n, H] fp32)``; ``out`` is differentiable in
        ``q``, ``k``, ``v`` and ``probs``.
    """
    return attend(
        q, k, v, probs, probs, window=window, gate_lambda=gate_lambda, scale=scale,
        softcap=softcap, sinks=sinks, doc_q=documents, doc_k=documents,
    )  # fmt: skip


def triton_focus_attention(
    q: Tensor, k: Tensor, v: Tensor, pattern: AttentionPattern
) -> tuple[Tensor, Tensor]:
    """Backend entry (:class:`~focus_pretrain.focus.backends.Backend`): the soft pattern and
    sliding-window layers; not the hard one."""
    if not pattern.local_only and (pattern.mode != "soft" or pattern.probs is None):
        raise ValueError("the triton backend computes the soft pattern, not the hard one")
    return soft_gated_attention(
        q, k, v, None if pattern.local_only else pattern.probs, window=pattern.window,
        gate_lambda=pattern.gate_lambda, scale=pattern.scale, softcap=pattern.softcap,
        sinks=pattern.sinks, documents=pattern.documents,
    )  # fmt: skip
