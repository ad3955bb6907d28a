"""Where the ``triton`` backend's training time goes, and which tiles make it fastest.

* :func:`profile_rows`: per variant of the soft call (each ingredient on or off: the gate,
  documents, sinks, soft-capping, the exact gate; the control is the same kernels as plain causal
  attention, no gate, no pattern), the forward, dK/dV and dQ kernels timed separately and the
  whole operator (forward + backward through autograd: the tables, ``delta``, the reductions),
  whose excess over the kernels is the non-kernel time; dense SDPA's forward and backward in the
  same run.
* :func:`tune_rows`: per kernel, every candidate :class:`~focus_pretrain.focus.triton_tiles.Tile`
  timed and checked against the first candidate's result; :func:`best_tiles` keeps the fastest
  that agrees, :func:`write_table` records it for the GPU in ``triton_tiles.json``.
* :func:`reference_errors`: the kernels (fast gate and exact) against the reference.
* the training step per length, against dense and other backends:
  :mod:`~focus_pretrain.bench.triton_lengths`.

On CUDA the times are ``triton.testing.do_bench`` medians; on a CPU (Triton's interpreter: the
tests) one wall-clock call. Layout: ``[batch, seq, heads, head_dim]``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from focus_pretrain.environment import environment
from focus_pretrain.focus.pattern import UNLIMITED_WINDOW, document_starts
from focus_pretrain.focus.soft_triton_launch import (
    BackwardState,
    Launch,
    launch_backward_kv,
    launch_backward_q,
    launch_forward,
    precision_class,
)
from focus_pretrain.focus.triton_tiles import (
    ATOMIC,
    KERNELS,
    Tile,
    override_text,
    table_key,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Case:
    """One call's shape and pattern: the ingredients are switched by these fields."""

    seq: int = 8192
    batch: int = 1
    heads: int = 16
    heads_kv: int = 16
    head_dim: int = 128
    groups: int = 8
    window: int = 128
    dtype: str = "bf16"
    local: bool = False  # no router: a sliding-window layer (no gate)
    documents: int = 0  # mean document length (0: one document)
    sinks: int = 0
    softcap: float | None = None
    exact_gate: bool = False  # FOCUS_TRITON_EXACT_GATE=1
    gate_lambda: float = 10.0


# the profile's variants: ingredients switched on from the plain soft call, and off to the control
VARIANTS = {
    "control: causal, no gate, no pattern": dict(local=True, window=UNLIMITED_WINDOW),
    "sliding window only (no gate)": dict(local=True),
    "soft gate + window": {},
    "+ documents": dict(documents=2048),
    "+ sinks": dict(sinks=4),
    "+ soft-cap": dict(softcap=30.0),
    "+ documents + sinks + soft-cap": dict(documents=2048, sinks=4, softcap=30.0),
    "soft, exact gate (no fast tanh)": dict(exact_gate=True),
}


def inputs(case: Case, device: str, seed: int = 0) -> dict:
    """Random ``q, k, v`` (``[b, n, H|Hkv, D]``), soft assignments ``[b, n, K]``, document
    starts and an output gradient (never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[case.dtype]
    b, n, d = case.batch, case.seq, case.head_dim

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    logits = torch.randn(b, n, case.groups, generator=gen) * 2.0
    docs = None
    if case.documents:
        ids = torch.cumsum(torch.rand(b, n, generator=gen) < 1.0 / case.documents, dim=1)
        docs = document_starts(ids).to(device)
    return dict(
        q=rand(b, n, case.heads, d), k=rand(b, n, case.heads_kv, d),
        v=rand(b, n, case.heads_kv, d), probs=logits.softmax(-1).to(device),
        docs=docs, d_out=rand(b, n, case.heads, d),
    )  # fmt: skip


def _gate_env(case: Case) -> contextlib.AbstractContextManager:
    return environment({"FOCUS_TRITON_EXACT_GATE": "1" if case.exact_gate else None})


def build_launch(case: Case, data: dict) -> Launch:
    """The kernels' launch of ``case`` on ``data`` (backward tables included)."""
    probs = None if case.local else data["probs"]
    options = (case.window, case.gate_lambda, case.softcap, case.head_dim**-0.5, case.sinks, False)
    return Launch.build(
        data["q"], data["k"], data["v"], probs, probs, data["docs"], data["docs"], None, None,
        options, backward=True,
    )  # fmt: skip


