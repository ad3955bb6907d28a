"""``generate`` end to end for the decode benchmark (``tools/bench_decode.py --generate N``).

For one prompt ``[b, n]`` it times ``model.generate(prompt, max_new_tokens=N)`` (greedy,
exactly ``N`` new tokens: prefill and decode together, what a user waits for) for the plain
SDPA model and the Focus model, on each cache the benchmark measures: the dynamic cache (eager,
Focus's sparse step) and ``cache_implementation="static"`` (on CUDA transformers compiles the
decode step itself, CUDA graphs included: Focus's step then runs block-sparse). A first call of
the same shapes warms up (the compile is not timed); the second is timed. The Focus model's
tokens on the static cache are compared with its tokens on the dynamic cache.
"""

from __future__ import annotations

import time

import torch


def _generate(model, prompt: torch.Tensor, new: int, cache: str) -> torch.Tensor:
    """``[b, new]`` greedy tokens (exactly ``new``: no end-of-sequence stop)."""
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    mask = torch.ones_like(prompt)
    out = model.generate(prompt, attention_mask=mask, pad_token_id=0, eos_token_id=None, **kwargs)
    return out[:, prompt.shape[1] :]  # [b, n + new] -> [b, new]


def _timed(model, prompt: torch.Tensor, new: int, cache: str) -> tuple[float, torch.Tensor]:
    """``(seconds, tokens [b, new])`` of the second of two identical calls."""
    _generate(model, prompt, new, cache)  # warm-up: the static cache's compile on CUDA
    if prompt.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = _generate(model, prompt, new, cache)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, tokens


def generate_row(cfg, model, plain, prompt: torch.Tensor) -> dict:
    """The ``generate_*`` figures of one row: per cache in ``cfg.caches``, the plain and the
    Focus model's seconds and new tokens per second, Focus's speedup, and whether Focus's
    static tokens equal its dynamic ones (both caches measured)."""
    new = cfg.generate
    row: dict = {"generate_new_tokens": new, "generate_compiled": prompt.is_cuda}
    tokens = {}
    with torch.no_grad():
        for cache in cfg.caches:
            for name, runner in (("dense", plain), ("focus", model)):
                seconds, tokens[cache, name] = _timed(runner, prompt, new, cache)
                row[f"generate_{cache}_{name}_s"] = seconds
                row[f"generate_{cache}_{name}_tokens_per_s"] = prompt.shape[0] * new / seconds
            row[f"generate_{cache}_speedup"] = (
                row[f"generate_{cache}_dense_s"] / row[f"generate_{cache}_focus_s"]
            )
    if {"dynamic", "static"} <= set(cfg.caches):
        same = torch.equal(tokens["static", "focus"], tokens["dynamic", "focus"])
        row["generate_focus_static_equals_dynamic"] = same
    return row


def generate_cells(r: dict, caches: list[str]) -> list[object]:
    """A markdown row: context, batch, new tokens, then per cache the plain and Focus seconds
    and Focus's speedup, and whether Focus's tokens agree across the caches."""
    cells: list[object] = [r["seq"], r.get("batch", 1), r["generate_new_tokens"]]
    for cache in caches:
        cells += [
            f"{r[f'generate_{cache}_dense_s']:.3f}",
            f"{r[f'generate_{cache}_focus_s']:.3f}",
            f"{r[f'generate_{cache}_speedup']:.2f}x",
        ]
    same = r.get("generate_focus_static_equals_dynamic")
    cells.append("-" if same is None else ("yes" if same else "no"))
    return cells


def generate_columns(caches: list[str], compiled: bool) -> list[str]:
    """The markdown header for :func:`generate_cells`."""
    columns = ["context", "batch", "new tokens"]
    for cache in caches:
        label = "static (compiled, CUDA graphs)" if cache == "static" and compiled else cache
        columns += [f"{label}: dense SDPA (s)", f"{label}: Focus (s)", f"{label}: speedup"]
    return [*columns, "Focus tokens: static = dynamic"]
