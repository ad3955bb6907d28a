"""The group-sorted layout: a batch packed into one sequence, each sample stably sorted by group.

Hard Focus attention between tokens that share a group is block-structured once tokens are
sorted by their membership bitmask: with ``top_k = 1`` every group is a contiguous *segment*
and same-group causal attention is ordinary causal attention inside each segment (a varlen
call), because a **stable** sort keeps the causal order inside a segment. With ``top_k > 1``
tokens of equal bitmask form the segments and two segments interact when their bitmasks
intersect (a block-sparse pattern, :mod:`focus_pretrain.focus.flex`).

**Packed documents**: given each token's document start (``[b, n]`` int64,
:func:`~focus_pretrain.focus.pattern.document_starts`), each sample is sorted stably by the
pair ``(document start, bitmask)``: the segments are then the runs of equal ``(sample,
document, bitmask)``, so with ``top_k = 1`` a varlen call over the segments never crosses a
document. (A block-sparse user must still test ``document`` for segments of different
bitmasks, which share a document range.)

Layout: the batch ``[b, n, ...]`` is flattened to ``[b * n, ...]`` (flat index ``t = sample * n
+ position``) and packed as ``packed[p] = flat[order[p]]``: sample 0's tokens sorted by
(document and) bitmask, then sample 1's, and so on. Nothing here loops over samples, documents
or groups in Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from focus_pretrain.focus.compiled import fused_on_cuda


def segment_slots(
    groups: int, top_k: int, *, documents: bool, key_groups: str = "own"
) -> int | None:
    """The static bound on one sample's segments: its tokens carry at most ``C(K, top_k)``
    distinct bitmasks, so without documents there are at most that many runs; with packed
    documents the runs are (document, bitmask) pairs, bounded only by ``n`` (``None``). The
    keys' bitmasks under ``key_groups="own_and_previous"`` (their own ``top_k`` groups and
    their predecessor's) hold ``top_k`` to ``2 top_k`` groups: ``sum_j C(K, j)`` of them."""
    if documents or groups < 1:
        return None
    if key_groups == "own":
        return math.comb(groups, top_k)
    return sum(math.comb(groups, j) for j in range(top_k, min(2 * top_k, groups) + 1))