def timer(device: str, warmup_ms: int = 25, rep_ms: int = 100) -> Callable[[Callable], float]:
    """Milliseconds of a call: ``do_bench``'s median on CUDA, one wall-clock call elsewhere."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")

    def once(fn: Callable) -> float:
        import time

        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return once


def _prepared(case: Case, data: dict, tiles: dict[str, Tile]) -> tuple:
    """``(run, out, lse, grads)``: a launch of ``case``, its forward with ``tiles["fwd"]`` and
    the backward's state (atomic dQ when ``tiles`` has ``kva``)."""
    run = build_launch(case, data)
    out, lse = launch_forward(run, tiles["fwd"])
    grads = BackwardState.build(run, data["d_out"], None, out, lse, ATOMIC in tiles)
    return run, out, lse, grads


def kernel_results(case: Case, data: dict, tiles: dict[str, Tile]) -> dict[str, list[Tensor]]:
    """Each kernel's outputs with ``tiles``: ``fwd: [out, lse]``, ``kv: [dk, dv, dg_k]``,
    ``q: [dq, dg_q]`` (the assignment gradients absent for a sliding-window layer); with
    ``kva`` in ``tiles`` (one pass, atomic dQ) ``kva: [dk, dv, dg_k, dq, dg_q]`` instead of
    ``kv`` and ``q``."""
    with _gate_env(case):
        run, out, lse, grads = _prepared(case, data, tiles)
        if grads.atomic:
            launch_backward_kv(run, grads, tiles[ATOMIC])
        else:
            launch_backward_kv(run, grads, tiles["kv"])
            launch_backward_q(run, grads, tiles["q"])
    gated = not case.local
    kv = [grads.dk, grads.dv, *([grads.dg_k] if gated else [])]
    q = [grads.dq, *([grads.dg_q] if gated else [])]
    return {"fwd": [out, lse], **({ATOMIC: kv + q} if grads.atomic else {"kv": kv, "q": q})}


def kernel_times(case: Case, data: dict, tiles: dict[str, Tile], measure: Callable) -> dict:
    """Milliseconds of each kernel launched alone with ``tiles`` (inputs prepared outside; the
    atomic pass with the zeroing and conversion of its accumulators)."""
    with _gate_env(case):
        run, _, _, grads = _prepared(case, data, tiles)
        times = {"fwd": measure(lambda: launch_forward(run, tiles["fwd"]))}
        if grads.atomic:

            def atomic() -> None:
                grads.dq_acc.zero_()
                grads.dg_q.zero_()
                launch_backward_kv(run, grads, tiles[ATOMIC])

            return {**times, ATOMIC: measure(atomic)}
        times["kv"] = measure(lambda: launch_backward_kv(run, grads, tiles["kv"]))
        times["q"] = measure(lambda: launch_backward_q(run, grads, tiles["q"]))
        return times


def op_step(case: Case, data: dict) -> Callable[[], None]:
    """One forward + backward through the operator (autograd), as training calls it."""
    from focus_pretrain.focus.soft_triton import soft_gated_attention

    leaves = [data[key].detach().clone().requires_grad_(True) for key in ("q", "k", "v")]
    probs = None if case.local else data["probs"].detach().clone().requires_grad_(True)

    def step() -> None:
        out, _ = soft_gated_attention(
            *leaves, probs, window=case.window, gate_lambda=case.gate_lambda,
            scale=case.head_dim**-0.5, softcap=case.softcap, sinks=case.sinks,
            documents=data["docs"],
        )  # fmt: skip
        out.backward(data["d_out"])

    return step


