"""Launch plumbing of the ``triton`` backend's kernels
(:mod:`~focus_pretrain.focus.soft_triton_kernels`): one call's inputs made launchable
(:class:`Launch`), the backward's buffers (:class:`BackwardState`) and one function per kernel
that launches it with a given :class:`~focus_pretrain.focus.triton_tiles.Tile` (the operators of
:mod:`~focus_pretrain.focus.soft_triton` pass the launch's tiles; ``tools/tune_triton.py`` passes
each candidate). Layout: ``[batch, seq, heads, head_dim]``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from focus_pretrain.focus.triton_tiles import KERNELS, Tile, cuda_tiles, override_tiles


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


def precision_class(dtype: torch.dtype) -> str:
    """The tile table's precision class of a launch: ``half`` (fp16/bf16), ``tf32`` (fp32
    inputs, TF32 allowed) or ``fp32`` (fp32 inputs, 3xTF32 products)."""
    if dtype != torch.float32:
        return "half"
    return "tf32" if fp32_products() == "tf32" else "fp32"


def _blocks(
    device: torch.device | str, head_dim: int, dtype: torch.dtype = torch.bfloat16,
    packed: bool = False,
) -> dict[str, Tile]:  # fmt: skip
    """Each kernel's :class:`~focus_pretrain.focus.triton_tiles.Tile` (``fwd``, ``kv``, ``q``):
    on CUDA the GPU's measured tiles, else the defaults, overridable
    (:func:`~focus_pretrain.focus.triton_tiles.launch_tiles`); in the interpreter small square
    tiles (``FOCUS_TRITON_TEST_BLOCK``, default 16: many blocks on small tests)."""
    device = torch.device(device)
    if device.type != "cuda":  # (kva=BMxBN in FOCUS_TRITON_BLOCKS: the atomic dQ path)
        block = int(os.environ.get("FOCUS_TRITON_TEST_BLOCK", "16"))
        tiles = {key: Tile(block, block, 1, 1) for key in KERNELS}
        return override_tiles(tiles, os.environ.get("FOCUS_TRITON_BLOCKS", ""))
    return cuda_tiles(device, precision_class(dtype), head_dim, packed)


def _precisions(q: Tensor) -> tuple[str, str]:
    """``(QK_PREC, GRAD_PREC)``: on CUDA fp32 inputs' products follow PyTorch's fp32 matmul
    precision (:func:`fp32_products`: 3xTF32 by default, TF32 when allowed) and the assignment
    gradients' products use 3xTF32; fp16/bf16 inputs are tensor-core native (the assignment
    gradients then in the inputs' dtype, as ``dS`` is for ``dQ``). The interpreter computes in
    IEEE fp32."""
    if not q.is_cuda:
        return "ieee", "ieee"
    return (fp32_products() if q.dtype == torch.float32 else "tf32"), "tf32x3"


def fast_gate(q: Tensor) -> bool:
    """Whether the kernels compute the gate's weight with the GPU's one-instruction ``tanh``
    (relative error 2^-11, below the rounding of fp16/bf16 probabilities): CUDA with fp16/bf16
    inputs, unless ``FOCUS_TRITON_EXACT_GATE=1``."""
    exact = os.environ.get("FOCUS_TRITON_EXACT_GATE", "0") not in ("", "0")
    return q.is_cuda and q.dtype != torch.float32 and not exact


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
    kp: int  # the assignment gradients' width: K padded to a power of two >= 16
    ka: int  # the affinity tables' width: 3K padded likewise
    local: bool
    documents: bool
    positions: bool
    packed: bool = False  # positions for the pair rule, loops bounded by index (one sequence)

    def scalars(self) -> tuple:
        """``(scale, lam, window, sinks, cap)`` in the kernels' argument order."""
        cap = 1.0 if self.softcap is None else float(self.softcap)
        return float(self.scale), float(self.lam), int(self.window), int(self.sinks), cap

    def constants(self, q: Tensor, kernel: str, tile: Tile) -> dict:
        """Compile-time arguments and launch options of ``kernel`` (``fwd``, ``kv``, ``q``)
        launched with ``tile``."""
        qk_prec, grad_prec = _precisions(q)
        backward = dict(KP=self.kp, GRAD_PREC=grad_prec) if kernel != "fwd" else {}
        return dict(
            D=q.shape[-1], KA=self.ka, HAS_DOCS=self.documents, HAS_POS=self.positions,
            SOFTCAP=self.softcap is not None, LOCAL=self.local, QK_PREC=qk_prec,
            FAST=fast_gate(q), PACKED=self.packed, BM=tile.bm, BN=tile.bn,
            num_warps=tile.warps, num_stages=tile.stages, **backward,
        )  # fmt: skip


