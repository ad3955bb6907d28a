"""The Focus pattern, in one place: which (query, key) pairs are allowed, and the soft gate.

A query at position ``i`` may attend a key at position ``j`` when::

    j <= i  and  ( i - j <= window   or   j < sinks   or   shares_group(i, j) )

``sinks`` (``S``, default 0) are attention sinks: the first ``S`` positions of the sequence are
always visible, like keys inside the window (:func:`causal_and_local`).

**Documents** (packed sequences): given each token's *document start* ``d`` (the position of
the first token of its document, :func:`document_starts`), a pair is allowed only inside one
document, ``d_i == d_j``, and the sinks are the first ``S`` tokens *of each document*
(``j - d_j < S``). So a document packed among others sees exactly what it would see alone (the
window and causal tests use differences of positions, which packing does not change). The
structure is ``[b, s]`` integers, never an ``n x n`` mask.

* **hard** (inference): ``shares_group`` is "the top-k group sets of ``i`` and ``j`` intersect",
  tested on int64 membership bitmasks (one bit per group). Disallowed pairs get ``-inf``.
* **soft** (training): every causal pair is allowed; pairs beyond the window (and not a sink)
  get the additive log-space gate ``log sigmoid(lambda * (g_i . g_j - 1/2))`` on their
  (soft-capped) score, where ``g`` are the soft group assignments. As ``lambda -> inf`` the gate
  tends to ``0`` when ``g_i . g_j > 1/2`` and to ``-inf`` when ``g_i . g_j < 1/2``: with near
  one-hot assignments, exactly the hard top-1 mask.
* **hard_gated** (sparse training, ``focus.training_mode: hard``): the hard pattern's pairs
  only (the others ``-inf``), and on its routed pairs (beyond the window, not a sink) the soft
  gate of the soft mode, so that the routers still get a gradient from the kept pairs. The
  top-k selection itself is not differentiated (``docs/focus-method.md``, "Sparse training").
* **local only** (the sliding-window layers of interleaved local/global models): only
  ``0 <= i - j <= window`` (and the sinks); no routing.

**Key groups** (``key_groups``): by default a token is routed once and counts as the same
groups on both sides of a pair (``"own"``, the method). With ``"own_and_previous"`` a *key*
also counts as in the groups of the token before it in its document
(:func:`key_memberships`, :func:`key_assignments`): a key is then found by what precedes it
as well as by what it is, the link an induction head follows (the query matches the token
before the one it copies). Queries keep their own groups; the first token of a document has
no predecessor. In soft mode the key's assignment is the elementwise probabilistic or
``g_j + g_{j-1} - g_j * g_{j-1}``, whose limit with one-hot assignments is the hard rule.

The fast backends split the hard pattern into disjoint parts merged by log-sum-exp: pairs that
share a group, the cross-group local band, and :func:`sink_only_pairs` (the sink keys neither
of the others covers).

Positions are explicit so that the same functions serve a whole sequence, a block of it, or
the shards of a context-parallel run. Every attention backend must compute this pattern.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

UNLIMITED_WINDOW = 2**62  # a window no sequence reaches: every causal pair is local (dense)
# what focus_attention computes: the two patterns, and the hard one gated (sparse training)
PATTERN_MODES = ("soft", "hard", "hard_gated")


def membership_bitmask(top_groups: Tensor) -> Tensor:
    """Pack group indices into one int64 bitmask per token.

    Args:
        top_groups: ``[..., top_k]`` integer group indices in ``[0, 64)``, distinct per token.

    Returns:
        ``[...]`` int64, bit ``k`` set when the token belongs to group ``k``.
    """
    bits = torch.ones_like(top_groups, dtype=torch.int64) << top_groups.to(torch.int64)
    return bits.sum(dim=-1)  # distinct bits: the sum is the bitwise or


def member_bits(member: Tensor) -> Tensor:
    """``[..., 64]`` bool: bit ``k`` of each int64 membership bitmask (group ``k`` membership)."""
    bits = torch.arange(64, device=member.device)
    return ((member[..., None] >> bits) & 1).bool()


def groups_intersect(member_q: Tensor, member_k: Tensor) -> Tensor:
    """Elementwise (broadcasting) bool: do the int64 membership bitmasks intersect? The one
    definition of "shares a group" (hard mode)."""
    return (member_q & member_k) != 0


def shares_group(member_q: Tensor, member_k: Tensor) -> Tensor:
    """``[b, Lq, Lk]`` bool: do the membership bitmasks ``[b, Lq]`` and ``[b, Lk]`` intersect?"""
    return groups_intersect(member_q[:, :, None], member_k[:, None, :])


def previous_in_document(t: Tensor, documents: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(previous, has_previous)``: each token's predecessor's row of ``t`` ``[b, s, ...]``
    (shifted by one along ``s``; the first row repeats row 0) and ``[b, s]`` bool, whether the
    token has a predecessor in its document (``documents``: ``[b, s]`` document starts, or
    ``None`` for one document per sample)."""
    b, s = t.shape[:2]
    previous = torch.cat([t[:, :1], t[:, :-1]], dim=1)  # [b, s, ...]: row i holds row i - 1
    positions = torch.arange(s, device=t.device)
    if documents is None:
        return previous, (positions > 0).expand(b, s)
    return previous, documents.to(positions.dtype) != positions  # [b, s]: not a start


