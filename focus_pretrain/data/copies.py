"""Long-range copies in training samples (``data.copy_spans``).

A pretrained model's loss on ordinary text depends little on keys far back, so a retrofit's
routers trained on it learn little about keeping them, and a needle test (RULER) finds what
the loss did not measure: the hard pattern loses the needle. A copy of an earlier span makes
the far keys necessary: after the copy's first token, each next token is the source's next
token, which the model finds by attending to the source (its induction heads do). Training
samples end with ``spans`` copies; their sources are drawn from the sample's own text at
least ``min_distance`` tokens before each copy begins.

Layout of a sample's token stream ``[s + 1]`` (its ``tokens`` are ``stream[:s]``, its
``labels`` ``stream[1:]``)::

    | first | text ............................................ | copy 0 | copy 1 | ...
    0       lo                                                  R        R + L

``R = s + 1 - spans * L``; copy ``i`` begins at ``b_i = R + i * L``; its source begins at a
``a_i`` drawn uniformly from ``[lo, min(R - L, b_i - L - min_distance)]``, so every source is
text (never a copy) and ends ``min_distance`` or more tokens before its copy begins.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def copy_room(spans: int, span_tokens: int, min_distance: int) -> int:
    """Stream tokens the copies need after the sample's first: the copies, and before the
    first copy one span of text at ``min_distance``."""
    return spans * span_tokens + span_tokens + min_distance


def copy_room_refusal(
    seq_length: int, spans: int, span_tokens: int, min_distance: int, kept: int = 1
) -> str | None:
    """Why ``spans`` copies (``data.copy_*``) do not fit ``seq_length``-token samples whose
    first ``kept`` tokens (the first, or a longer BOS prefix) are never copied, or ``None``."""
    need = copy_room(spans, span_tokens, min_distance) + max(1, kept) - 1
    if need <= seq_length:
        return None
    prefix = f" after a {kept}-token sample prefix (data.bos_every_sample)" if kept > 1 else ""
    return (
        f"data.copy_spans={spans} of data.copy_span_tokens={span_tokens} at "
        f"data.copy_min_distance={min_distance} need samples of at least {need} tokens"
        f"{prefix}, data.seq_length is {seq_length}; use fewer or shorter spans, a shorter "
        "distance, or longer samples"
    )


def copy_layout(
    stream_tokens: int,
    spans: int,
    span_tokens: int,
    min_distance: int,
    rng: np.random.Generator,
    lo: int = 1,
) -> list[tuple[int, int]]:
    """``[(source start, copy start)]``, one per span, for a stream of ``stream_tokens``
    tokens whose positions before ``lo`` are never copied (the module docstring's layout).

    Raises:
        ValueError: the stream is too short for the copies.
    """
    start = stream_tokens - spans * span_tokens  # R: where the copies begin
    if lo + copy_room(spans, span_tokens, min_distance) > stream_tokens:
        raise ValueError(
            f"{spans} copies of {span_tokens} tokens at distance {min_distance} do not fit "
            f"a sample of {stream_tokens - 1} tokens whose first {lo} are kept; use fewer or "
            "shorter data.copy_spans, a shorter data.copy_min_distance, or longer samples"
        )
    layout = []
    for i in range(spans):
        copy = start + i * span_tokens
        last = min(start - span_tokens, copy - span_tokens - min_distance)
        layout.append((int(rng.integers(lo, last + 1)), copy))
    return layout


def long_range_copies(
    sample: dict[str, Tensor],
    spans: int,
    span_tokens: int,
    min_distance: int,
    rng: np.random.Generator,
    keep_first: int = 1,
) -> dict[str, Tensor]:
    """``sample`` (``tokens``, ``labels``, ``loss_mask``, each ``[s]``) whose stream ends with
    ``spans`` copies of earlier spans drawn by :func:`copy_layout` (the module docstring),
    the first ``keep_first`` stream tokens (a BOS prefix) never copied; a new dict."""
    s = sample["tokens"].shape[-1]
    layout = copy_layout(s + 1, spans, span_tokens, min_distance, rng, max(1, keep_first))
    return with_copies(sample, layout, span_tokens)


def with_copies(
    sample: dict[str, Tensor], layout: list[tuple[int, int]], span_tokens: int
) -> dict[str, Tensor]:
    """``sample`` with the copies of ``layout`` (``[(source start, copy start)]`` in stream
    positions, :func:`copy_layout`'s) written into its stream; a new dict. Each copied token
    keeps its source's loss weight (padding stays unweighted); other fields are kept
    (positions do not change)."""
    tokens, labels = sample["tokens"], sample["labels"]
    s = tokens.shape[-1]
    stream = torch.cat([tokens[:1], labels])  # [s + 1]
    weights = torch.cat([torch.ones(1), sample["loss_mask"].float()])  # [s + 1]: of stream[i]
    for a, b in layout:  # a source is text before the copies: never written here
        stream[b : b + span_tokens] = stream[a : a + span_tokens]
        weights[b : b + span_tokens] = weights[a : a + span_tokens]
    out = dict(sample)
    out.update(tokens=stream[:s], labels=stream[1:], loss_mask=weights[1:])
    return out


def copied_labels(
    seq_length: int, spans: int, span_tokens: int, with_first: bool = False
) -> Tensor:
    """``[seq_length]`` bool: the label positions of a sample with copies whose target is a
    copied token other than a copy's first (which nothing predicts): what a model keeps of
    the copies is its loss there. ``with_first``: each copy's first token's label too (every
    label whose target is copied)."""
    start = seq_length + 1 - spans * span_tokens  # R of the layout
    label = torch.zeros(seq_length, dtype=torch.bool)
    for i in range(spans):
        first = start + i * span_tokens  # stream position of copy i's first token
        label[first - int(with_first) : first + span_tokens - 1] = True  # label j: stream[j + 1]
    return label
