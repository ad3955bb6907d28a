"""How far two group assignments of the same tokens agree, whatever the groups' names: groups
of different layers (or runs) are not aligned, so the measures are permutation-invariant
(normalised mutual information, agreement after the best one-to-one matching of groups) and
:func:`align_layers` relabels a stack of layers to match one another.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import torch
from torch import Tensor

EXACT_MATCHING_MAX_GROUPS = 8  # brute force over K! permutations up to here, greedy above


def entropy(counts: np.ndarray) -> float:
    """Shannon entropy (nats) of a count vector."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def contingency(a: Tensor, b: Tensor, num_groups: int) -> np.ndarray:
    """``[K, K]`` counts of (group in ``a``, group in ``b``) over tokens; ``a``, ``b``: ``[N]``."""
    flat = a.to(torch.int64) * num_groups + b.to(torch.int64)  # [N]
    counts = torch.bincount(flat, minlength=num_groups * num_groups)
    return counts.reshape(num_groups, num_groups).numpy().astype(np.float64)  # [K, K]


def normalized_mutual_information(a: Tensor, b: Tensor, num_groups: int) -> float:
    """NMI ``2 I(a; b) / (H(a) + H(b))`` of two group assignments ``[N]``: 1 when one is a
    relabelling of the other, about 0 when independent; invariant to renaming groups. Two
    constant assignments (both collapsed) count as identical (1)."""
    table = contingency(a, b, num_groups)
    h_a, h_b = entropy(table.sum(axis=1)), entropy(table.sum(axis=0))
    if h_a + h_b == 0:
        return 1.0
    mutual = h_a + h_b - entropy(table.ravel())
    return float(max(0.0, 2 * mutual / (h_a + h_b)))


@functools.lru_cache(maxsize=8)
def _permutations(k: int) -> np.ndarray:
    return np.array(list(itertools.permutations(range(k))), dtype=np.int64)  # [K!, K]


def best_matching(table: np.ndarray) -> tuple[np.ndarray, bool]:
    """The one-to-one map of rows to columns with the largest total count.

    Args:
        table: ``[K, K]`` contingency counts (row: group of one layer, column: of another).

    Returns:
        ``(match [K], exact)``: row ``i`` maps to column ``match[i]``; ``exact`` is ``True``
        when it is the optimum (brute force over ``K!`` permutations, ``K <= 8``), ``False``
        for the greedy approximation used above that (largest remaining count first).
    """
    k = table.shape[0]
    if k <= EXACT_MATCHING_MAX_GROUPS:
        perms = _permutations(k)
        scores = table[np.arange(k), perms].sum(axis=1)  # [K!]
        return perms[int(np.argmax(scores))], True
    match = np.full(k, -1, dtype=np.int64)
    work = table.astype(np.float64).copy()
    for _ in range(k):
        i, j = np.unravel_index(int(np.argmax(work)), work.shape)
        match[i] = j
        work[i, :] = -1
        work[:, j] = -1
    return match, False


def matched_agreement(a: Tensor, b: Tensor, num_groups: int) -> float:
    """Fraction of tokens whose group in ``a`` maps to their group in ``b`` under the best
    one-to-one matching of groups (1 for identical-up-to-renaming assignments)."""
    table = contingency(a, b, num_groups)
    match, _ = best_matching(table)
    return float(table[np.arange(num_groups), match].sum() / max(table.sum(), 1))


def align_layers(groups: Tensor, num_groups: int) -> tuple[Tensor, bool]:
    """Relabel each layer's groups to best match the previous (relabelled) layer.

    Args:
        groups: ``[L, N]`` top-1 groups of the same ``N`` tokens in ``L`` layers.

    Returns:
        ``([L, N] relabelled groups, exact)``: layer 0 unchanged; ``exact`` as in
        :func:`best_matching` (``False`` if any matching was greedy).
    """
    aligned = [groups[0].to(torch.int64)]
    exact = True
    for layer in groups[1:]:
        layer = layer.to(torch.int64)
        table = contingency(layer, aligned[-1], num_groups)  # [K this layer, K previous]
        match, was_exact = best_matching(table)
        exact &= was_exact
        aligned.append(torch.as_tensor(match)[layer])
    return torch.stack(aligned), exact  # [L, N]
