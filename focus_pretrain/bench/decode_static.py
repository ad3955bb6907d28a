"""The compiled decode step on transformers' ``StaticCache``: dense SDPA vs Focus, block-sparse.

For one context length, each model gets a static cache of ``n + steps + 1`` slots, an eager
prefill (the Focus model in one forward: its whole-sequence path, after which it sorts each
layer's prompt slots by group; the plain model into a dynamic cache, copied over: its SDPA
prefill into a static cache would build a ``[b, 1, n, L]`` mask),
then one-token decode steps through one ``torch.compile(fullgraph=True)`` graph per model
(``mode="reduce-overhead"``, CUDA graphs, on CUDA unless ``--no-cuda-graphs``), timed after the
compiling warm-up steps. Reported next to each time: the eager step's launches and host syncs
(:class:`~focus_pretrain.bench.dispatch.DispatchCounter`; compiled, the step has none of the
host syncs and fewer launches), the kernels a compiled step ran on CUDA (the profiler), the
share of key blocks the Focus step visits (its block mask, per layer and row) and the largest
difference of its logits from the exact dense Focus step on the same tokens.
Layout: HF ``[b, heads, seq, d]`` caches.
"""

from __future__ import annotations

import copy
import inspect
import statistics

import torch
from transformers import DynamicCache, StaticCache

from focus_pretrain.bench.dispatch import DispatchCounter
from focus_pretrain.bench.report import elapsed_ms
from focus_pretrain.convert.hf_modeling.focus_cache import cache_kwargs
from focus_pretrain.convert.hf_modeling.focus_static import hard_keep
from focus_pretrain.convert.hf_modeling.focus_static_sparse import key_blocks


def _step_kwargs(model, cache, slots: torch.Tensor, batch: int) -> dict:
    """A forward writing cache ``slots [q]`` (no padding: positions are the slots)."""
    kwargs = dict(position_ids=slots[None].expand(batch, -1), use_cache=True)
    if "cache_position" in inspect.signature(model.forward).parameters:  # before 5.24
        kwargs["cache_position"] = slots
    return {**kwargs, **cache_kwargs(model, cache)}


def prefilled(model, prompt: torch.Tensor, length: int, copied: bool) -> StaticCache:
    """A ``StaticCache`` of ``length`` slots holding ``prompt [b, n]``: one forward into it, or
    (``copied``: the plain model, whose SDPA prefill would need a ``[b, 1, n, L]`` mask) a
    forward into a ``DynamicCache`` whose keys and values are then written into it through the
    cache API."""
    cache = StaticCache(config=model.config, max_cache_len=length)
    b, n = prompt.shape
    slots = torch.arange(n, device=prompt.device)
    with torch.no_grad():
        if not copied:
            model(prompt, **_step_kwargs(model, cache, slots, b))
            return cache
        dynamic = DynamicCache(config=model.config)
        model(prompt, use_cache=True, past_key_values=dynamic)
        for index, layer in enumerate(dynamic.layers):
            cache.update(layer.keys, layer.values, index, {"cache_position": slots})
    return cache


def _decode(model, cache, tokens: torch.Tensor, start: int, warmup: int, graphs: bool):
    """``(ms per timed step, logits per step)``: the compiled one-token step over ``tokens
    [steps, b]`` from slot ``start``."""

    def step(token, slot, cache):
        return model(token, **_step_kwargs(model, cache, slot, token.shape[0])).logits[:, -1]

    mode = "reduce-overhead" if graphs else None
    compiled = torch.compile(step, fullgraph=True, dynamic=False, mode=mode)
    device = tokens.device
    times, logits = [], []
    with torch.no_grad():
        for i, token in enumerate(tokens):
            slot = torch.tensor([start + i], device=device)
            out: list[torch.Tensor] = []

            def call(token=token, slot=slot, out=out) -> None:
                out.append(compiled(token[:, None], slot, cache))

            ms = elapsed_ms(call, device)
            logits.append(out[0].clone())
            if i >= warmup:
                times.append(ms)
    return times, logits, compiled


def _eager_counts(model, cache, token: torch.Tensor, slot: int) -> dict:
    """Launches and host syncs of one eager step (on a copy of the cache)."""
    slots = torch.tensor([slot], device=token.device)
    cache = copy.deepcopy(cache)
    with torch.no_grad(), DispatchCounter() as counter:
        model(token[:, None], **_step_kwargs(model, cache, slots, token.shape[0]))
    return {"launches": counter.launches, "host_syncs": counter.host_syncs}


def _cuda_kernels(compiled, cache, token: torch.Tensor, slot: int) -> int | None:
    """CUDA kernels one compiled step runs (the profiler), ``None`` off CUDA."""
    if token.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    slots = torch.tensor([slot], device=token.device)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        compiled(token[:, None], slots, cache)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def visited_block_share(model, cache, slot: int) -> float:
    """The share of key blocks a Focus step at ``slot`` visits, averaged over layers and rows
    (the routing of the token at ``slot``, as stored in the cache)."""
    window, shares = model.config.focus["window"], []
    for layer in cache.layers:
        if getattr(layer, "focus_members", None) is None:
            continue
        slots = torch.tensor([slot], device=layer.focus_members.device)
        members = layer.focus_members[:, slots]  # [b, 1]: a tail slot holds its own position
        mask = key_blocks(hard_keep(layer, slots, members, None, window=window))
        visited = mask.kv_num_blocks + mask.full_kv_num_blocks  # [b, 1, 1]
        shares.append(float(visited.float().mean()) / mask.kv_indices.shape[-1])
    return statistics.mean(shares)


def static_row(cfg, model, plain, prompt, tokens, exact_logits, graphs: bool) -> dict:
    """The static-cache figures of one context length (see the module docstring):
    ``exact_logits``: the dense Focus step's logits per token of ``tokens [steps, b]``."""
    n = prompt.shape[1]
    length = n + tokens.shape[0] + 1
    row = {"static_cuda_graphs": graphs}
    for name, runner in (("static_dense", plain), ("static_focus", model)):
        cache = prefilled(runner, prompt, length, copied=runner is plain)
        row[f"{name}_eager"] = _eager_counts(runner, cache, tokens[0], n)
        times, logits, compiled = _decode(runner, cache, tokens, n, cfg.warmup, graphs)
        row[f"{name}_ms"] = statistics.median(times)
        row[f"{name}_cuda_kernels"] = _cuda_kernels(compiled, cache, tokens[-1], length - 1)
        if runner is model:
            row["static_blocks_visited"] = visited_block_share(
                model, cache, n + tokens.shape[0] - 1
            )
            row["max_abs_diff_static_vs_dense"] = max(
                float((a.float() - b.float()).abs().max())
                for a, b in zip(logits, exact_logits, strict=True)
            )
        del cache
    row["static_speedup_vs_dense"] = row["static_dense_ms"] / row["static_focus_ms"]
    return row
