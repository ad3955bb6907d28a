"""What trained Focus routers do, as numbers: plain functions over routing tensors.

Inputs are what a model's routers produce: per Focus layer, soft group assignments
``[b, s, K]`` (rows sum to 1), plus the token ids ``[b, s]`` they were computed on. The hard
pattern is each token's ``top_k`` groups (:meth:`focus_pretrain.focus.Routing.membership`), as at
inference. :class:`GroupStats` accumulates batches (of any lengths) and :meth:`GroupStats.result`
returns every number of the report as plain JSON-able values:

* group shares per layer (top-1 and soft);
* the kept-pair fraction of the trained pattern (:func:`focus_pretrain.focus.pattern_density`,
  exact) next to the same pattern under uniform random routing at the same lengths;
* the distance profile: of the causal pairs ``(i, j)`` at distance ``i - j`` beyond the window,
  the fraction the pattern keeps, over log2-spaced bins (random balanced routing keeps
  :func:`random_pair_share` at every distance, ``1/K`` for top-1);
* the tokens most typical of each group;
* cross-layer stability: groups of different layers are not aligned, so permutation-invariant
  measures (normalised mutual information, agreement after the best one-to-one matching of
  groups) and, per token id, how often it keeps its (matched) group from one layer to the next.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from focus_pretrain.analysis.agreement import (
    EXACT_MATCHING_MAX_GROUPS,
    align_layers,
    matched_agreement,
    normalized_mutual_information,
)
from focus_pretrain.focus import Routing, pattern_density
from focus_pretrain.focus.pattern import key_side_memberships


def top1_groups(probs: Tensor) -> Tensor:
    """``[b, s, K]`` assignments -> ``[b, s]`` int64 most probable group per token."""
    return probs.detach().argmax(dim=-1)


def random_pair_share(num_groups: int, top_k: int) -> float:
    """Probability that two tokens with independent uniform random ``top_k``-of-``K`` group
    sets share a group: ``1 - C(K - k, k) / C(K, k)`` (``1/K`` for top-1). The kept fraction
    beyond the window of balanced random routing, at every distance."""
    return 1.0 - math.comb(num_groups - top_k, top_k) / math.comb(num_groups, top_k)


def random_density(
    lengths: Sequence[int],
    num_groups: int,
    top_k: int,
    window: int,
    seed: int = 0,
    sinks: int = 0,
    key_groups: str = "own",
) -> list[float]:
    """Kept-pair fraction of the hard pattern under uniform random routing, one sample per
    length (as ``tools/pattern_density.py`` computes it: top-k of uniform scores), with the
    keys' groups of ``key_groups``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        scores = torch.rand(1, n, num_groups, generator=gen)  # [1, n, K] uniform: balanced
        member = Routing(scores).membership(top_k)  # [1, n]
        keys = key_side_memberships(member, key_groups)
        out.append(float(pattern_density(member, window, sinks, key_member=keys)[0]))
    return out


