"""Decode benchmark of an exported Focus model's KV cache (``tools/bench_decode.py``).

For each context length ``n`` it builds a random Focus Llama through the shipped HF modeling
code, prefills ``n`` tokens once (hard pattern, the package's fast backend), and times one-token
decode steps on copies of that cache, median after warm-up:

* ``dense``: the same architecture as a plain ``transformers`` model with SDPA attention on the
  same keys and values (what decoding costs without Focus);
* ``focus_dense``: the Focus model with ``inference_backend="dense"`` (masked attention over
  the whole cache);
* ``focus_sparse``: the default: each step reads its window and the keys of its groups only.

With ``generate > 0`` each row also times ``generate()`` end to end (prefill and decode) on
each cache (:mod:`~focus_pretrain.bench.decode_generate`).

It checks first that the sparse and dense Focus steps give the same logits, and reports the
keys a sparse step read (counted by the model) against the context. Rows are dicts (JSON);
:func:`markdown_table` renders them. Layout: HF ``[b, heads, seq, d]`` caches.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from focus_pretrain.bench.decode_generate import generate_cells, generate_columns, generate_row
from focus_pretrain.bench.decode_static import static_row
from focus_pretrain.bench.report import markdown
from focus_pretrain.convert.hf_export import load_modeling
from focus_pretrain.convert.hf_modeling.focus_cache import cache_kwargs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CACHES = ("dynamic", "static")


@dataclass
class DecodeBenchConfig:
    """What to measure (see ``tools/bench_decode.py --help``)."""

    seq: list[int] = field(default_factory=lambda: [4096, 16384, 65536])
    batch: int = 1  # sequences decoded together (each its own random prompt)
    groups: int = 8
    top_k: int = 1
    window: int = 128
    layers: int = 2
    heads: int = 8
    heads_kv: int = 8
    head_dim: int = 64
    vocab: int = 1024
    warmup: int = 2
    steps: int = 8
    device: str = "cpu"
    dtype: str = "fp32"  # fp32 | bf16 | fp16: the models' weights and caches
    seed: int = 0
    caches: list[str] = field(default_factory=lambda: list(CACHES))  # dynamic | static
    cuda_graphs: bool = True  # the static rows' compiled steps as CUDA graphs (on CUDA)
    generate: int = 0  # > 0: also time generate() end to end for this many new tokens


def _models(cfg: DecodeBenchConfig):
    """``(focus, plain)``: a random Focus Llama and the same weights as a plain SDPA Llama."""
    modeling = load_modeling()
    hidden = cfg.heads * cfg.head_dim
    arch = dict(
        num_hidden_layers=cfg.layers,
        hidden_size=hidden,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads_kv,
        head_dim=cfg.head_dim,
        intermediate_size=2 * hidden,
        vocab_size=cfg.vocab,
        max_position_embeddings=max(cfg.seq) + cfg.warmup + cfg.steps + 1,
    )
    focus = dict(num_groups=cfg.groups, top_k=cfg.top_k, window=cfg.window)
    torch.manual_seed(cfg.seed)
    model = modeling.FocusLlamaForCausalLM(modeling.FocusLlamaConfig(focus=focus, **arch))
    plain = LlamaForCausalLM(LlamaConfig(attn_implementation="sdpa", **arch))
    plain.load_state_dict(model.state_dict(), strict=False)
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    return model.to(device, dtype).eval(), plain.to(device, dtype).eval()


def _step_times(model, cache, tokens: torch.Tensor, warmup: int) -> tuple[list[float], list]:
    """Milliseconds of each one-token step (``tokens [steps, b]``: one token per sequence)
    after ``warmup`` steps, and each step's logits ``[b, V]``."""
    times, logits = [], []
    for i, token in enumerate(tokens):
        if cache.layers[0].keys.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(token[:, None], use_cache=True, **cache_kwargs(model, cache))  # [b, 1]
        if out.logits.is_cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        logits.append(out.logits[:, -1])
    return times, logits


def _attention_modules(model) -> list:
    return [layer.self_attn for layer in model.model.layers]


