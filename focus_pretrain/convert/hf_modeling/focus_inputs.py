"""What a Focus model's hooks read from a forward's inputs (shipped inside the exported
directory; standalone: imports only torch and transformers): the KV cache and the router's input
of each attention module, the packed documents of the batch, and the padding of a mask.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn
from transformers import Cache


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