@dataclass(frozen=True)
class GroupSortedLayout:
    """Where every token of a batch sits in the group-sorted packed sequence.

    **Fixed shapes**: every tensor's shape follows from ``[b, n]`` and the static bound
    ``slots`` on the segments of one sample; nothing is read back to the host, so the layout
    builds under ``torch.compile(fullgraph=True)`` and CUDA-graph capture. The segments sit in a
    table of ``b * slots`` entries (sample ``i`` owns entries ``[i * slots, (i + 1) * slots)``);
    the entries a sample does not use are **empty segments** (start equal to end), which the
    varlen kernels skip.

    Attributes:
        batch, seq: the batch shape ``[b, n]`` it was built from.
        slots: segments per sample the table holds (:func:`segment_slots`).
        order: ``[b * n]`` int64: packed position ``p`` holds flat token ``order[p]``.
        inverse: ``[b * n]`` int64: flat token ``t`` sits at packed position ``inverse[t]``.
        sample: ``[b * n]`` int64 sample of each packed token.
        position: ``[b * n]`` int64 position (within its sample) of each packed token.
        member: ``[b * n]`` int64 membership bitmask of each packed token.
        segment: ``[b * n]`` int64 table entry of each packed token's segment: runs of equal
            ``(sample, member)`` (``(sample, document, member)`` with documents).
        cu_seqlens: ``[b * slots + 1]`` int32 start of each table entry, then ``b * n``;
            non-decreasing (an empty entry starts where the next one does).
        max_seqlen: a static bound on the longest segment (``n``), never read from the data.
        document: ``[b * n]`` int64 document start of each packed token, or ``None`` when
            built without documents (one document per sample).
    """

    batch: int
    seq: int
    slots: int
    order: Tensor
    inverse: Tensor
    sample: Tensor
    position: Tensor
    member: Tensor
    segment: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    document: Tensor | None = None

    @classmethod
    def build(
        cls, member: Tensor, documents: Tensor | None = None, *, slots: int | None = None
    ) -> GroupSortedLayout:
        """Sort each sample of ``member`` ``[b, n]`` (int64 bitmasks) stably by bitmask; with
        ``documents`` (``[b, n]`` int64 document starts) by ``(document start, bitmask)``.

        ``slots``: a bound on the distinct runs of one sample (:func:`segment_slots`; default
        ``n``, always safe). A smaller table keeps the varlen kernels' grids small; a bound
        that is too small is a wrong result, so callers derive it from ``K`` and ``top_k``."""
        b, n = member.shape
        slots = n if slots is None else max(1, min(int(slots), n))
        tensors = layout_tensors(member, documents, slots)  # compiled on CUDA
        order, inverse, sample, position, packed_member, segment, cu, packed_doc = tensors
        return cls(
            batch=b,
            seq=n,
            slots=slots,
            order=order,
            inverse=inverse,
            sample=sample,
            position=position,
            member=packed_member,
            segment=segment,
            cu_seqlens=cu,
            max_seqlen=n,
            document=packed_doc,
        )

    @classmethod
    def of_pattern(cls, pattern, *, keys: bool = False) -> GroupSortedLayout:
        """The layout of a hard :class:`~focus_pretrain.focus.backends.AttentionPattern`
        (its ``member`` and ``documents``), with the table bounded by its ``groups`` and
        ``top_k`` (:func:`segment_slots`). ``keys``: the layout of the keys' bitmasks
        (``pattern.keys_member``: their own under ``key_groups``)."""
        documents = pattern.documents
        slots = segment_slots(
            pattern.groups, pattern.top_k, documents=documents is not None,
            key_groups=pattern.key_groups if keys else "own",
        )  # fmt: skip
        return cls.build(pattern.keys_member if keys else pattern.member, documents, slots=slots)

    @property
    def num_segments(self) -> int:
        """Entries of the segment table (``b * slots``), empty ones included."""
        return self.cu_seqlens.numel() - 1

    def segment_lengths(self) -> Tensor:
        """``[b * slots]`` int64 length of each table entry (0: empty)."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(torch.int64)

    def pack(self, x: Tensor) -> Tensor:
        """``[b, n, ...]`` -> packed ``[b * n, ...]`` in group-sorted order."""
        return x.reshape(self.batch * self.seq, *x.shape[2:])[self.order]  # [b * n, ...]

    def unpack(self, y: Tensor) -> Tensor:
        """Packed ``[b * n, ...]`` -> ``[b, n, ...]`` in the original order."""
        return y[self.inverse].reshape(self.batch, self.seq, *y.shape[1:])  # [b, n, ...]

    def rank_in_segment(self) -> Tensor:
        """``[b * n]`` int64: each packed token's index inside its segment."""
        starts = self.cu_seqlens[:-1].to(torch.int64)
        return torch.arange(self.order.numel(), device=self.order.device) - starts[self.segment]

    def padded_buckets(self) -> list[PaddedBucket]:
        """Segments grouped by length (powers of two), each bucket padded to its longest.

        Padding every segment to the longest one would cost ``S * max_seqlen^2`` when groups are
        uneven (a collapsed router: ``K`` times dense attention); within a bucket a segment is
        padded to less than twice its length. At most ``log2(n) + 1`` buckets.

        CPU eager only: the buckets are read from the data (a host round trip per bucket).
        """
        lengths = self.segment_lengths()  # [S]
        bucket_of = torch.ceil(torch.log2(lengths.clamp(min=1).double())).to(torch.int64)  # [S]
        bucket_of = torch.where(lengths > 0, bucket_of, -1)  # empty entries: no bucket
        rank = self.rank_in_segment()
        token_bucket = bucket_of[self.segment]  # [b * n]
        buckets = []
        for value in torch.unique(bucket_of).tolist():  # a loop over lengths, not over groups
            if value < 0:
                continue
            segments = torch.nonzero(bucket_of == value).squeeze(1)  # [S_v]
            slot = torch.full_like(lengths, -1)
            slot[segments] = torch.arange(segments.numel(), device=slot.device)
            index = torch.nonzero(token_bucket == value).squeeze(1)  # [T_v] packed positions
            buckets.append(
                PaddedBucket(
                    index=index,
                    slot=slot[self.segment[index]],
                    rank=rank[index],
                    num_segments=segments.numel(),
                    length=int(lengths[segments].max()),
                )
            )
        return buckets