def run_decode_benchmark(cfg: DecodeBenchConfig, log=print) -> list[dict]:
    """One row per context length (see the module docstring)."""
    model, plain = _models(cfg)
    device = torch.device(cfg.device)
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = []
    for n in cfg.seq:
        prompt = torch.randint(0, cfg.vocab, (cfg.batch, n), generator=gen).to(device)  # [b, n]
        steps = cfg.warmup + cfg.steps
        tokens = torch.randint(0, cfg.vocab, (steps, cfg.batch), generator=gen).to(device)
        row = _dynamic_row(cfg, model, plain, prompt, tokens)
        if "static" in cfg.caches:
            graphs = cfg.cuda_graphs and device.type == "cuda"
            exact = row["_focus_dense_logits"]
            try:
                row.update(static_row(cfg, model, plain, prompt, tokens, exact, graphs))
            except torch.OutOfMemoryError:  # a length too long for this GPU: the row says so
                row["static_error"] = "out of memory"
                torch.cuda.empty_cache()
        if cfg.generate > 0:
            try:
                row.update(generate_row(cfg, model, plain, prompt))
            except torch.OutOfMemoryError:
                row["generate_error"] = "out of memory"
                torch.cuda.empty_cache()
        for key in [k for k in row if k.startswith("_")]:
            row.pop(key)
        log(format_row(row))
        rows.append(row)
    return rows


def _dynamic_row(cfg: DecodeBenchConfig, model, plain, prompt, tokens) -> dict:
    """The dynamic cache's figures (``"dynamic" in cfg.caches``), and always the exact dense
    Focus step's logits (``_focus_dense_logits``, the static rows' check)."""
    n = prompt.shape[1]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        t0 = time.perf_counter()
        model(prompt, use_cache=True, **cache_kwargs(model, cache))
        row = {"seq": n, "batch": cfg.batch, "prefill_s": time.perf_counter() - t0}
        variants = [("focus_dense", model, "dense")]
        if "dynamic" in cfg.caches:
            variants = [("dense", plain, None), *variants, ("focus_sparse", model, "auto")]
        for name, runner, backend in variants:
            if backend is not None:
                model.config.focus["inference_backend"] = backend
            for attn in _attention_modules(model):
                attn.focus_keys_read = 0
            times, logits = _step_times(runner, copy.deepcopy(cache), tokens, cfg.warmup)
            row[f"{name}_ms"] = statistics.median(times)
            row[f"_{name}_logits"] = logits
        model.config.focus["inference_backend"] = "auto"
    if "dynamic" not in cfg.caches:
        return row
    steps = tokens.shape[0]
    reads = sum(a.focus_keys_read for a in _attention_modules(model))
    row["keys_read_per_step"] = reads / (steps * cfg.layers * cfg.batch)  # per sequence
    row["keys_dense_per_step"] = n + (steps + 1) / 2
    row["sparse_speedup_vs_dense"] = row["dense_ms"] / row["focus_sparse_ms"]
    sparse, dense = row["_focus_sparse_logits"], row["_focus_dense_logits"]
    row["max_abs_diff_sparse_vs_dense"] = max(
        float((a - b).abs().max()) for a, b in zip(sparse, dense, strict=True)
    )
    return row


def format_row(row: dict) -> str:
    parts = [f"seq={row['seq']} batch={row.get('batch', 1)}"]
    if "dense_ms" in row:
        parts.append(
            f"dynamic: dense {row['dense_ms']:.2f} ms | focus dense {row['focus_dense_ms']:.2f} ms"
            f" | focus sparse {row['focus_sparse_ms']:.2f} ms "
            f"({row['sparse_speedup_vs_dense']:.2f}x) | keys read "
            f"{row['keys_read_per_step']:.0f} of {row['keys_dense_per_step']:.0f}"
        )
    if "static_error" in row:
        parts.append(f"static compiled: {row['static_error']}")
    elif "static_dense_ms" in row:
        parts.append(
            f"static compiled: dense {row['static_dense_ms']:.3f} ms | focus "
            f"{row['static_focus_ms']:.3f} ms ({row['static_speedup_vs_dense']:.2f}x) | "
            f"blocks visited {100 * row['static_blocks_visited']:.1f}%"
        )
    if "generate_error" in row:
        parts.append(f"generate: {row['generate_error']}")
    elif "generate_new_tokens" in row:
        times = [
            f"{cache} dense {row[f'generate_{cache}_dense_s']:.3f} s / focus "
            f"{row[f'generate_{cache}_focus_s']:.3f} s ({row[f'generate_{cache}_speedup']:.2f}x)"
            for cache in CACHES
            if f"generate_{cache}_dense_s" in row
        ]
        parts.append(f"generate {row['generate_new_tokens']} tokens: " + ", ".join(times))
    return " | ".join(parts)