def key_memberships(member: Tensor, documents: Tensor | None = None) -> Tensor:
    """``[b, s]`` int64: the groups a key counts as in under ``key_groups="own_and_previous"``:
    its own membership bitmask ``member`` ``[b, s]`` or'ed with its predecessor's in its
    document (``documents``: ``[b, s]`` document starts, or ``None``)."""
    previous, has_previous = previous_in_document(member, documents)
    return member | torch.where(has_previous, previous, torch.zeros_like(previous))


def key_side_memberships(
    member: Tensor, key_groups: str, documents: Tensor | None = None
) -> Tensor | None:
    """The keys' bitmasks ``[b, s]`` under ``key_groups`` (:func:`key_memberships`), or
    ``None`` where they are the queries' own (``"own"``): what the kept-pair counts
    (:func:`count_allowed_pairs`' ``key_member``) and the backends take."""
    return None if key_groups == "own" else key_memberships(member, documents)


def key_assignments(probs: Tensor, documents: Tensor | None = None) -> Tensor:
    """``[b, s, K]``: a key's soft assignment under ``key_groups="own_and_previous"``: the
    elementwise probabilistic or ``g + g_prev - g * g_prev`` of its own ``probs`` ``[b, s, K]``
    and its predecessor's in its document (``g_prev = 0`` for a document's first token), in
    ``probs``' dtype; one-hot assignments give :func:`key_memberships`' sets."""
    previous, has_previous = previous_in_document(probs, documents)
    previous = previous * has_previous[..., None].to(probs.dtype)  # [b, s, K]
    return probs + previous - probs * previous


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype Focus maths runs in: the promotion of ``dtypes`` and fp32 (never below fp32)."""
    return functools.reduce(torch.promote_types, dtypes, torch.float32)


def at_least_fp32(t: Tensor) -> Tensor:
    """``t`` in :func:`compute_dtype` of its dtype: fp32, or fp64 for fp64 inputs."""
    return t.to(compute_dtype(t.dtype))


def group_affinity(probs_q: Tensor, probs_k: Tensor) -> Tensor:
    """``[b, Lq, Lk]`` soft co-membership ``g_i . g_j`` from assignments ``[b, Lq|Lk, K]``."""
    return torch.einsum("bqk,bjk->bqj", at_least_fp32(probs_q), at_least_fp32(probs_k))


def soft_gate(affinity: Tensor, gate_lambda: float | Tensor) -> Tensor:
    """The soft gate ``log sigmoid(lambda * (affinity - 1/2))``, elementwise, at least fp32.

    The one definition of the gate: the reference applies it to ``[b, Lq, Lk]`` affinities
    (``F.logsigmoid``), FlexAttention ``score_mod`` s (:mod:`~focus_pretrain.focus.flex`, the
    ring's fused kernel) to one pair's, with ``gate_lambda`` a captured 0-dim tensor: there
    ``log sigmoid(x)`` is spelt ``min(x, 0) - log1p(exp(-|x|))``, ``F.logsigmoid``'s own
    formula in pointwise ops every compiler lowers inside a ``score_mod`` (``torch.minimum``
    splits the gradient of a tie: the derivative at ``x = 0`` is ``1/2``). The two spellings
    agree to rounding; the eager one stays ``F.logsigmoid`` because training runs are
    reproduced bit for bit across versions (the recall demo's outcome depends on it)."""
    x = gate_lambda * (at_least_fp32(affinity) - 0.5)
    if not isinstance(gate_lambda, Tensor):
        return F.logsigmoid(x)
    return torch.minimum(x, torch.zeros_like(x)) - torch.log1p(torch.exp(-torch.abs(x)))


def soft_cap(scores: Tensor, cap: float | Tensor | None) -> Tensor:
    """Logit soft-capping ``cap * tanh(scores / cap)`` (Gemma-2 attention logits, Gemma's
    final logits); ``cap=None``: ``scores`` unchanged. The one definition, applied to scores
    before the pattern by every torch backend and inside ``score_mod`` s (``cap`` a 0-dim
    tensor there)."""
    if cap is None:
        return scores
    return cap * torch.tanh(scores / cap)


def document_starts(documents: Tensor) -> Tensor:
    """Each token's document start: ``[b, s]`` document ids -> ``[b, s]`` int64 positions.

    A token starts a new document when its id differs from the previous token's (documents
    are contiguous runs; the ids themselves only need to change at boundaries). The result is
    the position of the first token of each token's document, itself a valid id array
    (``document_starts(document_starts(x)) == document_starts(x)``), and what every backend
    and the context-parallel shards use (positions are global, so they survive sharding).
    """
    b, s = documents.shape
    positions = torch.arange(s, device=documents.device).expand(b, s)  # [b, s]
    new = torch.ones(b, s, dtype=torch.bool, device=documents.device)
    new[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return torch.where(new, positions, 0).cummax(dim=1).values


def pair_rule(
    q_pos: Tensor,
    k_pos: Tensor,
    *,
    window: int,
    sinks: int = 0,
    q_doc: Tensor | None = None,
    k_doc: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The pair rule, elementwise: ``(causal, near)`` bool of broadcast-compatible query and key
    positions (and document starts, ``None``: one document; ``k_doc`` alone places the sinks
    without testing the documents, for a caller whose mask already did).

    ``causal``: ``j <= i`` in one document; ``near``: the key is inside the window (``i - j <=
    window``) or a sink (``j - d_j < sinks``, the first ``sinks`` tokens of its document). The
    always-attended pairs are ``causal & near``; the rest of ``causal`` is gated (soft mode),
    routed (hard mode: a shared group) or cut (sliding-window layers). The one definition of the
    window, the sinks and the documents: the masks below apply it to ``[Lq, Lk]`` grids, the
    FlexAttention ``mask_mod`` / ``score_mod`` s to one pair's indices.
    """
    causal = k_pos <= q_pos
    offset = k_pos if k_doc is None else k_pos - k_doc  # the key's position in its document
    if q_doc is not None and k_doc is not None:
        causal = causal & (q_doc == k_doc)
    near = q_pos - k_pos <= window
    if sinks:
        near = near | (offset < sinks)
    return causal, near


def causal_and_local(
    q_pos: Tensor,
    k_pos: Tensor,
    window: int,
    sinks: int = 0,
    *,
    q_doc: Tensor | None = None,
    k_doc: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(causal, local)`` pair masks from positions ``[Lq]`` and ``[Lk]``.

    ``causal`` is ``j <= i``; ``local`` (the pairs that are always attended, with no gate) is
    ``0 <= i - j <= window`` or, with ``sinks = S > 0``, a causal key at a position ``j < S``
    (an attention sink). A subset of causal. The one definition of the sinks.

    With document starts ``q_doc [b, Lq]`` and ``k_doc [b, Lk]`` both masks also require one
    document, the sinks are the first ``S`` tokens of each document (``j - d_j < S``), and the
    masks are ``[b, Lq, Lk]``; without, ``[Lq, Lk]``.
    """
    if q_doc is None or k_doc is None:
        causal, near = pair_rule(q_pos[:, None], k_pos[None, :], window=window, sinks=sinks)
        return causal, causal & near  # [Lq, Lk]
    causal, near = pair_rule(
        q_pos[None, :, None],
        k_pos[None, None, :],
        window=window,
        sinks=sinks,
        q_doc=q_doc[:, :, None],
        k_doc=k_doc[:, None, :],
    )  # [b, Lq, Lk]
    return causal, causal & near


def _batched(mask: Tensor) -> Tensor:
    """``[Lq, Lk] -> [1, Lq, Lk]``; ``[b, Lq, Lk]`` unchanged."""
    return mask[None] if mask.dim() == 2 else mask


def sink_only_pairs(
    q_pos: Tensor,
    k_pos: Tensor,
    window: int,
    sinks: int,
    *,
    member_q: Tensor | None = None,
    member_k: Tensor | None = None,
    q_doc: Tensor | None = None,
    k_doc: Tensor | None = None,
) -> Tensor:
    """``[b, Lq, Lk]`` bool: pairs allowed *only* because the key is a sink.

    Causal pairs with ``j < sinks`` (``j - d_j < sinks`` with document starts ``[b, Lq|Lk]``)
    beyond the window and, given memberships ``[b, Lq|Lk]``, whose groups do not intersect:
    the part of the pattern that neither the local window nor the same-group pairs cover
    (disjoint from both, so a backend can add it by log-sum-exp; ``b = 1`` without
    memberships and documents, e.g. sliding-window layers).
    """
    docs = dict(q_doc=q_doc, k_doc=k_doc)
    _, window_pairs = causal_and_local(q_pos, k_pos, window, **docs)
    _, always = causal_and_local(q_pos, k_pos, window, sinks, **docs)
    extra = _batched(always & ~window_pairs)  # [b|1, Lq, Lk]
    if member_q is not None and member_k is not None:
        extra = extra & ~shares_group(member_q, member_k)
    return extra


def allowed_pairs(
    q_pos: Tensor,
    k_pos: Tensor,
    window: int,
    *,
    member_q: Tensor | None = None,
    member_k: Tensor | None = None,
    local_only: bool = False,
    sinks: int = 0,
    q_doc: Tensor | None = None,
    k_doc: Tensor | None = None,
) -> Tensor:
    """Boolean pattern of allowed pairs.

    Args:
        q_pos, k_pos: ``[Lq]``, ``[Lk]`` integer positions (global positions under sharding).
        window: the local window ``w >= 0``.
        member_q, member_k: ``[b, Lq]``, ``[b, Lk]`` int64 membership bitmasks (hard mode);
            when omitted and not ``local_only``, every causal pair is allowed (soft mode).
        local_only: sliding-window layer: only the window (and the sinks).
        sinks: ``S >= 0``: keys at positions ``< S`` are always allowed (causally).
        q_doc, k_doc: ``[b, Lq]``, ``[b, Lk]`` document starts (packed documents), or ``None``.

    Returns:
        ``[b, Lq, Lk]`` bool (``b = 1`` without memberships and documents).
    """
    causal, local = causal_and_local(q_pos, k_pos, window, sinks, q_doc=q_doc, k_doc=k_doc)
    causal, local = _batched(causal), _batched(local)
    if local_only:
        return local
    if member_q is None or member_k is None:
        return causal
    return local | (causal & shares_group(member_q, member_k))


def pair_bias(
    q_pos: Tensor,
    k_pos: Tensor,
    window: int,
    *,
    mode: str,
    probs_q: Tensor | None = None,
    probs_k: Tensor | None = None,
    member_q: Tensor | None = None,
    member_k: Tensor | None = None,
    gate_lambda: float = 10.0,
    local_only: bool = False,
    sinks: int = 0,
    q_doc: Tensor | None = None,
    k_doc: Tensor | None = None,
) -> Tensor:
    """Additive score bias (at least fp32) implementing the pattern: ``0``, gate or ``-inf``.

    ``mode="hard"`` needs ``member_q/member_k``; ``mode="soft"`` needs ``probs_q/probs_k``
    (``[b, L, K]``); ``mode="hard_gated"`` both (the hard pattern's pairs, gated beyond the
    window); ``local_only`` needs neither. Sink keys (positions ``< sinks``) are
    allowed with no gate, like keys inside the window. Document starts ``q_doc [b, Lq]`` and
    ``k_doc [b, Lk]`` (packed documents) disallow pairs across documents.

    Returns:
        ``[b, Lq, Lk]`` float32 (``b = 1`` when neither routing nor documents are used).
    """
    neg_inf = torch.tensor(float("-inf"), device=q_pos.device)
    if local_only or mode == "hard":
        allowed = allowed_pairs(
            q_pos,
            k_pos,
            window,
            member_q=member_q,
            member_k=member_k,
            local_only=local_only,
            sinks=sinks,
            q_doc=q_doc,
            k_doc=k_doc,
        )
        return torch.where(allowed, torch.zeros((), device=q_pos.device), neg_inf)
    if mode not in ("soft", "hard_gated"):
        raise ValueError(f"mode must be 'soft', 'hard' or 'hard_gated', got {mode!r}")
    causal, local = causal_and_local(q_pos, k_pos, window, sinks, q_doc=q_doc, k_doc=k_doc)
    causal, local = _batched(causal), _batched(local)  # [b|1, Lq, Lk]
    gate = soft_gate(group_affinity(probs_q, probs_k), gate_lambda)  # [b, Lq, Lk]
    bias = torch.where(causal & ~local, gate, torch.zeros((), device=gate.device))
    if mode == "hard_gated":  # only the hard pattern's pairs: local or sharing a group
        causal = local | (causal & shares_group(member_q, member_k))
    return torch.where(causal, bias, neg_inf)


def count_allowed_pairs(
    member: Tensor,
    window: int,
    sinks: int = 0,
    documents: Tensor | None = None,
    key_member: Tensor | None = None,
) -> Tensor:
    """Number of (query, key) pairs the hard pattern allows, per sample, without ``n x n`` memory.

    Counts by distinct membership value: with ``M`` distinct bitmasks in a sample (at most
    ``C(K, top_k)``, or the keys' and queries' together), it costs ``O(n * M)`` time and
    memory, so it scales to million-token sequences; sinks add ``O(n * sinks)``.

    Args:
        member: ``[b, n]`` int64 membership bitmasks (of the queries, and of the keys unless
            ``key_member`` is given).
        window: the local window ``w >= 0``.
        sinks: attention sinks ``S >= 0`` (:func:`sink_only_pairs`).
        documents: ``[b, n]`` document starts of packed sequences: each document is counted
            on its own (a loop over documents; the pairs across them are never allowed).
        key_member: ``[b, n]`` the keys' bitmasks when they differ from the queries'
            (``key_groups``: :func:`key_memberships`, computed with the same ``documents``).

    Returns:
        ``[b]`` int64 counts (local pairs, same-group pairs beyond the window, sink pairs).
    """
    keys = member if key_member is None else key_member
    if documents is not None:
        return torch.tensor(
            [
                sum(
                    int(
                        count_allowed_pairs(
                            member[r : r + 1, a:e], window, sinks, key_member=keys[r : r + 1, a:e]
                        )[0]
                    )
                    for a, e in _document_spans(documents[r])
                )
                for r in range(member.shape[0])
            ],
            dtype=torch.int64,
        )
    n = member.shape[1]
    pos = torch.arange(n, device=member.device)
    local = int(torch.clamp(pos + 1, max=window + 1).sum())  # keys 0..min(i, w) back
    counts = [
        local + _distant_pairs(row_q, row_k, window)
        for row_q, row_k in zip(member, keys, strict=True)
    ]
    counts = torch.tensor(counts, dtype=torch.int64)
    s = min(sinks, n)
    if s:  # [b, n, S]: the pairs that only the sinks allow
        extra = sink_only_pairs(pos, pos[:s], window, sinks, member_q=member, member_k=keys[:, :s])
        counts = counts + extra.flatten(1).sum(1).cpu()
    return counts


def _distant_pairs(member_q: Tensor, member_k: Tensor, window: int) -> int:
    """Pairs ``j < i - window`` of one sample (``[n]`` bitmasks of queries and keys) whose
    bitmasks intersect: by distinct value, ``O(n * M)``."""
    n = member_q.shape[0]
    values, inverse = torch.unique(torch.cat([member_q, member_k]), return_inverse=True)  # [M]
    onehot = F.one_hot(inverse, values.numel()).double()  # [2n, M]
    onehot_q, onehot_k = onehot[:n], onehot[n:]  # [n, M] each
    before = torch.cumsum(onehot_k, dim=0)  # [n, M]: keys j <= i by membership
    lag = window + 1  # distant keys of query i are j <= i - lag
    distant = torch.zeros_like(before)
    if lag < n:
        distant[lag:] = before[: n - lag]
    by_value = onehot_q.t() @ distant  # [M, M]: (query value, key value) distant pairs
    compatible = (values[:, None] & values[None, :]) != 0  # [M, M]
    return round(float(by_value[compatible].sum()))


def pattern_density(
    member: Tensor,
    window: int,
    sinks: int = 0,
    documents: Tensor | None = None,
    key_member: Tensor | None = None,
) -> Tensor:
    """Fraction of causal pairs the hard pattern keeps, per sample: ``[b]`` float64.

    With ``documents`` (``[b, n]`` starts) the causal pairs are those inside each document;
    ``key_member``: the keys' bitmasks where they differ (:func:`count_allowed_pairs`).
    The ideal speedup of a sparse kernel over dense causal attention is ``1 / density``.
    """
    n = member.shape[1]
    kept = count_allowed_pairs(member, window, sinks, documents, key_member).double()
    if documents is None:
        return kept / (n * (n + 1) / 2)
    causal = [sum((e - a) * (e - a + 1) / 2 for a, e in _document_spans(row)) for row in documents]
    return kept / torch.tensor(causal, dtype=torch.float64)


def _document_spans(starts: Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each document of one row of document starts ``[n]``."""
    firsts = torch.unique_consecutive(starts).tolist()
    return list(zip(firsts, [*firsts[1:], starts.shape[0]], strict=True))