@dataclass(frozen=True)
class PaddedBucket:
    """Segments of similar length, laid out as rows ``[num_segments, length, ...]``.

    Attributes:
        index: ``[T_v]`` packed positions of the bucket's tokens.
        slot, rank: ``[T_v]`` row and column of each of those tokens.
        num_segments, length: the padded shape.
    """

    index: Tensor
    slot: Tensor
    rank: Tensor
    num_segments: int
    length: int

    def to_padded(self, packed: Tensor) -> Tensor:
        """Packed ``[b * n, ...]`` -> ``[num_segments, length, ...]`` (zero right padding)."""
        out = packed.new_zeros(self.num_segments, self.length, *packed.shape[1:])
        out[self.slot, self.rank] = packed[self.index]
        return out

    def scatter(self, padded: Tensor, packed: Tensor) -> None:
        """Write rows ``[num_segments, length, ...]`` back into ``packed [b * n, ...]``."""
        packed[self.index] = padded[self.slot, self.rank]


@fused_on_cuda
def layout_tensors(member: Tensor, documents: Tensor | None, slots: int) -> tuple:
    """The tensors of :meth:`GroupSortedLayout.build` (fixed shapes, no host sync):
    ``(order, inverse, sample, position, member, segment, cu_seqlens, document)``, all
    ``[b * n]`` but ``cu_seqlens [b * slots + 1]`` int32 (``document`` ``None`` without
    documents)."""
    b, n = member.shape
    device = member.device
    sorted_member, index = torch.sort(member, dim=1, stable=True)  # [b, n] each
    sorted_doc = packed_doc = None
    if documents is not None:  # then stably by document: lexicographic (document, member)
        sorted_doc, by_doc = torch.sort(documents.gather(1, index), dim=1, stable=True)
        index = index.gather(1, by_doc)  # [b, n]
        sorted_member = sorted_member.gather(1, by_doc)  # [b, n]
        packed_doc = sorted_doc.reshape(-1)  # [b, n] -> [b * n]
    starts = torch.ones_like(sorted_member, dtype=torch.bool)  # [b, n] a run starts here
    starts[:, 1:] = sorted_member[:, 1:] != sorted_member[:, :-1]
    if sorted_doc is not None:
        starts[:, 1:] |= sorted_doc[:, 1:] != sorted_doc[:, :-1]
    sample_ids = torch.arange(b, device=device)  # [b]
    run = torch.cumsum(starts, dim=1) - 1  # [b, n] run index inside the sample
    segment = (run + sample_ids[:, None] * slots).reshape(-1)  # [b, n] -> [b * n]
    packed = torch.arange(b * n, device=device)  # [b * n]
    cu = torch.full((b * slots + 1,), b * n, dtype=torch.int64, device=device)
    cu.scatter_reduce_(0, segment, packed, reduce="amin")  # unused entries keep b * n
    cu = torch.flip(torch.cummin(torch.flip(cu, (0,)), dim=0).values, (0,))  # empty: next
    order = (index + sample_ids[:, None] * n).reshape(-1)  # [b, n] -> [b * n] flat indices
    inverse = torch.empty_like(order)
    inverse[order] = packed
    sample = sample_ids.repeat_interleave(n)  # [b * n]
    position = index.reshape(-1)  # [b, n] -> [b * n]
    member_packed = sorted_member.reshape(-1)  # [b, n] -> [b * n]
    return order, inverse, sample, position, member_packed, segment, cu.to(torch.int32), packed_doc
