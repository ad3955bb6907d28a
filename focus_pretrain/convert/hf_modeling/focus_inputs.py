"""What a Focus model's hooks read from a forward's inputs (shipped inside the exported
directory; standalone: imports only torch and transformers): the KV cache and the router's input
of each attention module, the packed documents of the batch, the padding of a mask, the mask
the ``"focus"`` attention asks transformers for, and each layer's sink keys.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn
from transformers import Cache
from transformers.masking_utils import causal_mask_function, sdpa_mask


def passed_cache(args: tuple, kwargs: dict) -> Cache | None:
    """The KV cache among a module call's arguments, or ``None``: the one that is a
    ``transformers.Cache``, whatever its keyword (``past_key_values`` up to transformers 5.23,
    ``cache`` from 5.24) or position."""
    for value in (*kwargs.values(), *args):
        if isinstance(value, Cache):
            return value
    return None


def capture_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: the attention module's cache and, for a Focus layer, its input (what
    the router reads)."""
    if getattr(module, "router", None) is not None:
        module._focus_hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    module._focus_cache = passed_cache(args, kwargs)
    module._focus_cache_position = kwargs.get("cache_position")  # static caches before 5.x


class Documents:
    """The packed documents of the running forward, shared by a model's attention modules."""

    starts: Tensor | None = None  # [b, s] document starts, or None (one document per row)


def packed_documents(
    position_ids: Tensor | None, attention_mask: Tensor | None, b: int, s: int
) -> Tensor | None:
    """Document starts ``[b, s]`` (the position of each token's document's first token in the
    row) of a packed batch, or ``None`` (one document per row).

    A token starts a new document when its position id is not the previous token's + 1 (how
    transformers finds packed sequences). Only with ``attention_mask`` ``None`` or all ones; a
    4-D mask is the caller's own.

    Raises:
        ValueError: position ids restart among the real tokens of a padded row (the padding's
            own positions are ignored: left-padded generation restarts there), or their count
            is not the number of tokens.
    """
    if attention_mask is not None and not (
        isinstance(attention_mask, Tensor) and attention_mask.dim() == 2
    ):  # a 4-D mask, or a mapping of them (precomputed for a static cache), is the caller's own
        return None
    if position_ids is None or s < 2:
        return None
    if position_ids.shape[-1] != s:  # generate(use_cache=False) before transformers 5.2
        raise ValueError(
            f"position_ids give {position_ids.shape[-1]} positions for {s} tokens: pass one "
            "per token (generate before transformers 5.2 does not extend position_ids without "
            "a KV cache: upgrade transformers, generate with the cache, or without position_ids)"
        )
    pos = position_ids.reshape(-1, position_ids.shape[-1]).expand(b, s)  # [s]|[1, s] -> [b, s]
    new = torch.ones(b, s, dtype=torch.bool, device=pos.device)
    new[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1  # [b, s]
    if not bool(new[:, 1:].any()):
        return None
    if attention_mask is not None and not bool(attention_mask[:, -s:].all()):
        real = attention_mask[:, -s:].bool()  # [b, s]: the new tokens' real ones
        for r in range(b):
            if bool((pos[r][real[r]].diff() != 1).any()):
                raise ValueError(
                    "position_ids restart inside the real tokens of a padded row: packed "
                    "documents with padding are not supported; pass packed rows with "
                    "attention_mask=None (or all ones), or each document as its own padded row"
                )
        return None
    index = torch.arange(s, device=pos.device).expand(b, s)  # [b, s]
    return torch.where(new, index, 0).cummax(dim=1).values


def capture_documents(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of the base model: the packed documents of this forward."""
    bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    inputs = bound.get("input_ids")
    inputs = bound.get("inputs_embeds") if inputs is None else inputs
    if inputs is None:
        model.focus_documents.starts = None
        return
    b, s = inputs.shape[:2]
    starts = packed_documents(bound.get("position_ids"), bound.get("attention_mask"), b, s)
    model.focus_documents.starts = starts


def real_spans(allowed: Tensor | None, b: int, s: int, sliding_window: int | None):
    """``"all"`` (no padding), per-row ``(start, end)`` of the real tokens when they are
    contiguous (left or right padding), or ``None`` (another mask: packed sequences)."""
    if allowed is None:
        return "all"
    valid = allowed.any(dim=1)  # [b, s]
    causal = torch.ones(s, s, dtype=torch.bool, device=allowed.device).tril()
    if sliding_window is not None:  # the mask of a sliding-window layer has the window too
        causal = causal.triu(-(sliding_window - 1))
    spans = []
    for r in range(b):
        real = torch.nonzero(valid[r]).flatten()
        start, end = (int(real[0]), int(real[-1]) + 1) if real.numel() else (0, 0)
        expected = causal & valid[r][None]  # HF's mask of a padded causal sequence
        if end - start != real.numel() or not torch.equal(allowed[r], expected):
            return None
        spans.append((start, end))
    return "all" if all(sp == (0, s) for sp in spans) else spans


def sinks_of(module: nn.Module) -> int:
    """Attention sinks of a Focus layer (or a window-only twin's); 0 for a family's own
    sliding-window layers and without Focus."""
    router = getattr(module, "router", None)
    if router is not None:
        return int(router.focus.get("sinks", 0))
    if getattr(module, "focus_window", None) is None:
        return 0
    return int(getattr(module.config, "focus", {}).get("sinks", 0))


def sink_keys(
    module, routing, allowed: Tensor | None, b: int, kv_len: int, device, docs: Tensor | None = None
) -> Tensor | None:
    """``[b, kv]`` bool: the layer's sink keys, the first ``sinks`` real keys of each row (real:
    the cached routing's ``valid``, else a key some query of HF's mask attends) or, given
    document starts ``docs [b, kv]`` (packed, no padding), of each document; ``None`` without
    sinks."""
    sinks = sinks_of(module)
    if not sinks:
        return None
    if docs is not None:
        return torch.arange(kv_len, device=device)[None] - docs < sinks  # [b, kv]
    valid = routing[2] if routing is not None else None  # [b, kv]
    if valid is None and allowed is not None:
        valid = allowed.any(dim=1)  # a real key is attended by some query (its own, or later)
    if valid is None:  # no padding
        return (torch.arange(kv_len, device=device) < sinks)[None].expand(b, kv_len)
    before = valid.long().cumsum(dim=1) - 1  # [b, kv]: real tokens before each key
    return valid & (before < sinks)


def focus_mask(*args, **kwargs) -> Tensor | None:
    """The ``"focus"`` attention's mask: transformers' boolean SDPA mask (padding, packed
    sequences, windows), or ``None`` where it would only say "causal, no padding": the Focus
    layers take causality from the positions. SDPA's own rule returns ``None`` there only when
    the keys are the queries, for one query and (5.24) a static cache's first prefill; a
    static cache's later chunks (and, with 5.0, its prefill) would get a ``[b, 1, q, L]`` mask
    (4 GB a row at 64K tokens). Eager steps of several queries only (reading the padding is a
    host sync, as in transformers' own check): a one-token step and a compiled one get
    transformers' mask."""
    padding = kwargs.get("attention_mask")
    plain = kwargs.get("mask_function") is causal_mask_function and not kwargs.get("local_size")
    positions = kwargs.get("cache_position")  # transformers 5.0; later releases: q_length
    queries = kwargs.get("q_length") or (positions.numel() if positions is not None else 1)
    prefill = plain and queries > 1 and not torch.compiler.is_compiling()  # eager
    if prefill and (padding is None or (padding.dim() == 2 and bool(padding.all()))):
        return None
    return sdpa_mask(*args, **kwargs)