def _affinity_tables(probs_q: Tensor, probs_k: Tensor, ka: int) -> tuple[Tensor, Tensor]:
    """``[b, L, K]`` assignments -> the forward's ``[b, L, KA]`` fp16 tables, whose row products
    are the affinities ``g_i . g_j`` to about 22 bits in one fp16 tensor-core product: each
    ``g = hi + lo`` (two fp16 parts), queries ``[hi, lo, hi]`` and keys ``[hi, hi, lo]``, so
    that ``a_q . a_k = hi.hi + lo.hi + hi.lo`` (``lo.lo``, below 2^-22, dropped); zero-padded."""

    def split(probs: Tensor) -> tuple[Tensor, Tensor]:
        exact = probs.detach().float()
        hi = exact.half()
        return hi, (exact - hi.float()).half()

    def table(parts: list[Tensor]) -> Tensor:
        pad = parts[0].new_zeros(*parts[0].shape[:2], ka - 3 * parts[0].shape[-1])
        return torch.cat([*parts, pad], dim=-1).contiguous()  # [b, L, KA]

    hi_q, lo_q = split(probs_q)
    hi_k, lo_k = (hi_q, lo_q) if probs_k is probs_q else split(probs_k)
    return table([hi_q, lo_q, hi_q]), table([hi_k, hi_k, lo_k])


def _gradient_table(probs: Tensor, kp: int, dtype: torch.dtype) -> Tensor:
    """``[b, L, K]`` assignments -> ``[b, L, KP]`` in the backward products' ``dtype``,
    zero-padded: the right-hand sides of ``dG_q = dA G_k`` and ``dG_k = dA^T G_q``."""
    g = probs.new_zeros(*probs.shape[:2], kp, dtype=dtype)
    g[..., : probs.shape[-1]] = probs.detach()
    return g


def _positions(pos: Tensor | None, b: int) -> tuple[Tensor | None, int]:
    """``[L]`` or ``[b, L]`` positions -> (int64 contiguous, batch stride: 0 when shared)."""
    if pos is None:
        return None, 0
    pos = pos.to(torch.int64).contiguous()
    return pos, (0 if pos.dim() == 1 or (pos.shape[0] == 1 and b > 1) else pos.shape[-1])