def markdown_table(rows: list[dict]) -> str:
    """The dynamic cache's table (step times, speedup, keys read, the check) and the static
    cache's (compiled step times, speedup, launches and host syncs, blocks visited, the
    check), each for the rows that have it."""
    tables = []
    dynamic = [r for r in rows if "dense_ms" in r]
    if dynamic:
        columns = ["context", "batch", "dense SDPA (ms/step)", "Focus, dense cache (ms/step)"]
        columns += ["Focus, sparse (ms/step)", "speedup vs dense"]
        columns += ["keys read per step and sequence (of context)", "max abs diff"]
        tables.append(markdown(columns, "rrrrrrrr", (_dynamic_cells(r) for r in dynamic)))
    static = [r for r in rows if "static_dense_ms" in r or "static_error" in r]
    if static:
        columns = ["context", "batch", "CUDA graphs", "static dense SDPA, compiled (ms/step)"]
        columns += ["static Focus, compiled (ms/step)", "speedup vs dense"]
        columns += ["eager step: launches / host syncs (dense; Focus)", "CUDA kernels per step"]
        columns += ["key blocks visited", "max abs diff vs exact"]
        tables.append(markdown(columns, "rrrrrrrrrr", (_static_cells(r) for r in static)))
    ends = [r for r in rows if "generate_new_tokens" in r]
    if ends:
        caches = [c for c in CACHES if f"generate_{c}_dense_s" in ends[0]]
        columns = generate_columns(caches, ends[0]["generate_compiled"])
        cells = (generate_cells(r, caches) for r in ends)
        tables.append(markdown(columns, "r" * len(columns), cells))
    return "\n\n".join(tables)


def _dynamic_cells(r: dict) -> list[object]:
    share = r["keys_read_per_step"] / r["keys_dense_per_step"]
    return [
        r["seq"], r.get("batch", 1), f"{r['dense_ms']:.2f}", f"{r['focus_dense_ms']:.2f}",
        f"{r['focus_sparse_ms']:.2f}", f"{r['sparse_speedup_vs_dense']:.2f}x",
        f"{r['keys_read_per_step']:.0f} ({100 * share:.1f}%)",
        f"{r['max_abs_diff_sparse_vs_dense']:.1e}",
    ]  # fmt: skip


def _static_cells(r: dict) -> list[object]:
    if "static_error" in r:
        return [r["seq"], r.get("batch", 1), r["static_error"], *["-"] * 7]
    dense, focus = r["static_dense_eager"], r["static_focus_eager"]
    kernels = [r.get(f"static_{k}_cuda_kernels") for k in ("dense", "focus")]
    return [
        r["seq"], r.get("batch", 1), "yes" if r["static_cuda_graphs"] else "no",
        f"{r['static_dense_ms']:.3f}", f"{r['static_focus_ms']:.3f}",
        f"{r['static_speedup_vs_dense']:.2f}x",
        f"{dense['launches']} / {dense['host_syncs']}; {focus['launches']} / {focus['host_syncs']}",
        "-" if None in kernels else f"{kernels[0]}; {kernels[1]}",
        f"{100 * r['static_blocks_visited']:.1f}%", f"{r['max_abs_diff_static_vs_dense']:.1e}",
    ]  # fmt: skip