def kept_pairs_by_distance(member: Tensor, window: int, key_member: Tensor | None = None) -> Tensor:
    """Pairs the hard pattern keeps at each distance, summed over the batch.

    Args:
        member: ``[b, n]`` int64 membership bitmasks (the queries', and the keys' unless
            ``key_member`` ``[b, n]`` gives theirs).
        window: the local window ``w >= 0`` (every causal pair with ``i - j <= w`` is kept).

    Returns:
        ``[n]`` int64: entry ``d`` counts the kept pairs ``(i, i - d)``; the sum over ``d`` is
        :func:`focus_pretrain.focus.count_allowed_pairs` summed over the batch. Exact, in
        ``O(M n log n)`` per sample for ``M`` distinct bitmasks (FFT cross-correlation).
    """
    b, n = member.shape
    distance = torch.arange(n)
    kept = torch.zeros(n, dtype=torch.float64)
    size = 1 << max(2 * n - 1, 1).bit_length()  # FFT length >= 2n: no circular wrap
    keys = member if key_member is None else key_member
    for row, key_row in zip(member.cpu(), keys.cpu(), strict=True):
        values, inverse = torch.unique(torch.cat([row, key_row]), return_inverse=True)  # [M]
        onehot = F.one_hot(inverse, values.numel()).double().t()  # [M, 2n]
        x, x_keys = onehot[:, :n], onehot[:, n:]  # [M, n]: query / key has bitmask u
        compatible = ((values[:, None] & values[None, :]) != 0).double()  # [M, M]
        y = compatible @ x_keys  # [M, n]: key shares a group with bitmask u
        fx, fy = torch.fft.rfft(x, size), torch.fft.rfft(y, size)  # [M, size // 2 + 1]
        # sum_i x_u[i] y_u[i - d] for d = 0 .. n - 1
        kept += torch.fft.irfft(fx * fy.conj(), size)[:, :n].sum(dim=0)
    kept = kept.round().to(torch.int64)
    causal = (n - distance) * b  # [n]: pairs at distance d in b samples of length n
    return torch.where(distance <= window, causal, kept)


def distance_bins(window: int, max_distance: int) -> list[tuple[int, int]]:
    """Log2-spaced bins ``[lo, hi]`` (inclusive) covering the distances ``window + 1 ..
    max_distance`` beyond the window: ``[w + 1, 2^a - 1], [2^a, 2^(a + 1) - 1], ...``."""
    bins = []
    lo = window + 1
    while lo <= max_distance:
        hi = min((1 << lo.bit_length()) - 1, max_distance)
        bins.append((lo, hi))
        lo = hi + 1
    return bins


def typical_tokens(
    ids: Tensor,
    groups: Tensor,
    num_groups: int,
    *,
    min_count: int = 5,
    top_n: int = 8,
    decode: Callable[[int], str] | None = None,
) -> list[list[dict]]:
    """The tokens most typical of each group.

    A token id qualifies with at least ``min_count`` occurrences; in group ``k`` it is ranked by
    the share of its occurrences routed to ``k`` (ties: more occurrences first), and listed only
    when that share exceeds group ``k``'s overall share (``lift > 1``).

    Args:
        ids, groups: ``[N]`` token ids and their top-1 groups in one layer.

    Returns:
        Per group, up to ``top_n`` dicts: ``id``, ``text`` (``decode(id)`` or ``None``),
        ``count`` (occurrences), ``share`` (of them in this group), ``lift`` (share over the
        group's overall share).
    """
    unique, inverse = torch.unique(ids.to(torch.int64), return_inverse=True)  # [U], [N]
    flat = inverse * num_groups + groups.to(torch.int64)  # [N]
    counts = torch.bincount(flat, minlength=unique.numel() * num_groups).double()
    counts = counts.reshape(unique.numel(), num_groups)  # [U, K]
    totals = counts.sum(dim=1)  # [U]
    base = counts.sum(dim=0) / max(float(totals.sum()), 1.0)  # [K] group shares
    share = counts / totals.clamp(min=1)[:, None]  # [U, K]
    out = []
    for k in range(num_groups):
        lift = share[:, k] / base[k] if base[k] > 0 else torch.zeros_like(share[:, k])
        keep = torch.nonzero((totals >= min_count) & (lift > 1)).flatten()
        order = sorted(keep.tolist(), key=lambda u: (-float(share[u, k]), -float(totals[u])))
        out.append(
            [
                {
                    "id": int(unique[u]),
                    "text": None if decode is None else decode(int(unique[u])),
                    "count": int(totals[u]),
                    "share": float(share[u, k]),
                    "lift": float(lift[u]),
                }
                for u in order[:top_n]
            ]
        )
    return out