@dataclass(frozen=True)
class Launch:
    """One call's kernel inputs, made launchable: ``q, k, v`` readable in place (or copied),
    the assignments as the kernels' tables (:func:`_affinity_tables`; the backward's
    :func:`_gradient_table`), documents and positions contiguous, and the shared
    :class:`_Settings`. Built by both ops from their own arguments; an absent tensor is ``q``
    (a placeholder pointer no kernel variant reads)."""

    q: Tensor
    k: Tensor
    v: Tensor
    a_q: Tensor
    a_k: Tensor
    g_q: Tensor
    g_k: Tensor
    doc_q: Tensor
    doc_k: Tensor
    pos_q: Tensor
    pos_k: Tensor
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
        backward: bool = False,
    ) -> Launch:
        """``options``: ``(window, gate_lambda, softcap, scale, sinks, packed)``; ``backward``:
        also the gradient tables."""
        b, lq = q.shape[:2]
        local = probs_q is None  # a sliding-window layer: no gate, pairs beyond the window cut
        num_groups = 0 if local else probs_q.shape[-1]
        kp, ka = max(16, _next_pow2(num_groups)), max(16, _next_pow2(3 * num_groups))
        q, k, v = (_strided(t) for t in (q, k, v))  # views kept (e.g. Megatron's [s, b, ...])
        a_q = a_k = g_q = g_k = q
        if not local:
            a_q, a_k = _affinity_tables(probs_q, probs_k, ka)
            if backward:
                grad_dtype = q.dtype if q.is_cuda else torch.float32
                g_q = _gradient_table(probs_q, kp, grad_dtype)
                g_k = g_q if probs_k is probs_q else _gradient_table(probs_k, kp, grad_dtype)
        (pos_q, stride_pq), (pos_k, stride_pk) = _positions(pos_q, b), _positions(pos_k, b)
        window, gate_lambda, softcap, scale, sinks, packed = options
        positions = pos_q is not None
        if packed and (not positions or doc_q is None or lq != k.shape[1]):
            raise ValueError("packed=True needs positions, document starts and Lq == Lk")
        settings = _Settings(
            window=window if positions else min(window, lq), lam=gate_lambda, softcap=softcap,
            scale=scale, sinks=sinks, num_groups=num_groups, kp=kp, ka=ka, local=local,
            documents=doc_q is not None, positions=positions, packed=packed,
        )  # fmt: skip
        doc_q, doc_k, pos_q, pos_k = (
            q if t is None else t.contiguous() for t in (doc_q, doc_k, pos_q, pos_k)
        )
        return Launch(
            q, k, v, a_q, a_k, g_q, g_k, doc_q, doc_k, pos_q, pos_k, (stride_pq, stride_pk),
            settings,
        )  # fmt: skip

    def tiles(self) -> dict[str, Tile]:
        """Each kernel's tile for this launch (:func:`_blocks`)."""
        return _blocks(self.q.device, self.q.shape[-1], self.q.dtype, self.settings.packed)


@dataclass(frozen=True)
class BackwardState:
    """The backward kernels' other inputs (``dO`` with ``q``'s strides, ``lse``, ``delta``, the
    document ends) and their outputs (``dq``, ``dk``, ``dv`` and the per-head assignment
    gradients ``dg_q [b, H, Lq, KP]``, ``dg_k [b, Hkv, Lk, KP]`` fp32; ``q`` placeholders for a
    sliding-window layer). ``atomic``: the dK/dV kernel adds ``dQ`` into ``dq_acc [b, Lq, H,
    D]`` fp32 and ``dG_q`` into ``dg_q`` (both zeroed), and there is no dQ pass."""

    d_out: Tensor
    lse: Tensor
    delta: Tensor
    doc_end: Tensor
    dq: Tensor
    dk: Tensor
    dv: Tensor
    dg_q: Tensor
    dg_k: Tensor
    dq_acc: Tensor
    atomic: bool

    @staticmethod
    def build(
        run: Launch,
        d_out: Tensor,
        d_lse: Tensor | None,
        out: Tensor,
        lse: Tensor,
        atomic: bool = False,
    ) -> BackwardState:
        """From the gradients of ``out [b, Lq, H, D]`` and ``lse [b, H, Lq]`` (``None``:
        unused) and the forward's outputs."""
        q, k, settings = run.q, run.k, run.settings
        b, lq, h, d = q.shape
        lk, hkv, kp = k.shape[1], k.shape[2], settings.kp
        if d_out.stride() != q.stride():  # the kernels read dO (and write dQ) with q's strides
            d_out = torch.empty_like(q).copy_(d_out)
        delta = (d_out.float() * out.float()).sum(-1).transpose(1, 2)  # [b, Lq, H] -> [b, H, Lq]
        if d_lse is not None:  # lse_i = log sum_j exp(t_ij): dt_ij gets p_ij d_lse_i
            delta = delta - d_lse.float()
        new = torch.zeros if atomic else torch.empty
        dg_q = dg_k = q  # not written by a LOCAL kernel
        if not settings.local:
            dg_q = new(b, h, lq, kp, device=q.device, dtype=torch.float32)
            dg_k = torch.empty(b, hkv, lk, kp, device=q.device, dtype=torch.float32)
        doc_end = q
        if settings.documents and (settings.packed or not settings.positions):
            doc_end = _document_ends(run.doc_q)
        dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (k, run.v))
        dq_acc = torch.zeros(b, lq, h, d, device=q.device, dtype=torch.float32) if atomic else q
        return BackwardState(
            d_out, lse, delta.contiguous(), doc_end, torch.empty_like(q), dk, dv, dg_q, dg_k,
            dq_acc, atomic,
        )  # fmt: skip  # dq: q's strides (_strided); dk, dv dense


