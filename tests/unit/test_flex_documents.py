"""The FlexAttention backend on packed documents: exact, and its block masks skip other documents.

CPU FlexAttention runs eagerly: ``mask_mod`` is applied to every pair and the block mask's
sparsity is ignored, so the output is compared with the reference on CPU and the block masks
are tested on their own (every allowed pair lies in a kept block, *full* blocks hold only allowed
pairs, the kept blocks are exactly the needed ones where the construction allows it), and a
compiled CPU kernel, which does skip blocks, must give the eager result. Gradients (FlexAttention
has no CPU backward) are compared with the reference on GPU only.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from focus_pretrain.focus import Routing, flex, focus_attention
from focus_pretrain.focus.attention import AttentionRequest, select_backend
from focus_pretrain.focus.band import band_attention
from focus_pretrain.focus.pattern import allowed_pairs, document_starts
from focus_pretrain.focus.sorted_layout import GroupSortedLayout
from tests.helpers import packed_documents, random_probs, random_qkv
from tests.unit.test_backends import assert_flex_gradients_equal_reference

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore::UserWarning"),  # eager CPU FlexAttention notice
]

DOCS = [5, 1, 17, 2, 40, 8, 3]  # shorter and longer than the window, one of a single token


def run(backend: str, ids: Tensor, *, dtype=torch.float32, **kwargs) -> tuple[Tensor, Tensor]:
    """``(out [b, s, 4, 8], lse [b, s, 4])`` of one call on the packed documents ``ids``."""
    b, s = ids.shape
    q, k, v = random_qkv(b, s, 4, kwargs.pop("hkv", 2), 8, seed=21, dtype=dtype)
    probs = random_probs(b, s, 4, seed=22, sharpness=2.0).to(dtype)
    with torch.no_grad():
        return focus_attention(
            q, k, v, Routing(probs), documents=ids, backend=backend, return_lse=True, **kwargs
        )


@pytest.mark.parametrize(
    ("mode", "top_k", "local_only", "sinks", "softcap"),
    [("hard", 1, False, 0, None), ("hard", 2, False, 2, None), ("hard", 3, False, 1, 2.0),
     ("soft", 1, False, 0, None), ("soft", 1, False, 3, 2.0), ("hard", 1, True, 2, None),
     ("hard", 1, True, 0, 2.0), ("hard_gated", 1, False, 2, None),
     ("hard_gated", 2, False, 3, 2.0)],
)  # fmt: skip
@pytest.mark.parametrize("hkv", [1, 4], ids=["gqa", "mha"])
def test_flex_with_documents_equals_reference(mode, top_k, local_only, sinks, softcap, hkv):
    """Output and log-sum-exp, sinks longer than some documents, GQA, soft-capping."""
    ids = packed_documents(2, DOCS, seed=4)
    kwargs = dict(window=6, mode=mode, top_k=top_k, local_only=local_only, sinks=sinks,
                  softcap=softcap, hkv=hkv)  # fmt: skip
    want, want_lse = run("reference", ids, **kwargs)
    got, lse = run("flex", ids, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("mode", "local_only"),
    [("hard", False), ("soft", False), ("hard", True), ("hard_gated", False)],
)
def test_one_document_equals_no_documents(mode, local_only):
    ids = torch.zeros(2, 50, dtype=torch.long)
    kwargs = dict(window=6, mode=mode, top_k=2, local_only=local_only, sinks=2)
    b, s = ids.shape
    q, k, v = random_qkv(b, s, 4, 2, 8, seed=1)
    routing = Routing(random_probs(b, s, 4, seed=2))
    with torch.no_grad():
        got = focus_attention(q, k, v, routing, documents=ids, backend="flex", **kwargs)
        want = focus_attention(q, k, v, routing, backend="flex", **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_flex_is_selectable_with_documents():
    base = dict(device="cpu", dtype=torch.float32, batch=1, seq=512, heads=4, heads_kv=4,
                head_dim=32, mode="hard", top_k=2, local_only=False, window=64, softcap=False,
                needs_grad=False, documents=True)  # fmt: skip
    assert select_backend("flex", AttentionRequest(**base)).name == "flex"
    assert select_backend("auto", AttentionRequest(**base)).name == "reference"  # CPU: eager
    with pytest.raises(ValueError, match=r"'flex' cannot run .*documents=True, needs_grad=True"):
        select_backend("flex", AttentionRequest(**{**base, "needs_grad": True}))


# ----------------------------------------------------------------------------- block masks


def dense_blocks(mask: BlockMask) -> tuple[Tensor, Tensor]:
    """``(kept, full)`` ``[B, nq, nk]`` bool block matrices of a BlockMask (``B = 1``: shared)."""

    def to_dense(num: Tensor, idx: Tensor) -> Tensor:  # [B, 1, nq], [B, 1, nq, nk]
        dense = torch.zeros(num.shape[0], num.shape[-1], idx.shape[-1], dtype=torch.bool)
        for sample in range(num.shape[0]):
            for row in range(num.shape[-1]):
                dense[sample, row, idx[sample, 0, row, : num[sample, 0, row]].long()] = True
        return dense

    partial = to_dense(mask.kv_num_blocks, mask.kv_indices)
    full = torch.zeros_like(partial)
    if mask.full_kv_num_blocks is not None:
        full = to_dense(mask.full_kv_num_blocks, mask.full_kv_indices)
    assert not (partial & full).any()
    return partial | full, full


def needed_blocks(allowed: Tensor, block: int, *, padding: bool = False) -> Tensor:
    """``[b, nb, nb]``: blocks of ``allowed [b, T, T]`` holding an allowed pair (``padding``
    False), or holding only allowed pairs (``padding`` True: padded pairs never count)."""
    b, t = allowed.shape[:2]
    nb = -(-t // block)
    pad = nb * block - t
    padded = torch.nn.functional.pad(allowed, (0, pad, 0, pad), value=padding)
    per_block = padded.view(b, nb, block, nb, block)  # [b, nq, block, nk, block]
    if padding:
        return per_block.all(dim=4).all(dim=2)
    return per_block.any(dim=4).any(dim=2)


def check_block_mask(mask: BlockMask, allowed: Tensor, block: int) -> Tensor:
    """Every allowed pair of ``allowed [b, T, T]`` in a kept block, full blocks all allowed;
    returns the kept blocks ``[b, nb, nb]``."""
    kept, full = dense_blocks(mask)
    kept = kept.expand(allowed.shape[0], -1, -1)  # a shared mask serves every sample
    assert not (needed_blocks(allowed, block) & ~kept).any(), "an allowed pair is skipped"
    assert not (full & ~needed_blocks(allowed, block, padding=True)).any(), "bad full block"
    return kept


def band_pairs(starts: Tensor, window: int, sinks: int, member: Tensor | None) -> Tensor:
    """``[b, n, n]`` pairs of the (cross-group) band with sinks, inside each document."""
    pos = torch.arange(starts.shape[1])
    allowed = allowed_pairs(pos, pos, window, local_only=True, sinks=sinks, q_doc=starts,
                            k_doc=starts)  # fmt: skip
    if member is not None:
        allowed = allowed & ((member[:, :, None] & member[:, None, :]) == 0)
    return allowed


def short_documents(b: int, n: int, *, seed: int, most: int = 6) -> Tensor:
    """``[b, n]`` document starts of random lengths ``1 .. most`` (different per sample)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, most + 1, (b, n), generator=gen)
    new = torch.zeros(b, n, dtype=torch.bool)
    for row in range(b):
        cuts = torch.cumsum(lengths[row], dim=0)
        new[row, cuts[cuts < n]] = True
    return document_starts(torch.cumsum(new, dim=1))


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("window", [0, 5, 40])
@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("cross", [False, True])
def test_band_block_mask_with_documents(block, window, sinks, cross):
    b, n = 2, 150
    starts = document_starts(packed_documents(b, [30, 1, 7, 50, 2, 19, 41], seed=block))
    member = Routing(random_probs(b, n, 4, seed=window)).membership(1) if cross else None
    mask = flex.band_block_mask(n, window, member, torch.device("cpu"), block, sinks=sinks,
                                documents=starts)  # fmt: skip
    allowed = band_pairs(starts, window, sinks, member)
    kept = check_block_mask(mask, allowed, block)
    if not cross:  # document ranges of blocks are exact: no block more than needed
        assert torch.equal(kept, needed_blocks(allowed, block))


