"""Benchmark of one ring step of context-parallel Focus attention (``tools/bench_ring_step.py``).

On one device, without a process group, it builds what a ring step computes: rank ``q_rank``'s
zigzag queries (``s_loc = seq / CP`` tokens at their global positions) against the visiting
K/V block of rank ``k_rank`` with its positions, soft assignments or hard memberships and
document starts, and runs the ring's own step functions
(:func:`focus_pretrain.parallel.ring._attend` and ``_block_grads``) with each block kernel
(:mod:`focus_pretrain.parallel.ring_kernels`: ``blockwise`` and the fused ``flex``):

* the *diagonal* step (a rank's own block, causal inside) and an *off-diagonal* one (rank 0's
  queries, rank 1's block: half of the pairs are causal), in hard (top-k routing) and soft
  (gated, training) mode;
* **check**: the fused kernel against the blockwise one: relative L2 error of the output and,
  with the backward, of every gradient (``dq, dk, dv`` and, in soft mode, the assignments'), and
  the largest ``lse`` difference;
* **time**: the forward step, and the backward step as the ring runs it (recompute and
  gradients of the block, with a merged output and ``lse`` that another block shares, so the
  gradient through the block's ``lse`` is exercised), each after warm-up as the median of
  repeats (CUDA events on GPU, ``perf_counter`` on CPU).

A kernel that runs out of memory (or fails) at a size is recorded as such and the run goes on.
Each row also gives the fraction of the step's pairs that the pattern allows and of the key
blocks the fused kernel's block mask keeps. CPU runs are smoke tests (FlexAttention runs
eagerly there and its backward falls back to the blockwise kernel), not figures.
Layout: ``[batch, seq, heads, head_dim]``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from focus_pretrain.bench.report import DTYPES, markdown, median_ms
from focus_pretrain.focus.backends import AttentionPattern
from focus_pretrain.focus.lse import merge_by_lse
from focus_pretrain.focus.pattern import allowed_pairs
from focus_pretrain.focus.router import Routing
from focus_pretrain.parallel import ring
from focus_pretrain.parallel.ring_kernels import backward_block_kernel, plan_block
from focus_pretrain.parallel.sharding import zigzag_positions

STEPS = {"diagonal": (0, 0), "off-diagonal": (0, 1)}  # (query rank, key rank)
PAIR_ROWS = 1024  # query rows per chunk when counting the allowed pairs


@dataclass
class RingBenchConfig:
    """What to measure (see ``tools/bench_ring_step.py --help``)."""

    seq: list[int] = field(default_factory=lambda: [65536, 262144])
    cp: int = 8
    groups: int = 8
    top_k: int = 1
    modes: list[str] = field(default_factory=lambda: ["hard", "soft"])
    steps: list[str] = field(default_factory=lambda: list(STEPS))
    kernels: list[str] = field(default_factory=lambda: ["blockwise", "flex"])
    window: int = 128
    sinks: int = 0
    document: int = 0  # packed documents of this many tokens (0: one document)
    batch: int = 1
    heads: int = 16
    heads_kv: int = 16
    head_dim: int = 128
    dtype: str = "bf16"
    gate_lambda: float = 10.0
    backward: bool = True
    warmup: int = 2
    repeats: int = 5
    device: str = "cuda"
    seed: int = 0


@dataclass
class _Step:
    """One ring step's inputs: queries ``[b, s_loc, H, D]`` with ``probs/member/docs``
    ``[b, s_loc(, K)]`` at ``positions [s_loc]``, the visiting block as the ring sends it, and
    a merged ``(out, lse)`` with its upstream gradient ``d_out`` for the backward step."""

    q: Tensor
    probs: Tensor | None
    member: Tensor | None
    docs: Tensor | None
    positions: Tensor
    block: list[Tensor]
    soft: bool
    pattern: AttentionPattern  # the settings of every ring step (scale resolved)
    merged: tuple[Tensor, Tensor] | None = None
    d_out: Tensor | None = None


def _build_step(cfg: RingBenchConfig, seq: int, mode: str, step: str, gen) -> _Step:
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    s_loc = seq // cfg.cp
    q_rank, k_rank = STEPS[step]

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    def tokens(rank: int) -> tuple[Tensor, Tensor, Tensor | None]:
        pos = zigzag_positions(seq, cfg.cp, rank, device=device)  # [s_loc]
        probs = torch.softmax(randn(cfg.batch, s_loc, cfg.groups) * 3, dim=-1)  # [b, s_loc, K]
        docs = None
        if cfg.document:
            docs = ((pos // cfg.document) * cfg.document).expand(cfg.batch, s_loc).contiguous()
        return pos, probs, docs

    q_pos, q_probs, q_docs = tokens(q_rank)
    k_pos, k_probs, k_docs = (q_pos, q_probs, q_docs) if q_rank == k_rank else tokens(k_rank)
    q = randn(cfg.batch, s_loc, cfg.heads, cfg.head_dim).to(dtype)
    k, v = (randn(cfg.batch, s_loc, cfg.heads_kv, cfg.head_dim).to(dtype) for _ in range(2))
    soft = mode == "soft"
    member = member_k = None
    if not soft:
        member = Routing(q_probs).membership(cfg.top_k)  # [b, s_loc]
        member_k = Routing(k_probs).membership(cfg.top_k)
    q_probs, k_probs = q_probs.to(dtype), k_probs.to(dtype)
    pattern = AttentionPattern(
        window=cfg.window, mode=mode, gate_lambda=cfg.gate_lambda, scale=cfg.head_dim**-0.5,
        sinks=cfg.sinks,
    )  # fmt: skip
    block = ring._block(k, v, k_pos, k_probs if soft else None, member_k, k_docs)
    return _Step(q, q_probs if soft else None, member, q_docs, q_pos, block, soft, pattern)


def _forward(step: _Step, kernel: str) -> tuple[Tensor, Tensor] | None:
    with torch.no_grad():
        return ring._attend(
            step.q, step.probs, step.member, step.docs, step.positions, step.block, step.soft,
            ring.RingPlan(step.pattern, kernel), None,
        )  # fmt: skip


def _backward(step: _Step, kernel: str) -> list[Tensor]:
    out, lse = step.merged
    return ring._block_grads(
        step.q, step.probs, step.member, step.docs, step.positions, step.block, step.soft,
        ring.RingPlan(step.pattern, kernel), out, lse, step.d_out,
    )  # fmt: skip


def _merge_with_another_block(step: _Step, result: tuple[Tensor, Tensor], gen) -> None:
    """A merged ``(out, lse)`` that the block shares with a random other block (every query
    has a key there), and a random upstream gradient."""
    out_b, lse_b = result
    finite = torch.where(torch.isfinite(lse_b), lse_b, torch.zeros_like(lse_b))
    noise = torch.randn(lse_b.shape, generator=gen, device=lse_b.device)
    other = (torch.randn(out_b.shape, generator=gen, device=out_b.device).to(out_b.dtype),
             finite + noise)  # fmt: skip
    step.merged = merge_by_lse(result, other)
    step.d_out = torch.randn(out_b.shape, generator=gen, device=out_b.device)


def _relative(got: Tensor, want: Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def _densities(cfg: RingBenchConfig, step: _Step) -> tuple[float, float]:
    """(allowed pairs / all pairs of the step, key blocks the fused block mask keeps)."""
    _, _, pos_b, _, member_b, docs_b = ring._unpack(
        step.block, step.soft, step.member is not None, step.docs is not None
    )
    allowed = total = 0
    for start in range(0, step.positions.shape[0], PAIR_ROWS):
        rows = slice(start, start + PAIR_ROWS)
        pattern = allowed_pairs(
            step.positions[rows], pos_b, cfg.window,
            member_q=None if step.member is None else step.member[:, rows], member_k=member_b,
            sinks=cfg.sinks, q_doc=None if step.docs is None else step.docs[:, rows], k_doc=docs_b,
        )  # fmt: skip  # [b|1, rows, Lk]
        allowed, total = allowed + int(pattern.sum()), total + pattern.numel()
    plan = plan_block(
        step.positions, pos_b, step.member, member_b, step.docs, docs_b,
        kind="causal" if step.soft else "hard", window=cfg.window, sinks=cfg.sinks,
    )  # fmt: skip
    return allowed / total, float(plan.candidate.float().mean())


def _guarded(fn: Callable, log: Callable[[str], None]) -> tuple[object, str | None]:
    """``(fn(), None)``, or ``(None, what went wrong)``: out of memory or another failure."""
    try:
        return fn(), None
    except Exception as error:  # a benchmark records the failure and goes on
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error):
            status = "out of memory"
        else:
            status = f"{type(error).__name__}: {message[:200]}"
            log(traceback.format_exc())
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None, status


def run_ring_benchmark(cfg: RingBenchConfig, log: Callable[[str], None] = print) -> list[dict]:
    """Check and time every (seq, mode, step); returns one row (dict) each."""
    device = torch.device(cfg.device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    rows = []
    for seq in cfg.seq:
        if seq % (2 * cfg.cp):
            raise ValueError(f"seq {seq} is not a multiple of 2 * cp = {2 * cfg.cp}")
        for mode in cfg.modes:
            for name in cfg.steps:
                if STEPS[name][0] != STEPS[name][1] and cfg.cp < 2:
                    continue  # no other rank
                step = _build_step(cfg, seq, mode, name, gen)
                rows.append(_run_step(cfg, seq, mode, name, step, device, gen, log))
                log(format_row(rows[-1]))
                del step
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def _run_step(cfg, seq, mode, name, step: _Step, device, gen, log) -> dict:
    pairs, blocks = _densities(cfg, step)
    row = dict(seq=seq, cp=cfg.cp, s_loc=seq // cfg.cp, mode=mode, step=name,
               top_k=None if mode == "soft" else cfg.top_k, groups=cfg.groups,
               pair_density=pairs, block_density=blocks, kernels={}, check={})  # fmt: skip
    results, grads = {}, {}
    for kernel in cfg.kernels:  # one run each: the results to compare (and a warm-up)
        if kernel == "triton" and not step.soft:
            continue  # soft and sliding-window steps only
        result, status = _guarded(lambda kernel=kernel: _forward(step, kernel), log)
        entry = dict(status=status or "ok", fwd_ms=None, bwd_ms=None, fwd_bwd_ms=None,
                     backward_kernel=backward_block_kernel(kernel, step.q))  # fmt: skip
        row["kernels"][kernel] = entry
        if result is None:
            continue
        results[kernel] = result
        if cfg.backward and step.merged is None:
            _merge_with_another_block(step, result, gen)
        if cfg.backward:
            grad, status = _guarded(lambda kernel=kernel: _backward(step, kernel), log)
            entry["status"] = status or "ok"
            if grad is not None:
                grads[kernel] = grad
    for kernel in (k for k in results if k != "blockwise" and "blockwise" in results):
        check = row["kernels"][kernel]["check"] = {}
        (want, want_lse), (got, got_lse) = results["blockwise"], results[kernel]
        finite = torch.isfinite(want_lse)
        check["out_rel_err"] = _relative(got, want)
        check["lse_max_err"] = float((got_lse - want_lse)[finite].abs().max())
        check["lse_inf_agree"] = bool(torch.equal(finite, torch.isfinite(got_lse)))
        if "blockwise" in grads and kernel in grads:
            names = ["dq", "dk", "dv"] + (["dprobs_k", "dprobs_q"] if step.soft else [])
            for what, got, want in zip(names, grads[kernel], grads["blockwise"], strict=True):
                check[f"{what}_rel_err"] = _relative(got, want)
    row["check"] = row["kernels"].get("flex", {}).get("check", {})  # the first fused kernel's
    del results, grads
    for kernel, entry in row["kernels"].items():
        if entry["status"] != "ok":
            continue

        def timed(fn: Callable, kernel: str = kernel) -> tuple[float | None, str | None]:
            def call() -> object:
                return fn(step, kernel)

            return _guarded(lambda: median_ms(call, device, cfg.warmup, cfg.repeats), log)

        fwd, status = timed(_forward)
        entry["fwd_ms"], entry["status"] = fwd, status or "ok"
        if cfg.backward and status is None:
            bwd, status = timed(_backward)
            entry["bwd_ms"], entry["status"] = bwd, status or "ok"
            entry["fwd_bwd_ms"] = None if bwd is None else fwd + bwd
    base = row["kernels"].get("blockwise", {})
    for entry in row["kernels"].values():
        for key in ("fwd_ms", "fwd_bwd_ms"):
            speed = None
            if base.get(key) and entry.get(key):
                speed = base[key] / entry[key]
            entry[key.replace("_ms", "_speedup")] = speed
    return row


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_row(row: dict) -> str:
    parts = [f"seq={row['seq']} CP={row['cp']} {row['mode']} {row['step']}"]
    for name, k in row["kernels"].items():
        parts.append(f"{name} fwd {_ms(k['fwd_ms'])} ms bwd {_ms(k['bwd_ms'])} ms ({k['status']})")
    parts += [f"{key} {value:.1e}" for key, value in row["check"].items() if key.endswith("err")]
    return " | ".join(parts)


def markdown_table(rows: list[dict]) -> str:
    """One line per (row, kernel): times, speedups over blockwise, densities, the check."""
    columns = ["seq", "CP", "s_loc", "mode", "step", "pairs", "blocks", "kernel", "fwd (ms)"]
    columns += ["bwd (ms)", "fwd+bwd (ms)", "speedup fwd", "speedup fwd+bwd", "out rel err"]
    columns += ["max grad rel err", "status"]
    lines = (_markdown_cells(row, name, k) for row in rows for name, k in row["kernels"].items())
    return markdown(columns, "rrrllrrlrrrrrrrl", lines)


def _markdown_cells(row: dict, name: str, k: dict) -> list[object]:
    """The cells of kernel ``name``'s line (``k``: its entry) of ``row``."""
    check = k.get("check", {})  # fused kernels against blockwise
    grad_errors = [v for key, v in check.items() if key.startswith("d")]  # d*_rel_err
    fused = bool(check)
    label = name if k["backward_kernel"] == name else f"{name} (bwd {k['backward_kernel']})"
    out_err = check.get("out_rel_err") if fused else None
    grad_err = max(grad_errors) if fused and grad_errors else None

    def speed(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    return [
        row["seq"], row["cp"], row["s_loc"], row["mode"], row["step"],
        f"{100 * row['pair_density']:.1f}%", f"{100 * row['block_density']:.1f}%", label,
        _ms(k["fwd_ms"]), _ms(k["bwd_ms"]), _ms(k["fwd_bwd_ms"]), speed(k["fwd_speedup"]),
        speed(k["fwd_bwd_speedup"]), "-" if out_err is None else f"{out_err:.1e}",
        "-" if grad_err is None else f"{grad_err:.1e}", k["status"],
    ]  # fmt: skip
