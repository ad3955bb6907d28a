"""Benchmark of the Focus backends against dense causal attention (``tools/bench_attention.py``).

For every sequence length, ``K`` and ``top_k`` it times, after warm-up and as the median of
repeats (CUDA events on GPU, ``perf_counter`` on CPU):

* dense causal attention of the same shape and dtype: SDPA (restricted to its flash kernel on
  CUDA) and ``flash_attn_func`` when ``flash-attn`` is importable; the best of them is the
  baseline of every speedup;
* each Focus backend in hard mode through the public :func:`focus_attention` (routing
  membership, sort, kernels, merge: everything a caller pays);
* the backend's non-kernel work alone (membership, group sort, packing, block masks, log-sum-exp
  merge, unsort): the *overhead* column;
* per backend, the operators one call dispatches (kernel launches) and its host syncs, counted
  eagerly on a prefix (:class:`~focus_pretrain.bench.dispatch.DispatchCounter`; on CUDA also
  the device kernels the profiler sees, compiled pieces fused);
* optionally (``graphs=True``) every timed call captured whole: ``torch.compile(fullgraph=True,
  mode="reduce-overhead")``, i.e. replayed as a CUDA graph on CUDA (no launch or host cost
  per kernel), dense SDPA alike; on CPU the ``aot_eager`` backend (a smoke check of capture);
* optionally (``train=True``) one training step (forward + backward) with the soft gate and,
  per ``top_k``, on the sparse (hard_gated) pattern, of each backend asked for that trains it
  here, against dense SDPA forward + backward (:mod:`~focus_pretrain.bench.attention_train`).

The ideal speedup is ``1 / density`` of the routed pattern's exact allowed-pair count. Before
timing, each backend is checked against the reference on a prefix of the inputs. Rows are plain
dicts (JSON) and :func:`markdown_table` renders them. CPU runs are smoke tests, not figures.
Layout: ``[batch, seq, heads, head_dim]``.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from focus_pretrain.bench.attention_train import train_rows
from focus_pretrain.bench.config import BenchConfig
from focus_pretrain.bench.dispatch import DispatchCounter
from focus_pretrain.bench.report import DTYPES, markdown, median_ms
from focus_pretrain.errors import InputError
from focus_pretrain.focus import flex
from focus_pretrain.focus.attention import focus_attention
from focus_pretrain.focus.backends import backend_names, get_backend
from focus_pretrain.focus.config import MAX_GROUPS
from focus_pretrain.focus.lse import merge_by_lse
from focus_pretrain.focus.pattern import key_side_memberships, pattern_density
from focus_pretrain.focus.router import Routing
from focus_pretrain.focus.sorted_layout import GroupSortedLayout, segment_slots

CHECK_TOKENS = 4096  # prefix checked against the reference before timing
COUNT_TOKENS = 4096  # prefix whose launches and host syncs are counted (eager FlexAttention
# under a counter materialises the scores; the counts barely depend on the length)


def _timer(device: torch.device, warmup: int, repeats: int) -> Callable[[Callable], float]:
    """``measure(fn)``: the median milliseconds of ``fn`` (:func:`~.report.median_ms`)."""
    return functools.partial(median_ms, device=device, warmup=warmup, repeats=repeats)


def captured(fn: Callable, *args: Tensor) -> Callable[[], object]:
    """``fn(*args)`` compiled whole for timing: CUDA graphs on CUDA (``reduce-overhead``),
    ``aot_eager`` elsewhere (Inductor's CPU FlexAttention returns no log-sum-exp)."""
    if args[0].is_cuda:
        compiled = torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead")
    else:
        compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend="aot_eager")
    return lambda: compiled(*args)


