"""The ring's block test and document-start check with packed documents (no processes).

:func:`~focus_pretrain.focus.pattern_blocks.block_has_pair` decides whether a (query shard, key
shard) block holds any allowed pair without an ``n x n`` mask; here it is compared with the
brute-force whole-sequence pattern on random documents, memberships, windows and sinks. The ring
and the all-to-all against the single process run in
``tests/multiprocess/test_context_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch

from focus_pretrain.focus.pattern import allowed_pairs, document_starts, membership_bitmask
from focus_pretrain.focus.pattern_blocks import block_has_pair
from focus_pretrain.parallel.ring import check_document_starts
from focus_pretrain.parallel.sharding import shard_sequence, zigzag_positions


def _random_documents(gen: torch.Generator, b: int, s: int) -> torch.Tensor:
    """``[b, s]`` document starts with about one boundary every 4 tokens."""
    ids = (torch.rand(b, s, generator=gen) < 0.25).cumsum(dim=1)  # [b, s]
    return document_starts(ids)


@pytest.mark.parametrize("seed", range(6))
def test_block_has_pair_equals_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    b, s, groups = 2, 24, 4
    positions = torch.arange(s)
    checked = skipped = 0
    for _ in range(60):
        starts = _random_documents(gen, b, s) if torch.rand(1, generator=gen) < 0.8 else None
        top = torch.rand(b, s, groups, generator=gen).argsort(dim=-1)[..., :2]  # [b, s, 2]
        member = membership_bitmask(top[..., : int(torch.randint(1, 3, (1,), generator=gen))])
        window, sinks = (int(torch.randint(0, 4, (1,), generator=gen)) for _ in range(2))
        local_only = bool(torch.rand(1, generator=gen) < 0.25)
        hard = bool(torch.rand(1, generator=gen) < 0.5)
        routed = hard and not local_only
        allowed = allowed_pairs(
            positions, positions, window, member_q=member if routed else None,
            member_k=member if routed else None, local_only=local_only, sinks=sinks,
            q_doc=starts, k_doc=starts,
        )  # fmt: skip  # [b|1, s, s]
        q_idx = torch.randperm(s, generator=gen)[: int(torch.randint(1, 8, (1,), generator=gen))]
        k_idx = torch.randperm(s, generator=gen)[: int(torch.randint(1, 8, (1,), generator=gen))]
        want = bool(allowed[:, q_idx][:, :, k_idx].any())
        got = block_has_pair(
            q_idx, k_idx, window, member_q=member[:, q_idx] if routed else None,
            member_k=member[:, k_idx] if routed else None, local_only=local_only, sinks=sinks,
            q_doc=None if starts is None else starts[:, q_idx],
        )  # fmt: skip
        assert got == want, (starts, q_idx, k_idx, window, sinks, local_only, routed)
        checked += 1
        skipped += not want
    assert 0 < skipped < checked  # both answers occur


def test_document_starts_shards_pass_and_ids_fail():
    """The shards of the full sequence's starts pass on every rank; per-token ids that change
    inside a chunk (here every 2 tokens) fail on every rank, whatever their values: a token
    must continue its neighbour's document or start its own. (The check is local: ids constant
    over a rank's chunks cannot be told from starts without communication.)"""
    s, cp = 32, 4
    ids = torch.tensor([0] * 5 + [1] + [2] * 2 + [3] * 11 + [4] * 13)[None]  # [1, 32]
    starts = document_starts(ids)
    q = torch.zeros(1, s // cp, 2, 4)
    for rank in range(cp):
        positions = zigzag_positions(s, cp, rank)
        shard = shard_sequence(starts, 1, cp, rank).int()
        assert check_document_starts(shard, q, positions).dtype == torch.int64
        pairs = shard_sequence(torch.arange(s)[None] // 2, 1, cp, rank)
        with pytest.raises(ValueError, match="must be the document starts of the full sequence"):
            check_document_starts(pairs, q, positions)
        with pytest.raises(ValueError, match="must be the document starts of the full sequence"):
            check_document_starts(shard + 1, q, positions)  # a start after its token
    with pytest.raises(ValueError, match=r"\[batch=1, seq_local=8\] document starts"):
        check_document_starts(starts, q)
    with pytest.raises(ValueError, match="must be an integer tensor"):
        check_document_starts(starts[:, :8].float(), q)