@pytest.mark.parametrize("block", [8, 16])
def test_causal_block_mask_with_documents_is_exact(block):
    b, n = 2, 150
    starts = document_starts(packed_documents(b, [30, 1, 7, 50, 2, 19, 41], seed=block))
    mask = flex.causal_block_mask(n, torch.device("cpu"), block, documents=starts)
    pos = torch.arange(n)
    allowed = allowed_pairs(pos, pos, 0, q_doc=starts, k_doc=starts)  # causal, one document
    kept = check_block_mask(mask, allowed, block)
    assert torch.equal(kept, needed_blocks(allowed, block))


def test_short_documents_keep_fewer_blocks():
    """Documents of 10 tokens, blocks of 16: a query block meets itself and, when a document
    straddles its first token (block index not a multiple of 5), the block before."""
    n, block = 256, 16
    nb = n // block
    starts = document_starts(torch.arange(n)[None] // 10)
    pos = torch.arange(n)
    causal = flex.causal_block_mask(n, torch.device("cpu"), block)
    packed = flex.causal_block_mask(n, torch.device("cpu"), block, documents=starts)
    kept = check_block_mask(packed, allowed_pairs(pos, pos, 0, q_doc=starts, k_doc=starts), block)
    assert int(dense_blocks(causal)[0].sum()) == nb * (nb + 1) // 2  # 136
    assert int(kept.sum()) == nb + sum(1 for i in range(1, nb) if i % 5) == 28


@pytest.mark.parametrize("cross", [False, True])
def test_many_short_documents_in_the_band_keep_fewer_blocks(cross):
    """Random short documents: the kept band blocks are exactly the needed ones (cross-group:
    a superset), strictly fewer than without documents; documents aligned with the blocks
    keep exactly the diagonal."""
    b, n, window, sinks, block = 2, 192, 20, 2, 16
    nb = n // block
    member = Routing(random_probs(b, n, 4, seed=3)).membership(1) if cross else None
    starts = short_documents(b, n, seed=1)
    mask = flex.band_block_mask(n, window, member, torch.device("cpu"), block, sinks=sinks,
                                documents=starts)  # fmt: skip
    kept = check_block_mask(mask, band_pairs(starts, window, sinks, member), block)
    alone = flex.band_block_mask(n, window, member, torch.device("cpu"), block, sinks=sinks)
    one_document = torch.zeros(b, n, dtype=torch.long)
    kept_alone = check_block_mask(alone, band_pairs(one_document, window, sinks, member), block)
    assert (kept.sum(dim=(1, 2)) < kept_alone.sum(dim=(1, 2))).all()
    if not cross:
        assert torch.equal(kept, needed_blocks(band_pairs(starts, window, sinks, None), block))
    aligned = document_starts(torch.arange(n).expand(b, n) // block)
    mask = flex.band_block_mask(n, window, member, torch.device("cpu"), block, sinks=sinks,
                                documents=aligned)  # fmt: skip
    kept = check_block_mask(mask, band_pairs(aligned, window, sinks, member), block)
    assert torch.equal(kept, torch.eye(nb, dtype=torch.bool).expand(b, nb, nb))


def same_group_pairs(layout: GroupSortedLayout) -> Tensor:
    """``[1, T, T]`` pairs of the packed layout that share a group, causal, one document."""
    gpos = layout.sample * layout.seq + layout.position  # [T]
    doc = 0 if layout.document is None else layout.document
    unit = layout.sample * layout.seq + doc  # [T]: (sample, document)
    shares = (layout.member[:, None] & layout.member[None, :]) != 0
    return (shares & (unit[:, None] == unit[None, :]) & (gpos[:, None] >= gpos[None, :]))[None]


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("block", [8, 32])
def test_same_group_block_mask_with_documents(top_k, block):
    b, n = 2, 160
    member = Routing(random_probs(b, n, 6, seed=top_k, sharpness=2.0)).membership(top_k)
    starts = short_documents(b, n, seed=top_k, most=40)
    layout = GroupSortedLayout.build(member, starts)
    kept = check_block_mask(flex.same_group_block_mask(layout, block), same_group_pairs(layout),
                            block)  # fmt: skip
    plain = GroupSortedLayout.build(member)
    kept_plain = dense_blocks(flex.same_group_block_mask(plain, block))[0]
    assert kept.sum() < kept_plain.sum()


def test_same_group_block_mask_documents_aligned_with_blocks():
    """Each document fills one block: only the diagonal blocks are kept (exact)."""
    n, block = 128, 16
    member = Routing(random_probs(1, n, 3, seed=5, sharpness=3.0)).membership(1)
    starts = document_starts(torch.arange(n)[None] // block)
    layout = GroupSortedLayout.build(member, starts)
    allowed = same_group_pairs(layout)
    kept = check_block_mask(flex.same_group_block_mask(layout, block), allowed, block)
    assert torch.equal(kept, needed_blocks(allowed, block))
    assert torch.equal(kept[0], torch.eye(n // block, dtype=torch.bool))


def test_same_group_block_mask_without_documents_is_per_sample():
    """A layout built without documents (``layout.document is None``): one document per sample."""
    member = Routing(random_probs(2, 70, 4, seed=1)).membership(2)
    layout = GroupSortedLayout.build(member)
    check_block_mask(flex.same_group_block_mask(layout, 8), same_group_pairs(layout), 8)


def test_compiled_cpu_flex_with_documents_skips_blocks_exactly():
    """The compiled CPU kernel honours the per-sample sparse block masks (eager ignores them):
    the same result as eager; dropping a needed block changes it (the check has teeth)."""
    ids = packed_documents(2, [3, 1, 20, 5, 30, 2, 9, 26], seed=0)
    b, n = ids.shape
    starts = document_starts(ids)
    q, k, v = random_qkv(b, n, 2, 2, 16, seed=1, dtype=torch.float32)
    q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))  # [b, s, H, D] -> [b, H, s, D]
    member = Routing(random_probs(b, n, 4, seed=2, sharpness=3.0)).membership(2)
    cpu = torch.device("cpu")
    layout = GroupSortedLayout.build(member, starts)
    packed = [layout.pack(t).transpose(0, 1)[None] for t in (q, k, v)]  # [1, H, b * s, D]
    cases = [
        (flex.band_block_mask(n, 6, member, cpu, 16, sinks=2, documents=starts), (q4, k4, v4)),
        (flex.band_block_mask(n, 6, None, cpu, 16, sinks=3, documents=starts), (q4, k4, v4)),
        (flex.causal_block_mask(n, cpu, 16, documents=starts), (q4, k4, v4)),
        (flex.same_group_block_mask(layout, 16), packed),
    ]
    compiled = torch.compile(flex_attention, dynamic=False)
    for mask, args in cases:
        got = compiled(*args, block_mask=mask, scale=0.25)
        want = flex_attention(*args, block_mask=mask, scale=0.25)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    mask, args = cases[2]
    nb = mask.kv_num_blocks.shape[-1]
    diagonal = torch.arange(nb, dtype=torch.int32).expand(b, 1, nb)  # [b, 1, nb]
    only_diagonal = BlockMask.from_kv_blocks(
        torch.ones(b, 1, nb, dtype=torch.int32),
        diagonal[..., None].expand(b, 1, nb, nb).contiguous(),  # [b, 1, nb, nb]
        BLOCK_SIZE=16,
        mask_mod=mask.mask_mod,
        seq_lengths=(n, n),
    )
    skipped = compiled(*args, block_mask=only_diagonal, scale=0.25)
    assert not torch.allclose(skipped, flex_attention(*args, block_mask=mask, scale=0.25))


# ----------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_DOCS = [300, 1, 50, 7, 130, 212]  # 700 tokens: long, short and single-token documents


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("mode", "top_k", "local_only"),
    [("soft", 1, False), ("hard", 1, False), ("hard", 2, False), ("hard", 1, True)],
)
@pytest.mark.parametrize(("softcap", "sinks"), [(None, 0), (3.0, 0), (None, 4)])
def test_flex_documents_gradients_equal_reference_on_gpu(mode, top_k, local_only, softcap, sinks):
    """FlexAttention's backward (GPU only) on packed documents: q, k, v and, in soft mode, the
    assignments."""
    assert_flex_gradients_equal_reference(
        n=sum(GPU_DOCS),
        documents=packed_documents(2, GPU_DOCS, seed=3),
        local_only=local_only,
        mode=mode,
        top_k=top_k,
        softcap=softcap,
        sinks=sinks,
    )


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2])
def test_flex_many_short_documents_on_gpu(dtype, top_k):
    """Compiled kernels skip other documents' blocks: still the reference's result."""
    b, n, h, hkv, d = 2, 3000, 8, 2, 64
    ids = short_documents(b, n, seed=4, most=300).cuda()
    q, k, v = (t.cuda() for t in random_qkv(b, n, h, hkv, d, seed=3, dtype=dtype))
    routing = Routing(random_probs(b, n, 8, seed=4, sharpness=3.0).float().cuda())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for mode, local_only in [("hard", False), ("soft", False), ("hard", True)]:
        kwargs = dict(window=128, mode=mode, top_k=top_k, sinks=4, local_only=local_only,
                      documents=ids)  # fmt: skip
        with torch.no_grad():
            want = focus_attention(q, k, v, routing, backend="reference", **kwargs).float()
            got = focus_attention(q, k, v, routing, backend="flex", **kwargs).float()
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=f"{mode} {local_only}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cross", [False, True])
def test_flex_band_with_documents_equals_band_attention_on_gpu(cross):
    """``flex.band(documents=)`` (the decomposed backend's CUDA band) equals the PyTorch band."""
    b, n, h, hkv, d = 2, 1500, 4, 2, 64
    starts = short_documents(b, n, seed=5, most=200).cuda()
    q, k, v = (t.cuda() for t in random_qkv(b, n, h, hkv, d, seed=6, dtype=torch.float32))
    member = None
    if cross:
        member = Routing(random_probs(b, n, 8, seed=7).float().cuda()).membership(1)
    kwargs = dict(window=100, scale=0.125, softcap=None, member=member, documents=starts)
    with torch.no_grad():
        got, lse = flex.band(q, k, v, **kwargs)
        want, want_lse = band_attention(q, k, v, **kwargs)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-4, atol=1e-4)