def dense_times(case: Case, data: dict, measure: Callable) -> dict:
    """Dense causal SDPA (flash on CUDA): forward, backward and both, in milliseconds."""
    q, k, v = (data[key].detach().transpose(1, 2).requires_grad_(True) for key in "qkv")
    grad = data["d_out"].transpose(1, 2)  # [b, n, H, D] -> [b, H, n, D]
    gqa = case.heads != case.heads_kv

    def forward() -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    out = forward()
    fwd = measure(forward)
    both = measure(lambda: forward().backward(grad))
    bwd = measure(lambda: out.backward(grad, retain_graph=True))
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": both}


def causal_flops(case: Case) -> float:
    """FLOPs of dense causal attention's forward + backward (FlashAttention's count: the
    forward's two products over the causal half, the backward 2.5x the forward)."""
    forward = 4 * case.batch * case.heads * case.head_dim * case.seq**2 / 2
    return 3.5 * forward


def profile_rows(case: Case, device: str, tiles: dict[str, Tile], measure: Callable) -> list:
    """One row per :data:`VARIANTS` entry: each kernel's time, the operator's, the non-kernel
    rest, against dense's forward and backward (the first row)."""
    data = inputs(case, device)
    rows = [dict(variant="dense SDPA", **dense_times(case, data, measure))]
    for name, fields in VARIANTS.items():
        variant = replace(case, **fields)
        data = inputs(variant, device)
        kernels = kernel_times(variant, data, tiles, measure)
        with _gate_env(variant), environment({"FOCUS_TRITON_BLOCKS": override_text(tiles)}):
            total = measure(op_step(variant, data))
        rest = total - sum(kernels.values())
        pairs = causal_pair_fraction(data["docs"], variant.seq)
        rows.append(dict(variant=name, **kernels, op_fwd_bwd=total, non_kernel=rest, pairs=pairs))
    return rows


def causal_pair_fraction(docs: Tensor | None, seq: int) -> float:
    """The fraction of the causal pairs inside documents (1.0 without documents): the work a
    variant with documents has left, to compare its times per pair."""
    if docs is None:
        return 1.0
    lengths = torch.unique_consecutive(docs[0].cpu(), return_counts=True)[1].double()
    return float((lengths * (lengths + 1) / 2).sum() / (seq * (seq + 1) / 2))


def _agreement(got: list[Tensor], want: list[Tensor]) -> float:
    """Largest error of ``got`` against ``want``, relative to each tensor's largest value."""
    errors = []
    for a, b in zip(got, want, strict=True):
        finite = torch.isfinite(b)
        scale = b[finite].abs().max().clamp_min(1e-6)
        errors.append(float(((a - b)[finite].abs().max() / scale).nan_to_num(float("inf"))))
    return max(errors)


def tune_rows(
    case: Case, device: str, candidates: dict[str, list[Tile]], measure: Callable, log=print
) -> list[dict]:
    """Every candidate of every kernel (``kva``: the one-pass backward with atomic dQ, checked
    against ``kv`` and ``q``), timed alone and checked against the kernels' first candidates
    (the other kernels' tiles fixed at their first): rows ``{kernel, tile, ms, error}`` (an
    ``error`` string for a candidate that fails to compile or launch)."""
    data = inputs(case, device)
    first = {key: tiles[0] for key, tiles in candidates.items() if key != ATOMIC}
    want = kernel_results(case, data, first)
    want[ATOMIC] = want["kv"] + want["q"]
    rows = []
    for kernel, tiles in candidates.items():
        for tile in tiles:
            trial = {**first, kernel: tile}
            try:
                got = kernel_results(case, data, trial)[kernel]
                error = _agreement(got, want[kernel])
                ms = kernel_times(case, data, trial, measure)[kernel]
                row = dict(kernel=kernel, tile=tile.text(), ms=ms, error=error)
            except Exception as exc:
                row = dict(kernel=kernel, tile=tile.text(), ms=None, error=str(exc)[:200])
            log(json.dumps(row))
            rows.append(row)
    return rows