def dense_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Dense causal SDPA (its flash kernel on CUDA) of ``[b, s, h, d]`` inputs ->
    ``[b, h, s, d]``."""
    q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))  # [b, s, h, d] -> [b, h, s, d]
    gqa = k.shape[2] != q.shape[2]
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(
                q4, k4, v4, is_causal=True, scale=scale, enable_gqa=gqa
            )
    return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=gqa)


def dense_baselines(q: Tensor, k: Tensor, v: Tensor, scale: float) -> dict[str, Callable]:
    """Dense causal attention callables of the same shape: SDPA (flash on CUDA), flash-attn."""
    out = {"sdpa": functools.partial(dense_sdpa, q, k, v, scale)}
    if q.is_cuda and importlib.util.find_spec("flash_attn") is not None:
        from flash_attn import flash_attn_func

        out["flash_attn"] = lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    return out


def overhead_fn(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor,
    top_k: int,
    window: int,
    key_groups: str = "own",
) -> Callable[[], object]:
    """The backend's non-kernel work alone (membership, sort, pack, masks, merge, unsort; the
    keys' own layout and bitmasks under ``key_groups``)."""

    def run():
        member = Routing(probs).membership(top_k)
        slots = segment_slots(probs.shape[-1], top_k, documents=False)  # as the backends
        layout = keys = GroupSortedLayout.build(member, slots=slots)
        key_member = key_side_memberships(member, key_groups)  # None: their own
        if key_member is not None:
            key_slots = segment_slots(
                probs.shape[-1], top_k, documents=False, key_groups=key_groups
            )
            keys = GroupSortedLayout.build(key_member, slots=key_slots)
        packed = [layout.pack(q), keys.pack(k), keys.pack(v)]  # [b * n, H|Hkv, D]
        if backend == "flex" and q.is_cuda:
            flex.same_group_block_mask(layout, keys=None if key_member is None else keys)
            flex.band_block_mask(q.shape[1], window, member, q.device, key_member=key_member)
        out = layout.unpack(packed[0])  # the kernels' output has q's packed shape
        lse = out[..., 0].float()  # [b, n, H]
        return merge_by_lse((out, lse), (out, lse))

    return run


