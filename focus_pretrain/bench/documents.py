"""Benchmark of packed-document masking in a Focus backend (``tools/bench_documents.py``).

For every sequence length ``n``, document length ``L`` (``n / L`` documents of ``L`` tokens)
and number of sinks it times one hard top-1 call of the backend (default ``decomposed``) through
the public :func:`~focus_pretrain.focus.focus_attention`, after warm-up and as the median of
repeats, in three forms of the same tokens:

* **packed**: one ``[1, n]`` sequence with ``documents=`` (what a packed pre-training batch
  runs);
* **unpacked**: the equivalent batch of ``n / L`` separate ``[1, L]`` sequences
  (``[n / L, L]``), with no documents: the same attention, the cost to match;
* **no documents**: the ``[1, n]`` sequence attended as one document (attention across the
  boundaries: what packing without masking would cost).

The masking overhead is ``packed / unpacked``. Before timing, the packed output is checked
against the unpacked one (they are the same function of the same tokens). The three calls are
timed interleaved, one of each per repeat, so that a load change on a shared machine hits them
alike; a ratio is the median of the per-repeat ratios. Rows are plain dicts
(JSON) and :func:`markdown_table` renders them. Layout: ``[batch, seq, heads, head_dim]``.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from focus_pretrain.bench.report import DTYPES, elapsed_ms, markdown
from focus_pretrain.focus.attention import focus_attention
from focus_pretrain.focus.router import Routing


@dataclass
class DocumentsBenchConfig:
    """What to measure (see ``tools/bench_documents.py --help``)."""

    seq: list[int] = field(default_factory=lambda: [16384])
    doc_len: list[int] = field(default_factory=lambda: [512])
    sinks: list[int] = field(default_factory=lambda: [0])
    groups: int = 8
    window: int = 128
    heads: int = 8
    heads_kv: int = 8
    head_dim: int = 64
    dtype: str = "fp32"
    backend: str = "decomposed"
    warmup: int = 1
    repeats: int = 5
    device: str = "cpu"
    seed: int = 0


def packed_inputs(
    cfg: DocumentsBenchConfig, n: int, doc_len: int, gen: torch.Generator
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Random ``q [1, n, H, D]``, ``k, v [1, n, Hkv, D]``, routing probabilities ``[1, n, K]``
    and document ids ``[1, n]`` (document ``t`` is tokens ``[t L, (t + 1) L)``)."""
    device = torch.device(cfg.device)
    dtype = DTYPES[cfg.dtype]

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)

    q = randn(1, n, cfg.heads, cfg.head_dim).to(dtype)
    k = randn(1, n, cfg.heads_kv, cfg.head_dim).to(dtype)
    v = randn(1, n, cfg.heads_kv, cfg.head_dim).to(dtype)
    probs = torch.softmax(randn(1, n, cfg.groups) * 3, dim=-1)  # [1, n, K]
    documents = (torch.arange(n, device=device) // doc_len)[None]  # [1, n]
    return q, k, v, probs, documents


def measure_interleaved(
    calls: dict[str, Callable[[], object]], device: torch.device, warmup: int, repeats: int
) -> dict[str, list[float]]:
    """Milliseconds of each call per repeat, the calls run in turn within every repeat."""
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            times[name].append(elapsed_ms(fn, device))
    return times


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
    """The median over repeats of ``numerator / denominator`` (times of one repeat)."""
    return statistics.median(x / y for x, y in zip(numerator, denominator, strict=True))


def unpack(t: Tensor, doc_len: int) -> Tensor:
    """``[1, n, ...]`` -> ``[n / L, L, ...]``: each document its own sample."""
    return t.reshape(t.shape[1] // doc_len, doc_len, *t.shape[2:])  # [n / L, L, ...]


def run_benchmark(cfg: DocumentsBenchConfig, log: Callable[[str], None] = print) -> list[dict]:
    """Measure every (seq, doc_len, sinks); returns one row (dict) each: the median
    milliseconds ``ms`` of each form, every repeat's ``repeats_ms`` and the median ratios."""
    device = torch.device(cfg.device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    rows = []
    for n in cfg.seq:
        for doc_len in cfg.doc_len:
            if n % doc_len:
                raise ValueError(f"doc_len ({doc_len}) must divide seq ({n})")
            q, k, v, probs, documents = packed_inputs(cfg, n, doc_len, gen)
            split = [unpack(t, doc_len) for t in (q, k, v, probs)]  # [n / L, L, ...]
            for sinks in cfg.sinks:
                kwargs = dict(
                    window=cfg.window,
                    mode="hard",
                    top_k=1,
                    sinks=sinks,
                    backend=cfg.backend,
                    check_finite=False,
                )
                calls = {
                    "packed": functools.partial(
                        focus_attention, q, k, v, Routing(probs), documents=documents, **kwargs
                    ),
                    "unpacked": functools.partial(
                        focus_attention, *split[:3], Routing(split[3]), **kwargs
                    ),
                    "no_documents": functools.partial(
                        focus_attention, q, k, v, Routing(probs), **kwargs
                    ),
                }
                with torch.no_grad():
                    packed, alone = calls["packed"](), calls["unpacked"]()
                    error = float(
                        (packed.float() - alone.reshape(packed.shape).float()).abs().max()
                    )
                    times = measure_interleaved(calls, device, cfg.warmup, max(1, cfg.repeats))
                row = dict(
                    seq=n,
                    doc_len=doc_len,
                    documents=n // doc_len,
                    groups=cfg.groups,
                    window=cfg.window,
                    sinks=sinks,
                    backend=cfg.backend,
                    dtype=cfg.dtype,
                    ms={name: statistics.median(t) for name, t in times.items()},
                    repeats_ms=times,
                    packed_over_unpacked=median_ratio(times["packed"], times["unpacked"]),
                    packed_over_no_documents=median_ratio(times["packed"], times["no_documents"]),
                    max_abs_diff_packed_vs_unpacked=error,
                )
                rows.append(row)
                log(format_row(row))
    return rows


def format_row(row: dict) -> str:
    ms = row["ms"]
    return (
        f"seq={row['seq']} doc_len={row['doc_len']} sinks={row['sinks']} | "
        f"packed {ms['packed']:.1f} ms | unpacked {ms['unpacked']:.1f} ms | "
        f"no documents {ms['no_documents']:.1f} ms | "
        f"packed/unpacked {row['packed_over_unpacked']:.2f}x"
    )


def markdown_table(rows: list[dict]) -> str:
    """One line per row: the three median times, the two median ratios and the check."""
    columns = ["seq", "doc len", "docs", "K", "window", "sinks", "backend", "packed (ms)"]
    columns += ["unpacked batch (ms)", "no documents (ms)", "packed / unpacked"]
    columns += ["packed / no documents", "max diff packed vs unpacked"]
    return markdown(columns, "rrrrrrlrrrrrr", (_markdown_cells(r) for r in rows))


def _markdown_cells(r: dict) -> list[object]:
    ms = r["ms"]
    return [
        r["seq"], r["doc_len"], r["documents"], r["groups"], r["window"], r["sinks"],
        r["backend"], f"{ms['packed']:.1f}", f"{ms['unpacked']:.1f}",
        f"{ms['no_documents']:.1f}", f"{r['packed_over_unpacked']:.2f}x",
        f"{r['packed_over_no_documents']:.2f}x", f"{r['max_abs_diff_packed_vs_unpacked']:.1e}",
    ]  # fmt: skip