def best_tiles(rows: list[dict], tolerance: float) -> dict[str, dict]:
    """Per kernel, the fastest candidate whose error is within ``tolerance``:
    ``{kernel: {"tile", "ms", "first_ms"}}`` (``first_ms``: the first candidate's time);
    ``kva`` only when its one pass beats the best ``kv`` and ``q`` together."""
    best = {}
    for kernel in (*KERNELS, ATOMIC):
        mine = [r for r in rows if r["kernel"] == kernel]
        good = [r for r in mine if r["ms"] is not None and isinstance(r["error"], float)]
        good = [r for r in good if r["error"] <= tolerance]
        if good:
            fastest = min(good, key=lambda r: r["ms"])
            best[kernel] = dict(tile=fastest["tile"], ms=fastest["ms"], first_ms=mine[0]["ms"])
    split = [best.get(k, {}).get("ms") for k in ("kv", "q")]
    if ATOMIC in best and None not in split and best[ATOMIC]["ms"] >= sum(split):
        del best[ATOMIC]
    return best


def write_table(path: Path, gpu: str, case: Case, best: dict[str, dict], packed: bool) -> dict:
    """Merge ``best`` into the measured table at ``path`` for ``gpu`` (atomically); returns the
    GPU's entry."""
    import triton

    table = json.loads(path.read_text()) if path.exists() else {}
    gpus = table.setdefault("gpus", {})
    entry = gpus.setdefault(gpu, {"tiles": {}})
    precision = precision_class(DTYPES[case.dtype])
    entry["tiles"].pop(table_key(precision, case.head_dim, ATOMIC, packed), None)  # re-decided
    for kernel, found in best.items():
        entry["tiles"][table_key(precision, case.head_dim, kernel, packed)] = found["tile"]
    entry.update(
        date=datetime.date.today().isoformat(), torch=torch.__version__,
        triton=triton.__version__, measured_on=asdict(case),
    )  # fmt: skip
    table["about"] = (
        "Tiles (BMxBNxWARPSxSTAGES) of the triton backend's kernels per GPU, precision, head "
        "dim and kernel: the fastest candidate measured by tools/tune_triton.py that agreed "
        "with the others (focus_pretrain/focus/triton_tiles.py reads it)."
    )
    write_atomically(path, table)
    return entry