def profile_table(fn: Callable, title: str, rows: int = 18) -> str:
    """One call of ``fn`` under ``torch.profiler`` (after the timing's warm-up): the ops that
    cost the most device time and the most host time, as text."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = prof.key_averages()
    device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return "\n".join(
        [
            f"## {title}",
            events.table(sort_by=device_key, row_limit=rows),
            events.table(sort_by="cpu_time_total", row_limit=rows // 2),
        ]
    )


def count_call(call: Callable[[], object], device: torch.device) -> dict:
    """One call of ``call`` counted: ``launches`` and ``host_syncs`` (dispatched operators,
    :class:`~focus_pretrain.bench.dispatch.DispatchCounter`), ``sync_ops`` and, on CUDA,
    ``cuda_kernels``: the device kernels of one normal call (compiled pieces fused)."""
    with DispatchCounter() as counter:
        call()
    counts = counter.summary()
    if device.type == "cuda":
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        call()  # warm: compiled pieces built
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        counts["cuda_kernels"] = sum(
            e.count for e in prof.key_averages() if e.device_type == DeviceType.CUDA
        )
    return counts


def _counts(name: str, q, k, v, routing, kwargs) -> dict:
    """:func:`count_call` of backend ``name`` on a :data:`COUNT_TOKENS` prefix."""
    n = min(q.shape[1], COUNT_TOKENS)
    args = (q[:, :n], k[:, :n], v[:, :n], Routing(routing.probs[:, :n]))
    return count_call(lambda: focus_attention(*args, backend=name, **kwargs), q.device)


def _check(name: str, q, k, v, routing, kwargs) -> float:
    n = min(q.shape[1], CHECK_TOKENS)
    probs = routing.probs[:, :n]
    args = (q[:, :n], k[:, :n], v[:, :n], Routing(probs))
    want = focus_attention(*args, backend="reference", **kwargs).float()
    got = focus_attention(*args, backend=name, **kwargs).float()
    return float((got - want).abs().max())


def check_config(cfg: BenchConfig) -> None:
    """Refuse, before anything runs, what the benchmark cannot measure (the counts' lower
    bounds are the command's argument types).

    Raises:
        InputError: naming the option and what is allowed.
    """
    if cfg.heads % cfg.heads_kv:
        raise InputError(
            f"--heads {cfg.heads} is not a multiple of --heads-kv {cfg.heads_kv} (grouped-query "
            "attention shares each KV head among the same number of query heads)"
        )
    if max(cfg.groups) > MAX_GROUPS:
        raise InputError(f"--groups {max(cfg.groups)} is more than {MAX_GROUPS}, the most groups")
    if cfg.hard and min(cfg.top_k) > max(cfg.groups):
        raise InputError(
            f"every --top-k ({' '.join(map(str, cfg.top_k))}) is above every --groups "
            f"({' '.join(map(str, cfg.groups))}): no pattern to measure; give top_k <= K"
        )
    if not cfg.hard and not cfg.train:
        raise InputError("--no-hard leaves only the --train rows: add --train")
    unknown = [name for name in cfg.backends if name not in backend_names()]
    if unknown:
        raise InputError(
            f"--backends: unknown backend(s) {', '.join(unknown)}; choose from "
            f"{', '.join(backend_names())}"
        )
    if torch.device(cfg.device).type == "cuda" and not torch.cuda.is_available():
        raise InputError(
            f"--device {cfg.device}: no CUDA device here; pass --device cpu (a smoke test only)"
        )


def run_benchmark(
    cfg: BenchConfig,
    log: Callable[[str], None] = print,
    on_row: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Measure every configuration; returns one row (dict) per (seq, K, top_k[, train]).
    ``on_row(rows)`` runs after each row (e.g. to save partial results: a run stopped by a
    time limit keeps what it measured)."""
    device = torch.device(cfg.device)
    measure = _timer(device, cfg.warmup, cfg.repeats)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    scale = cfg.head_dim**-0.5
    rows: list[dict] = []

    def add(row: dict) -> None:
        rows.append(row)
        log(format_row(row))
        if on_row:
            on_row(rows)

    for n in cfg.seq:
        q, k, v = [_random_heads(cfg, n, h, gen) for h in (cfg.heads, cfg.heads_kv, cfg.heads_kv)]
        dense = {}
        if cfg.hard:
            baselines = dense_baselines(q, k, v, scale)
            if cfg.graphs:  # the same capture for the baseline (flash-attn's op does not trace)
                baselines = {"sdpa": captured(functools.partial(dense_sdpa, scale=scale), q, k, v)}
            with torch.no_grad():
                dense = {name: measure(fn) for name, fn in baselines.items()}
        for groups in cfg.groups:
            probs = torch.softmax(
                torch.randn(cfg.batch, n, groups, generator=gen, device=device) * 3, dim=-1
            )  # [b, n, K] random, balanced in expectation
            routing = Routing(probs)
            for top_k in (t for t in cfg.top_k if t <= groups and cfg.hard):
                add(hard_row(cfg, q, k, v, routing, top_k, dense, measure))
            if cfg.train:
                for row in train_rows(cfg, q, k, v, probs, measure, log):
                    add(row)
    return rows


def _random_heads(cfg: BenchConfig, n: int, heads: int, gen: torch.Generator) -> Tensor:
    """Random ``[batch, n, heads, head_dim]`` in the benchmark's dtype (drawn in fp32)."""
    shape = (cfg.batch, n, heads, cfg.head_dim)
    random = torch.randn(shape, generator=gen, device=torch.device(cfg.device), dtype=torch.float32)
    return random.to(DTYPES[cfg.dtype])


def hard_row(
    cfg: BenchConfig,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    routing: Routing,
    top_k: int,
    dense: dict[str, float],
    measure: Callable[[Callable], float],
) -> dict:
    """The hard top-``top_k`` row of each of ``cfg.backends`` on ``q, k, v`` against the
    fastest of the ``dense`` baselines (milliseconds by name)."""
    density = routed_density(routing.membership(top_k).cpu(), cfg.window, cfg.key_groups)
    base_name = min(dense, key=dense.get) if dense else None
    row = dict(
        seq=q.shape[1],
        groups=routing.probs.shape[-1],
        top_k=top_k,
        window=cfg.window,
        mode="hard" + ("" if cfg.key_groups == "own" else f" (keys {cfg.key_groups})"),
        key_groups=cfg.key_groups,
        captured=cfg.graphs,
        dense_ms=dense,
        baseline=base_name,
        ideal_speedup=1.0 / density,
        density=density,
        backends={},
    )
    kwargs = dict(
        window=cfg.window, mode="hard", top_k=top_k, check_finite=False, key_groups=cfg.key_groups
    )
    for name in cfg.backends:
        if (name == "decomposed" and top_k != 1) or name == "triton":
            continue  # top-1 only by construction; the soft pattern only
        if cfg.key_groups not in get_backend(name).capabilities.key_groups:
            continue  # it refuses the keys' rule by name
        with torch.no_grad():
            error = _check(name, q, k, v, routing, kwargs)
            counts = _counts(name, q, k, v, routing, kwargs)
            total, overhead = _hard_times(cfg, name, (q, k, v), routing, kwargs, measure)
        row["backends"][name] = dict(
            **counts,
            ms=total,
            speedup=dense[base_name] / total,
            overhead_ms=overhead,
            overhead_fraction=None if overhead is None else overhead / total,
            max_abs_error_vs_reference=error,
        )
    return row


def routed_density(member: Tensor, window: int, key_groups: str) -> float:
    """The hard pattern's share of the causal pairs (mean over the batch) from ``member [b,
    n]``, the keys counted in their groups under ``key_groups``."""
    keys = key_side_memberships(member, key_groups)  # None: their own
    return float(pattern_density(member, window, key_member=keys).mean())


def _hard_times(
    cfg: BenchConfig,
    name: str,
    qkv: tuple[Tensor, Tensor, Tensor],
    routing: Routing,
    kwargs: dict,
    measure: Callable[[Callable], float],
) -> tuple[float, float | None]:
    """Milliseconds of backend ``name``'s whole call and of its non-kernel work alone (``None``
    for the reference); appends the call's profile to ``cfg.profile`` when set."""
    call = functools.partial(focus_attention, *qkv, routing, backend=name, **kwargs)
    if cfg.graphs:  # the whole call (routing membership to merge) captured as one graph
        attend = functools.partial(focus_attention, backend=name, **kwargs)
        call = captured(lambda q, k, v, probs: attend(q, k, v, probs), *qkv, routing.probs)
    total = measure(call)
    overhead = None  # the reference has no sort/merge to separate
    if name != "reference":
        fn = overhead_fn(
            name, *qkv, routing.probs, kwargs["top_k"], cfg.window, kwargs["key_groups"]
        )
        overhead = measure(fn)
    if cfg.profile:
        shape = f"seq={qkv[0].shape[1]} K={routing.probs.shape[-1]} top_k={kwargs['top_k']}"
        with open(cfg.profile, "a") as f:
            f.write(profile_table(call, f"{name} {shape}") + "\n\n")
    return total, overhead


def format_row(row: dict) -> str:
    parts = [f"seq={row['seq']} K={row['groups']} top_k={row['top_k']} {row['mode']}"]
    parts += [f"{name} {ms:.3f} ms" for name, ms in row["dense_ms"].items()]
    for name, b in row["backends"].items():
        counted = f", {b['launches']} launches, {b['host_syncs']} syncs" if "launches" in b else ""
        parts.append(f"{name} {b['ms']:.3f} ms ({b['speedup']:.2f}x{counted})")
    parts.append(f"ideal {row['ideal_speedup']:.2f}x")
    return " | ".join(parts)


def markdown_table(rows: list[dict]) -> str:
    """One line per (row, backend): time, speedup, ideal, overhead, check error."""
    columns = ["seq", "K", "top_k", "mode", "dense (ms)", "backend", "time (ms)", "speedup"]
    columns += ["ideal", "overhead (ms, %)", "launches", "host syncs", "max err vs ref"]
    return markdown(columns, "rrrlrlrrrrrrr", (c for row in rows for c in _markdown_cells(row)))


def _markdown_cells(row: dict) -> Iterator[list[object]]:
    """The cells of ``row``'s lines in :func:`markdown_table`, one line per backend."""
    dense = row["dense_ms"][row["baseline"]]
    for name, b in row["backends"].items():
        overhead = "-"
        if b["overhead_ms"] is not None:
            overhead = f"{b['overhead_ms']:.3f} ({100 * b['overhead_fraction']:.1f}%)"
        error = b["max_abs_error_vs_reference"]
        launches = b.get("launches", "-")
        if b.get("cuda_kernels") is not None:
            launches = f"{launches} ({b['cuda_kernels']} kernels)"
        yield [
            row["seq"], row["groups"], row["top_k"] or "-", row["mode"],
            f"{dense:.3f} ({row['baseline']})", name, f"{b['ms']:.3f}", f"{b['speedup']:.2f}x",
            f"{row['ideal_speedup']:.2f}x", overhead, launches, b.get("host_syncs", "-"),
            "-" if error is None else f"{error:.1e}",
        ]  # fmt: skip