def token_stability(
    ids: Tensor,
    aligned: Tensor,
    *,
    min_count: int = 5,
    top_n: int = 8,
    decode: Callable[[int], str] | None = None,
) -> dict:
    """How often a token keeps its (matched) group from one layer to the next.

    Args:
        ids: ``[N]`` token ids.
        aligned: ``[L, N]`` groups relabelled by :func:`align_layers` (``L >= 2``).

    Returns:
        ``keep_rate`` (mean over tokens and the ``L - 1`` transitions), ``most_stable`` and
        ``least_stable`` token ids (at least ``min_count`` occurrences; dicts with ``id``,
        ``text``, ``count``, ``keep_rate``).
    """
    keeps = (aligned[1:] == aligned[:-1]).double().mean(dim=0)  # [N]
    unique, inverse = torch.unique(ids.to(torch.int64), return_inverse=True)  # [U], [N]
    counts = torch.bincount(inverse, minlength=unique.numel()).double()  # [U]
    per_id = torch.bincount(inverse, weights=keeps, minlength=unique.numel()) / counts  # [U]
    qualified = torch.nonzero(counts >= min_count).flatten().tolist()

    def row(u: int) -> dict:
        token = int(unique[u])
        text = None if decode is None else decode(token)
        return {"id": token, "text": text, "count": int(counts[u]), "keep_rate": float(per_id[u])}

    ranked = sorted(qualified, key=lambda u: (-float(per_id[u]), -float(counts[u])))
    most = ranked[: min(top_n, (len(ranked) + 1) // 2)]  # the two lists never overlap
    least = ranked[len(most) :][::-1][:top_n]
    return {
        "keep_rate": float(keeps.mean()) if keeps.numel() else None,
        "most_stable": [row(u) for u in most],
        "least_stable": [row(u) for u in least],
    }


class GroupStats:
    """Accumulates routed batches of one model and computes the report's numbers.

    Args:
        num_groups: ``K``.
        window: the local window ``w`` of the hard pattern.
        top_k: groups per token in the hard pattern.
        layers: the model's layer index of each Focus layer, in order (the order of the
            ``probs`` passed to :meth:`add`).
        seed: seed of the random-routing reference.
        sinks: attention sinks of the pattern (always-visible first positions): counted in
            the density, not in the distance profile (which is about sharing a group).
        key_groups: the groups a key counts as in (``focus.key_groups``): density and the
            distance profile count the keys' groups of that rule.
    """

    def __init__(
        self,
        num_groups: int,
        window: int,
        top_k: int,
        layers: Sequence[int],
        *,
        seed: int = 0,
        sinks: int = 0,
        key_groups: str = "own",
    ) -> None:
        if not 1 <= top_k <= num_groups:
            raise ValueError(f"top_k must be in [1, num_groups={num_groups}], got {top_k}")
        if not layers:
            raise ValueError("layers is empty: the model has no Focus layer with a router")
        self.num_groups, self.window, self.top_k = num_groups, window, top_k
        self.layers, self.seed, self.sinks = list(layers), seed, sinks
        self.key_groups = key_groups
        self._groups: list[list[Tensor]] = [[] for _ in self.layers]  # per layer: [b * s] each
        self._soft = torch.zeros(len(self.layers), num_groups, dtype=torch.float64)  # [L, K]
        self._density: list[list[float]] = [[] for _ in self.layers]  # per layer, per sample
        self._kept = torch.zeros(len(self.layers), 0, dtype=torch.int64)  # [L, max distance + 1]
        self._members: list[dict[int, int]] = [{} for _ in self.layers]  # bitmask -> tokens
        self._causal = torch.zeros(0, dtype=torch.int64)  # [max distance + 1]
        self._ids: list[Tensor] = []
        self.lengths: list[int] = []
        self.sample: dict | None = None  # the first sample: ids [s], top-1 groups [L, s]

    def add(self, probs: Sequence[Tensor], tokens: Tensor) -> None:
        """One batch: ``probs`` per Focus layer ``[b, s, K]`` and the token ids ``[b, s]``."""
        if len(probs) != len(self.layers):
            raise ValueError(f"got routing of {len(probs)} layers, expected {len(self.layers)}")
        b, s = tokens.shape
        for p in probs:
            if tuple(p.shape) != (b, s, self.num_groups):
                raise ValueError(
                    f"probs must be [b={b}, s={s}, K={self.num_groups}], got {tuple(p.shape)}"
                )
        self._grow(s)
        self._causal[:s] += b * (s - torch.arange(s))  # causal pairs at each distance
        top1 = []
        for layer, p in enumerate(probs):
            p = p.detach().cpu()  # [b, s, K]
            groups = top1_groups(p)  # [b, s]
            top1.append(groups)
            self._groups[layer].append(groups.flatten().to(torch.int16))  # [b * s]
            self._soft[layer] += p.double().sum(dim=(0, 1))
            member = Routing(p).membership(self.top_k)  # [b, s] int64 bitmasks
            keys = key_side_memberships(member, self.key_groups)  # [b, s], or None: their own
            density = pattern_density(member, self.window, self.sinks, key_member=keys)
            self._density[layer] += density.tolist()
            self._kept[layer, :s] += kept_pairs_by_distance(member, self.window, keys)
            values, counts = torch.unique(member, return_counts=True)
            for value, count in zip(values.tolist(), counts.tolist(), strict=True):
                self._members[layer][value] = self._members[layer].get(value, 0) + count
        tokens = tokens.detach().cpu().to(torch.int64)
        self._ids.append(tokens.flatten())  # [b * s]
        self.lengths += [s] * b
        if self.sample is None:
            self.sample = {"ids": tokens[0], "groups": torch.stack([g[0] for g in top1])}

    def _grow(self, s: int) -> None:
        extra = s - self._causal.numel()
        if extra > 0:
            self._causal = torch.cat([self._causal, torch.zeros(extra, dtype=torch.int64)])
            pad = torch.zeros(len(self.layers), extra, dtype=torch.int64)
            self._kept = torch.cat([self._kept, pad], dim=1)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def groups(self) -> Tensor:
        """``[L, N]`` top-1 group of every token seen, per Focus layer."""
        return torch.stack([torch.cat(g).to(torch.int64) for g in self._groups])

    def ids(self) -> Tensor:
        """``[N]`` the token ids, in the order of :meth:`groups`."""
        return torch.cat(self._ids)

    def result(
        self,
        *,
        decode: Callable[[int], str] | None = None,
        min_count: int = 5,
        top_n: int = 8,
        sample_tokens: int = 1024,
    ) -> dict:
        """Every number of the report (JSON-able); ``decode(id)`` names tokens when given;
        ``sample`` holds the first ``sample_tokens`` tokens of the first sample."""
        if not self.lengths:
            raise ValueError("no routing was added: nothing to report")
        k, groups, ids = self.num_groups, self.groups(), self.ids()  # [L, N], [N]
        random = random_density(
            self.lengths, k, self.top_k, self.window, self.seed, self.sinks, self.key_groups
        )
        bins = distance_bins(self.window, self._causal.numel() - 1)
        layers = []
        for index, layer in enumerate(self.layers):
            counts = torch.bincount(groups[index], minlength=k).double()  # [K]
            shares = counts / counts.sum()
            density = float(np.mean(self._density[index]))
            layers.append(
                {
                    "layer": layer,
                    "shares": shares.tolist(),
                    "soft_shares": (self._soft[index] / self.num_tokens).tolist(),
                    "max_share": float(shares.max()),
                    "density": density,
                    "density_per_sample": self._density[index],
                    "ideal_speedup": 1 / density,
                    "distance": self._profile(index, bins),
                    "typical_tokens": typical_tokens(
                        ids, groups[index], k, min_count=min_count, top_n=top_n, decode=decode
                    ),
                }
            )
        return {
            "settings": {
                "num_groups": k,
                "top_k": self.top_k,
                "window": self.window,
                "sinks": self.sinks,
                "key_groups": self.key_groups,
                "layers": self.layers,
                "random_seed": self.seed,
                "min_count": min_count,
            },
            "samples": len(self.lengths),
            "tokens": self.num_tokens,
            "lengths": sorted(set(self.lengths)),
            "random": {
                "density": float(np.mean(random)),
                "density_per_sample": random,
                "pair_share": random_pair_share(k, self.top_k),
            },
            "layers": layers,
            "distance_bins": [list(b) for b in bins],
            "stability": self._stability(ids, groups, decode, min_count, top_n),
            "sample": self._sample(decode, sample_tokens),
        }

    def _profile(self, index: int, bins: list[tuple[int, int]]) -> dict:
        """Kept fraction of the causal pairs beyond the window, per distance bin."""
        kept, causal = self._kept[index], self._causal
        fractions, pairs = [], []
        for lo, hi in bins:
            total = int(causal[lo : hi + 1].sum())
            pairs.append(total)
            fractions.append(float(kept[lo : hi + 1].sum()) / total if total else None)
        beyond = int(causal[self.window + 1 :].sum())
        kept_beyond = int(kept[self.window + 1 :].sum())
        return {
            "kept_fraction": fractions,
            "pairs": pairs,
            "kept_fraction_beyond_window": kept_beyond / beyond if beyond else None,
            "independent_pair_share": self._independent_share(index),
        }

    def _independent_share(self, index: int) -> float:
        """Probability that two tokens drawn independently from this layer's routing (its
        own group shares, positions ignored) share a group: the distance profile's level if
        groups had no structure in position (``sum_k p_k^2`` for top-1; ``1/K`` balanced)."""
        members = self._members[index]
        values = torch.tensor(list(members))  # [M] bitmasks
        p = torch.tensor(list(members.values()), dtype=torch.float64)
        p = p / p.sum()  # [M]
        compatible = (values[:, None] & values[None, :]) != 0  # [M, M]
        return float((p[:, None] * p[None, :])[compatible].sum())

    def _stability(
        self,
        ids: Tensor,
        groups: Tensor,
        decode: Callable[[int], str] | None,
        min_count: int,
        top_n: int,
    ) -> dict:
        """NMI and matched agreement between every two layers, and per-token stability."""
        n_layers, k = groups.shape[0], self.num_groups
        nmi = [[1.0] * n_layers for _ in range(n_layers)]
        agreement = [[1.0] * n_layers for _ in range(n_layers)]
        for a, b in itertools.combinations(range(n_layers), 2):
            nmi[a][b] = nmi[b][a] = normalized_mutual_information(groups[a], groups[b], k)
            agreement[a][b] = agreement[b][a] = matched_agreement(groups[a], groups[b], k)
        out = {
            "nmi": nmi,
            "matched_agreement": agreement,
            "matching": "exact" if k <= EXACT_MATCHING_MAX_GROUPS else "greedy",
            "tokens": None,
        }
        if n_layers > 1:
            aligned, _ = align_layers(groups, k)  # [L, N]
            out["tokens"] = token_stability(
                ids, aligned, min_count=min_count, top_n=top_n, decode=decode
            )
            shares = torch.stack([torch.bincount(g, minlength=k) for g in aligned]).double()
            shares = shares / shares.sum(dim=1, keepdim=True)  # [L, K] aligned shares
            # chance of keeping the matched group if layers were independent
            out["tokens"]["chance"] = float((shares[1:] * shares[:-1]).sum(dim=1).mean())
        return out

    def _sample(self, decode: Callable[[int], str] | None, limit: int) -> dict:
        ids = self.sample["ids"][:limit].tolist()
        return {
            "ids": ids,
            "text": None if decode is None else [decode(i) for i in ids],
            "groups": self.sample["groups"][:, :limit].tolist(),  # [L][s]
        }