def write_atomically(path: Path, table: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def api_step(case: Case, data: dict, backend: str, mode: str) -> Callable[[], list[Tensor]]:
    """Forward + backward through ``focus_attention`` (``backend``, ``mode``; top-1):
    ``[out, lse, dq, dk, dv, dprobs]`` in fp32 (``dprobs`` absent for a sliding-window layer)."""
    from focus_pretrain.focus import Routing, focus_attention

    low = torch.float32 if backend == "reference" else DTYPES[case.dtype]
    leaves = [data[key].detach().to(low).requires_grad_(True) for key in ("q", "k", "v")]
    if not case.local:
        leaves.append(data["probs"].detach().float().requires_grad_(True))

    def step() -> list[Tensor]:
        out, lse = focus_attention(
            *leaves[:3], None if case.local else Routing(leaves[3]), mode=mode, top_k=1,
            backend=backend, return_lse=True, documents=data["docs"], window=case.window,
            gate_lambda=case.gate_lambda, softcap=case.softcap, sinks=case.sinks,
            local_only=case.local, check_finite=False,
        )  # fmt: skip
        d_lse = torch.ones_like(lse) * 0.1
        torch.autograd.backward([out, lse], [data["d_out"].to(out.dtype), d_lse])
        return [t.detach().float() for t in (out, lse, *(x.grad for x in leaves))]

    return step


def reference_errors(case: Case, device: str, mode: str = "soft") -> dict:
    """The ``triton`` backend against the reference (fp32, on the same rounded inputs): the
    largest error of the output, log-sum-exp and each gradient relative to its largest value,
    with the fast gate and the exact one."""
    data = inputs(case, device, seed=1)
    rounded = {k: (v.to(DTYPES[case.dtype]) if k in "qkv" else v) for k, v in data.items()}
    want = api_step(case, rounded, "reference", mode)()
    names = ["out", "lse", "dq", "dk", "dv", "dprobs"][: len(want)]
    result = {}
    for exact in (False, True):
        with environment({"FOCUS_TRITON_EXACT_GATE": "1" if exact else None}):
            got = api_step(case, rounded, "triton", mode)()
        errors = {n: _agreement([g], [w]) for n, g, w in zip(names, got, want, strict=True)}
        result["exact_gate" if exact else "fast_gate"] = errors
    return result


# candidates per kernel for fp16/bf16 on sm_90-class GPUs (BMxBNxWARPSxSTAGES): FlashAttention-2
# Triton's and FlexAttention's shapes (64-128 rows on Hopper's wgmma, 32-128 columns, 4-8 warps,
# 2-4 stages) and the spill-free defaults
HALF_CANDIDATES = {
    "fwd": ["64x64x4x3", "64x64x4x2", "64x64x4x4", "64x128x4x3", "64x128x8x3", "128x64x8x3",
            "128x64x8x2", "128x64x4x3", "128x32x8x3", "128x32x4x3", "128x128x8x2", "64x32x4x3",
            "64x64x8x3"],
    "kv": ["32x64x4x3", "64x64x4x3", "64x64x8x3", "32x128x4x3", "32x128x8x3", "64x128x8x3",
           "64x128x8x2", "16x64x4x3", "16x128x8x3", "128x128x8x2", "128x64x8x2", "64x64x4x2"],
    "q": ["64x32x4x3", "64x64x4x3", "64x64x8x3", "128x32x8x3", "128x64x8x3", "128x64x8x2",
          "128x32x4x3", "64x128x8x2", "32x64x4x3", "128x128x8x2"],
    ATOMIC: ["32x64x4x3", "64x64x8x3", "64x64x4x3", "32x128x8x3", "64x128x8x3", "64x128x8x2",
             "16x128x8x3", "128x64x8x2"],
}  # fmt: skip


def candidates(head_dim: int, first: dict[str, Tile], extra: dict | None = None) -> dict:
    """Per kernel: ``first`` (the tile the others are checked against), then
    :data:`HALF_CANDIDATES` (``extra`` instead when given: e.g. tiny tiles on a CPU)."""
    pool = extra if extra is not None else HALF_CANDIDATES
    result = {}
    for key in (*KERNELS, ATOMIC):
        tiles = [first[key]] if key in first else []
        tiles += [Tile.parse(text) for text in pool.get(key, [])]
        if tiles:
            result[key] = list(dict.fromkeys(tiles))  # first kept first, duplicates dropped
    return result


def _warm(jobs: list[tuple[dict, dict]], device: str) -> list[str]:
    """Compile (by launching once on a short sequence) each ``(case fields, tiles)`` job; the
    errors, one line each."""
    errors = []
    for fields, tiles in jobs:
        case = Case(**fields)
        try:
            kernel_results(case, inputs(case, device), {k: Tile.parse(v) for k, v in tiles.items()})
        except Exception as exc:
            errors.append(f"{tiles}: {str(exc)[:120]}")
    return errors


def precompile(jobs: list[tuple[Case, dict[str, Tile]]], device: str, processes: int) -> list:
    """Compile every job's kernels in ``processes`` worker processes at a short length (the same
    compile-time variant, so the timing pass finds them in Triton's cache): minutes of serial
    compiling become seconds. Returns the errors."""
    import concurrent.futures
    import multiprocessing

    short = [
        (asdict(replace(case, seq=min(case.seq, 1024))), {k: t.text() for k, t in tiles.items()})
        for case, tiles in jobs
    ]
    if processes <= 1 or len(short) <= 1:
        return _warm(short, device)
    slices = [short[i::processes] for i in range(processes)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        return [e for errors in pool.map(_warm, slices, [device] * processes) for e in errors]
