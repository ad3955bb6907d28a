"""Decode benchmark of an exported Focus model's KV cache (``tools/bench_decode.py``).

For each context length ``n`` it builds a random Focus Llama through the shipped HF modeling
code, prefills ``n`` tokens once (hard pattern, the package's fast backend), and times one-token
decode steps on copies of that cache, median after warm-up:

* ``dense``: the same architecture as a plain ``transformers`` model with SDPA attention on the
  same keys and values (what decoding costs without Focus);
* ``focus_dense``: the Focus model with ``inference_backend="dense"`` (masked attention over
  the whole cache);
* ``focus_sparse``: the default: each step reads its window and the keys of its groups only.

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

from focus_pretrain.bench.report import markdown
from focus_pretrain.convert.hf_export import load_modeling
from focus_pretrain.convert.hf_modeling.focus_cache import cache_kwargs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            t0 = time.perf_counter()
            model(prompt, use_cache=True, **cache_kwargs(model, cache))
            prefill_s = time.perf_counter() - t0
            row = {"seq": n, "batch": cfg.batch, "prefill_s": prefill_s}
            for name, runner, backend in (
                ("dense", plain, None),
                ("focus_dense", model, "dense"),
                ("focus_sparse", model, "auto"),
            ):
                if backend is not None:
                    model.config.focus["inference_backend"] = backend
                for attn in _attention_modules(model):
                    attn.focus_keys_read = 0
                times, logits = _step_times(runner, copy.deepcopy(cache), tokens, cfg.warmup)
                row[f"{name}_ms"] = statistics.median(times)
                row[f"_{name}_logits"] = logits
            model.config.focus["inference_backend"] = "auto"
        reads = sum(a.focus_keys_read for a in _attention_modules(model))
        row["keys_read_per_step"] = reads / (steps * cfg.layers * cfg.batch)  # per sequence
        row["keys_dense_per_step"] = n + (steps + 1) / 2
        row["sparse_speedup_vs_dense"] = row["dense_ms"] / row["focus_sparse_ms"]
        sparse, dense = row.pop("_focus_sparse_logits"), row.pop("_focus_dense_logits")
        row.pop("_dense_logits")
        row["max_abs_diff_sparse_vs_dense"] = max(
            float((a - b).abs().max()) for a, b in zip(sparse, dense, strict=True)
        )
        log(format_row(row))
        rows.append(row)
    return rows


def format_row(row: dict) -> str:
    return (
        f"seq={row['seq']} batch={row.get('batch', 1)} | dense {row['dense_ms']:.2f} ms | "
        f"focus dense {row['focus_dense_ms']:.2f} ms | "
        f"focus sparse {row['focus_sparse_ms']:.2f} ms ({row['sparse_speedup_vs_dense']:.2f}x) | "
        f"keys read {row['keys_read_per_step']:.0f} of {row['keys_dense_per_step']:.0f}"
    )


def markdown_table(rows: list[dict]) -> str:
    """One line per context length: the three step times, the speedup, keys read, the check."""
    columns = ["context", "batch", "dense SDPA (ms/step)", "Focus, dense cache (ms/step)"]
    columns += ["Focus, sparse (ms/step)", "speedup vs dense"]
    columns += ["keys read per step and sequence (of context)", "max abs diff"]
    return markdown(columns, "rrrrrrrr", (_markdown_cells(r) for r in rows))


def _markdown_cells(r: dict) -> list[object]:
    share = r["keys_read_per_step"] / r["keys_dense_per_step"]
    return [
        r["seq"], r.get("batch", 1), f"{r['dense_ms']:.2f}", f"{r['focus_dense_ms']:.2f}",
        f"{r['focus_sparse_ms']:.2f}", f"{r['sparse_speedup_vs_dense']:.2f}x",
        f"{r['keys_read_per_step']:.0f} ({100 * share:.1f}%)",
        f"{r['max_abs_diff_sparse_vs_dense']:.1e}",
    ]  # fmt: skip
