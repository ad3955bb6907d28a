"""How many (query, key) pairs the hard pattern keeps, counted on the device with no host sync.

Sparse training (``focus.training_mode: hard``) computes only the hard pattern's pairs, so its
FLOPs and MFU count those pairs (:func:`kept_pairs`), per layer and micro-batch, accumulated on
the device and read once per log interval. :func:`~focus_pretrain.focus.pattern.
count_allowed_pairs` counts the same thing by distinct membership (host reads; the check here).

A query ``i`` of a document starting at ``d_i`` keeps (:mod:`focus_pretrain.focus.pattern`):

* the local keys ``j`` in ``[max(d_i, i - w), i]``: ``min(i - d_i, w) + 1``;
* the sinks beyond the window, ``j`` in ``[d_i, min(d_i + S, i - w))``;
* the keys beyond the window and the sinks, ``j`` in ``[d_i + S, i - w - 1]``, whose top-k
  group set meets the query's. By inclusion-exclusion over the non-empty subsets ``T`` of the
  query's set: ``sum_T (-1)^(|T|+1) #{j in range : T is a subset of S_j}``; each ``#{...}`` is a
  range count of the entries ``(T, j)`` (every ``|T|``-subset of every token's set) found by
  binary search in the entries sorted by (subset, position). ``2^k - 1`` subsets per token:
  ``O(2^k n log n)`` time and ``O(2^k n)`` memory per sample.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor


def kept_pairs(
    top_groups: Tensor, window: int, sinks: int = 0, documents: Tensor | None = None
) -> Tensor:
    """``[b]`` int64: pairs the hard pattern keeps per sample (local, sinks, sharing a group).

    Args:
        top_groups: ``[b, n, k]`` each token's top-k group indices (distinct per token).
        window: the local window ``w >= 0``; sinks: ``S >= 0``.
        documents: ``[b, n]`` int64 document starts (``None``: one document per sample).
    """
    b, n, k = top_groups.shape
    device = top_groups.device
    pos = torch.arange(n, device=device).expand(b, n)  # [b, n]
    start = torch.zeros_like(pos) if documents is None else documents.to(torch.int64)
    local = torch.clamp(pos - start, max=window) + 1  # [b, n]
    beyond = pos - window  # keys j < beyond are beyond the window
    sink_end = torch.minimum(start + sinks, beyond)
    sink = torch.clamp(sink_end - start, min=0)  # [b, n] sinks beyond the window
    lo, hi = start + sinks, beyond - 1  # [b, n] the routed keys' range
    shared = torch.zeros(b, n, dtype=torch.int64, device=device)
    for size in range(1, k + 1):
        sign = 1 if size % 2 else -1
        for row in range(b):
            shared[row] += sign * _subset_counts(top_groups[row], size, lo[row], hi[row])
    return (local + sink + shared).sum(dim=1)


def _subset_counts(groups: Tensor, size: int, lo: Tensor, hi: Tensor) -> Tensor:
    """``[n]``: for each token ``i``, the sum over its ``size``-subsets ``T`` of the number of
    tokens ``j`` in ``[lo_i, hi_i]`` whose group set contains ``T`` (``groups [n, k]``)."""
    n, k = groups.shape
    combos = list(itertools.combinations(range(k), size))
    ones = torch.ones((), dtype=torch.int64, device=groups.device)
    masks = torch.stack(
        [sum(ones << groups[:, c].to(torch.int64) for c in combo) for combo in combos], dim=1
    )  # [n, C] each token's subsets as bitmasks
    flat = masks.reshape(-1)  # [n * C] entries, token-major
    sorted_masks, order = torch.sort(flat, stable=True)
    new = torch.ones_like(sorted_masks, dtype=torch.bool)
    new[1:] = sorted_masks[1:] != sorted_masks[:-1]
    dense = torch.empty_like(flat)
    dense[order] = torch.cumsum(new, dim=0) - 1  # [n * C] a dense id per distinct subset
    positions = torch.arange(n, device=groups.device).repeat_interleave(len(combos))  # [n * C]
    keys, _ = torch.sort(dense * (n + 1) + positions)  # entries by (subset, position)
    lo_c, hi_c = (t.repeat_interleave(len(combos)) for t in (lo, hi))  # [n * C]
    base = dense * (n + 1)
    upper = torch.searchsorted(keys, base + hi_c.clamp(min=-1), right=True)
    lower = torch.searchsorted(keys, base + lo_c.clamp(min=0), right=False)
    counts = torch.where(hi_c >= lo_c, upper - lower, torch.zeros_like(upper))  # [n * C]
    return counts.reshape(n, len(combos)).sum(dim=1)  # [n]
