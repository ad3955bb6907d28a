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

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class GroupSortedLayout:
    """Where every token of a batch sits in the group-sorted packed sequence.

    Attributes:
        batch, seq: the batch shape ``[b, n]`` it was built from.
        order: ``[b * n]`` int64: packed position ``p`` holds flat token ``order[p]``.
        inverse: ``[b * n]`` int64: flat token ``t`` sits at packed position ``inverse[t]``.
        sample: ``[b * n]`` int64 sample of each packed token.
        position: ``[b * n]`` int64 position (within its sample) of each packed token.
        member: ``[b * n]`` int64 membership bitmask of each packed token.
        segment: ``[b * n]`` int64 segment id: runs of equal ``(sample, member)`` (``(sample,
            document, member)`` with documents).
        cu_seqlens: ``[S + 1]`` int32 start of each segment, then ``b * n``.
        max_seqlen: the longest segment.
        document: ``[b * n]`` int64 document start of each packed token, or ``None`` when
            built without documents (one document per sample).
    """

    batch: int
    seq: int
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
    def build(cls, member: Tensor, documents: Tensor | None = None) -> GroupSortedLayout:
        """Sort each sample of ``member`` ``[b, n]`` (int64 bitmasks) stably by bitmask; with
        ``documents`` (``[b, n]`` int64 document starts) by ``(document start, bitmask)``."""
        b, n = member.shape
        device = member.device
        sorted_member, index = torch.sort(member, dim=1, stable=True)  # [b, n] each
        if documents is not None:  # then stably by document: lexicographic (document, member)
            sorted_doc, by_doc = torch.sort(documents.gather(1, index), dim=1, stable=True)
            index = index.gather(1, by_doc)  # [b, n]
            sorted_member = sorted_member.gather(1, by_doc)  # [b, n]
        sample = torch.arange(b, device=device).repeat_interleave(n)  # [b * n]
        order = (index + sample.view(b, n) * n).reshape(-1)  # [b, n] -> [b * n] flat indices
        packed_member = sorted_member.reshape(-1)  # [b, n] -> [b * n]
        starts = torch.ones_like(packed_member, dtype=torch.bool)
        starts[1:] = (packed_member[1:] != packed_member[:-1]) | (sample[1:] != sample[:-1])
        packed_doc = None
        if documents is not None:
            packed_doc = sorted_doc.reshape(-1)  # [b, n] -> [b * n]
            starts[1:] |= packed_doc[1:] != packed_doc[:-1]
        segment = torch.cumsum(starts, dim=0) - 1
        start_index = torch.nonzero(starts).squeeze(1)
        end = torch.tensor([b * n], device=device)
        cu_seqlens = torch.cat([start_index, end]).to(torch.int32)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(b * n, device=device)
        return cls(
            batch=b,
            seq=n,
            order=order,
            inverse=inverse,
            sample=sample,
            position=index.reshape(-1),
            member=packed_member,
            segment=segment,
            cu_seqlens=cu_seqlens,
            max_seqlen=int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
            document=packed_doc,
        )

    @property
    def num_segments(self) -> int:
        return self.cu_seqlens.numel() - 1

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
        """
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(torch.int64)  # [S]
        bucket_of = torch.ceil(torch.log2(lengths.double())).to(torch.int64)  # [S]
        rank = self.rank_in_segment()
        token_bucket = bucket_of[self.segment]  # [b * n]
        buckets = []
        for value in torch.unique(bucket_of).tolist():  # a loop over lengths, not over groups
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