def _strides(run: Launch) -> tuple:
    q, k, v = run.q, run.k, run.v
    return (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])


def launch_forward(run: Launch, tile: Tile) -> tuple[Tensor, Tensor]:
    """The forward kernel: ``(out [b, Lq, H, D] (q's strides), lse [b, H, Lq] fp32)``."""
    from focus_pretrain.focus import soft_triton_kernels as kernels

    q, k = run.q, run.k
    b, lq, h, _ = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    out = torch.empty_like(q)  # [b, Lq, H, D]
    lse = torch.empty(b, h, lq, device=q.device, dtype=torch.float32)  # [b, H, Lq]
    kernels.soft_forward_kernel[(_cdiv(lq, tile.bm), b * h)](
        q, k, run.v, run.a_q, run.a_k, run.doc_q, run.doc_k, run.pos_q, run.pos_k, out, lse,
        *_strides(run), *out.stride()[:3], *run.pos_strides, lq, lk, h, h // hkv,
        *run.settings.scalars(), **run.settings.constants(q, "fwd", tile),
    )  # fmt: skip
    return out, lse


def launch_backward_kv(run: Launch, grads: BackwardState, tile: Tile) -> None:
    """The dK/dV kernel: fills ``grads.dk``, ``grads.dv`` and ``grads.dg_k``; with
    ``grads.atomic`` also ``grads.dq`` and ``grads.dg_q`` (no dQ pass follows)."""
    from focus_pretrain.focus import soft_triton_kernels as kernels

    q, k = run.q, run.k
    b, lq, h, _ = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    kernels.soft_backward_kv_kernel[(_cdiv(lk, tile.bn), b * hkv)](
        q, k, run.v, run.a_q, run.a_k, run.g_q, run.g_k, run.doc_q, run.doc_k, grads.doc_end,
        run.pos_q, run.pos_k, grads.d_out, grads.lse, grads.delta, grads.dk, grads.dv,
        grads.dg_k, grads.dq_acc, grads.dg_q, *_strides(run), *run.pos_strides, lq, lk, h, hkv,
        h // hkv, *run.settings.scalars(), ATOMIC_DQ=grads.atomic,
        **run.settings.constants(q, "kv", tile),
    )  # fmt: skip
    if grads.atomic:
        grads.dq.copy_(grads.dq_acc)  # [b, Lq, H, D] fp32 -> q's dtype and strides


def launch_backward_q(run: Launch, grads: BackwardState, tile: Tile) -> None:
    """The dQ kernel: fills ``grads.dq`` and ``grads.dg_q``."""
    from focus_pretrain.focus import soft_triton_kernels as kernels

    q, k = run.q, run.k
    b, lq, h, _ = q.shape
    kernels.soft_backward_q_kernel[(_cdiv(lq, tile.bm), b * h)](
        q, k, run.v, run.a_q, run.a_k, run.g_k, run.doc_q, run.doc_k, run.pos_q, run.pos_k,
        grads.d_out, grads.lse, grads.delta, grads.dq, grads.dg_q, *_strides(run),
        *run.pos_strides, lq, k.shape[1], h, h // k.shape[2], *run.settings.scalars(),
        **run.settings.constants(q, "q", tile),
    )  # fmt: skip
