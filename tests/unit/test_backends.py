"""Every fast backend against the reference: random shapes, K, top_k, windows, GQA, dtypes.

The reference itself is tested against a brute-force loop (``test_reference_exact.py``). CPU
FlexAttention runs eagerly, which applies ``mask_mod`` to every pair and ignores the block
mask's sparsity, so the block masks are tested on their own: every allowed pair lies in a kept
block, every *full* block holds only allowed pairs, and a compiled CPU kernel (which does skip
blocks) gives the exact result.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import flex_attention

from focus_pretrain.focus import Routing, focus_attention
from focus_pretrain.focus.attention import (
    CPU_DECOMPOSED_MIN_SEQ,
    AttentionRequest,
    available_backends,
    select_backend,
)
from focus_pretrain.focus.backends import get_backend
from focus_pretrain.focus.band import band_attention, sink_attention
from focus_pretrain.focus.flex import band_block_mask, same_group_block_mask
from focus_pretrain.focus.lse import merge_by_lse
from focus_pretrain.focus.pattern import allowed_pairs, document_starts
from focus_pretrain.focus.sorted_layout import GroupSortedLayout
from tests.helpers import packed_documents, random_probs, random_qkv

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore::UserWarning"),  # eager CPU FlexAttention notice
]


def skewed_probs(b: int, n: int, k: int, *, seed: int, skew: float) -> torch.Tensor:
    """Soft assignments with uneven (``skew > 0``: some groups large, some empty) group sizes."""
    probs = random_probs(b, n, k, seed=seed, sharpness=3.0)
    prior = torch.exp(-skew * torch.arange(k, dtype=torch.float64))  # later groups rarer
    probs = probs * prior
    return probs / probs.sum(-1, keepdim=True)


@st.composite
def problems(draw):
    hkv = draw(st.integers(1, 2))
    k_groups = draw(st.integers(1, 9))
    mode = draw(st.sampled_from(["hard", "hard", "soft", "hard_gated"]))
    top_k = 1 if mode == "soft" else draw(st.integers(1, min(3, k_groups)))
    n = draw(st.integers(1, 90))
    return dict(
        b=draw(st.integers(1, 3)),
        n=n,
        hkv=hkv,
        h=hkv * draw(st.integers(1, 3)),
        d=draw(st.sampled_from([4, 8, 16])),
        k_groups=k_groups,
        top_k=top_k,
        window=draw(st.sampled_from([0, 1, 7, 16, n, n + 5])),
        mode=mode,
        local_only=draw(st.sampled_from([False, False, False, True])),
        softcap=draw(st.sampled_from([None, None, 2.0])),
        skew=draw(st.sampled_from([0.0, 0.0, 1.5, 4.0])),
        sinks=draw(st.sampled_from([0, 0, 1, 3, 20])),
        key_groups=draw(st.sampled_from(["own", "own", "own_and_previous"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# registered backends that the random cases here leave out, and where they meet the reference
CHECKED_ELSEWHERE = {
    "triton": "tests/unit/test_soft_triton.py (Triton's interpreter is slow)",
    "sdpa": "tests/unit/test_sdpa_backend.py (no log-sum-exp, which these cases compare)",
}


def backend_names(p: dict, dtype: torch.dtype = torch.float32) -> list[str]:
    """The registered backends that say they run ``p`` exactly on this CPU (the registry's own
    answer, so a new backend is checked here as soon as it registers), but the reference."""
    req = request(
        dtype=dtype, batch=p["b"], seq=p["n"], heads=p["h"], heads_kv=p["hkv"], head_dim=p["d"],
        mode=p["mode"], top_k=p["top_k"], local_only=p["local_only"], window=p["window"],
        softcap=p["softcap"] is not None, sinks=p.get("sinks", 0),
        key_groups="own" if p["local_only"] else p.get("key_groups", "own"),
    )  # fmt: skip
    names = [
        name
        for name in available_backends()
        if name != "reference"
        and name not in CHECKED_ELSEWHERE
        and get_backend(name).refusal(req) is None
    ]
    assert "flex" in names  # CPU FlexAttention runs every pattern forward: never an empty check
    return names


def test_every_registered_backend_is_checked_against_the_reference():
    assert set(CHECKED_ELSEWHERE) <= set(available_backends())
    local = problem(local_only=True)  # a sliding-window layer: all but the routed-only ones
    routed = problem(mode="hard_gated", top_k=1)  # sparse training top-1: segments, flex
    checked = set(backend_names(local)) | set(backend_names(routed))
    assert checked | set(CHECKED_ELSEWHERE) | {"reference"} == set(available_backends())


def run(p: dict, backend: str, dtype: torch.dtype):
    q, k, v = random_qkv(p["b"], p["n"], p["h"], p["hkv"], p["d"], seed=p["seed"], dtype=dtype)
    probs = skewed_probs(p["b"], p["n"], p["k_groups"], seed=p["seed"] + 1, skew=p["skew"])
    return focus_attention(
        q,
        k,
        v,
        Routing(probs.float()),
        window=p["window"],
        mode=p["mode"],
        top_k=p["top_k"],
        softcap=p["softcap"],
        local_only=p["local_only"],
        gate_lambda=6.0,
        backend=backend,
        return_lse=True,
        sinks=p.get("sinks", 0),
        key_groups=p.get("key_groups", "own"),
    )


def problem(**overrides) -> dict:
    base = dict(b=2, n=150, hkv=2, h=4, d=32, k_groups=4, top_k=1, window=20, mode="hard",
                local_only=False, softcap=None, skew=1.0, seed=7)  # fmt: skip
    return {**base, **overrides}


def assert_matches_reference(p: dict, names: list[str]) -> None:
    """fp32: each backend's output and log-sum-exp equal the reference's (1e-5)."""
    with torch.no_grad():
        want, want_lse = run(p, "reference", torch.float32)
        for name in names:
            got, lse = run(p, name, torch.float32)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
            torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5, msg=name)


@settings(max_examples=60, deadline=None)
@given(problems())
def test_backends_equal_reference_fp32(p):
    assert_matches_reference(p, backend_names(p))


@pytest.mark.parametrize(
    "mode, top_k, local_only",
    [("hard", 1, False), ("hard", 2, False), ("soft", 1, False), ("hard", 1, True),
     ("hard_gated", 2, False)],
)  # fmt: skip
def test_backends_equal_reference_bf16(mode, top_k, local_only):
    p = problem(mode=mode, top_k=top_k, local_only=local_only)
    with torch.no_grad():
        want, _ = run(p, "reference", torch.bfloat16)
        exact, _ = run(p, "reference", torch.float32)
        for name in backend_names(p, torch.bfloat16):
            got, _ = run(p, name, torch.bfloat16)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            # no worse than the reference's own bf16 rounding, measured against fp32
            err = (got.float() - exact).abs().max()
            assert err <= 2 * (want.float() - exact).abs().max() + 1e-2


@pytest.mark.parametrize("sinks", [1, 3, 40])  # 40: more sinks than the window
@pytest.mark.parametrize(
    "mode, top_k, local_only, softcap",
    [("hard", 1, False, None), ("hard", 2, False, 2.0), ("soft", 1, False, 2.0),
     ("hard", 1, True, None), ("hard", 3, False, None), ("hard_gated", 1, False, 2.0),
     ("hard_gated", 3, False, None)],
)  # fmt: skip
def test_backends_with_sinks_equal_reference(sinks, mode, top_k, local_only, softcap):
    """Attention sinks in every backend: output and log-sum-exp equal the reference's, which
    equals the brute force (test_reference_exact.py), and the sinks change the result."""
    p = problem(mode=mode, top_k=top_k, local_only=local_only, softcap=softcap, sinks=sinks,
                k_groups=6)  # fmt: skip
    assert_matches_reference(p, backend_names(p))
    with torch.no_grad():
        plain, _ = run({**p, "sinks": 0}, "reference", torch.float32)
        want, _ = run(p, "reference", torch.float32)
    assert (plain - want).abs().max() > 1e-3


def test_sink_attention_chunking_does_not_change_the_result():
    q, k, v = random_qkv(2, 120, 4, 2, 8, seed=13, dtype=torch.float32)
    member = Routing(random_probs(2, 120, 4, seed=14)).membership(1)
    kwargs = dict(window=10, sinks=5, scale=0.3, softcap=None, member=member)
    whole = sink_attention(q, k, v, **kwargs)
    chunked = sink_attention(q, k, v, max_scores=2 * 4 * 5 * 7, **kwargs)  # 7 rows at a time
    assert torch.isneginf(whole[1][:, :11]).all() and torch.isfinite(whole[1][:, 11:]).any()
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_document_sinks_chunking_does_not_change_the_result():
    q, k, v = random_qkv(2, 120, 4, 2, 8, seed=15, dtype=torch.float32)
    member = Routing(random_probs(2, 120, 4, seed=16)).membership(1)
    documents = document_starts(random_documents(2, 120, 0.05, seed=17))
    kwargs = dict(window=10, sinks=5, scale=0.3, softcap=None, member=member, documents=documents)
    whole = sink_attention(q, k, v, **kwargs)
    chunked = sink_attention(q, k, v, max_scores=2 * 5 * (4 + 2 * 2 * 8) * 7, **kwargs)  # 7 rows
    assert torch.isfinite(whole[1]).any()
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [1, 5])
def test_sequence_shorter_than_window_and_single_token(n):
    p = problem(n=n, hkv=1, h=2, d=8, k_groups=3, window=128, skew=0.0, seed=n)
    assert_matches_reference(p, ["decomposed", "flex"])


def test_decomposed_many_segments_batch_gqa():
    """Many segments (K = 16, uneven), batch 3, GQA 8:2, several band blocks."""
    p = problem(b=3, n=700, h=8, d=16, k_groups=16, window=40, skew=0.5, seed=3)
    assert_matches_reference(p, ["decomposed"])


def test_band_chunking_does_not_change_the_result():
    q, k, v = random_qkv(2, 300, 4, 2, 8, seed=11, dtype=torch.float32)
    member = Routing(random_probs(2, 300, 4, seed=12)).membership(1)
    kwargs = dict(window=50, scale=0.3, softcap=None, member=member)
    whole = band_attention(q, k, v, **kwargs)
    chunked = band_attention(
        q, k, v, block=16, max_scores=2 * 4 * 16 * 66 * 3, **kwargs
    )  # 3 blocks
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_sorted_layout_is_stable_and_invertible():
    member = 1 << torch.randint(0, 5, (3, 50))
    layout = GroupSortedLayout.build(member)
    x = torch.randn(3, 50, 2)
    torch.testing.assert_close(layout.unpack(layout.pack(x)), x, rtol=0, atol=0)
    packed, rebuilt = layout.pack(x), torch.full((150, 2), float("nan"))
    for bucket in layout.padded_buckets():
        padded = bucket.to_padded(packed)
        assert bucket.length <= 2 * (padded.abs().sum(-1) > 0).sum(1).min()  # < 2x padding
        bucket.scatter(padded, rebuilt)
    torch.testing.assert_close(rebuilt, packed, rtol=0, atol=0)  # every token exactly once
    for s in range(layout.num_segments):
        lo, hi = layout.cu_seqlens[s], layout.cu_seqlens[s + 1]
        if lo == hi:
            continue  # an empty entry of the fixed table
        assert (layout.member[lo:hi] == layout.member[lo]).all()
        assert (layout.sample[lo:hi] == layout.sample[lo]).all()
        assert (layout.position[lo:hi].diff() > 0).all()  # stable: causal order kept
    used = layout.segment_lengths() > 0  # the fixed table's empty entries skipped
    assert int(used.sum()) == sum(len(row.unique()) for row in member)
    assert (layout.cu_seqlens.diff() >= 0).all() and layout.cu_seqlens[-1] == 150


def test_sorted_layout_table_is_fixed_by_its_bound():
    """A bound of ``C(K, top_k)`` slots per sample: ``b * slots + 1`` offsets whatever the data
    (here one sample uses 1 group of 5, the other all 5), each sample's segments in its slots."""
    member = torch.stack([torch.full((40,), 4), 1 << torch.arange(40) % 5])  # [2, 40]
    layout = GroupSortedLayout.build(member, slots=5)
    assert layout.cu_seqlens.shape == (2 * 5 + 1,) and layout.max_seqlen == 40
    assert layout.segment_lengths().tolist() == [40, 0, 0, 0, 0, 8, 8, 8, 8, 8]
    assert torch.equal(layout.segment // 5, layout.sample)  # sample i owns slots [5i, 5i + 5)


@st.composite
def document_problems(draw):
    """Hard top-1 or sliding-window problems on packed documents (decomposed vs reference)."""
    n = draw(st.integers(1, 90))
    hkv = draw(st.integers(1, 2))
    local_only = draw(st.sampled_from([False, False, True]))
    return dict(
        b=draw(st.integers(1, 3)),
        n=n,
        hkv=hkv,
        h=hkv * draw(st.integers(1, 3)),
        d=draw(st.sampled_from([4, 8])),
        k_groups=draw(st.integers(1, 9)),
        window=draw(st.sampled_from([0, 1, 7, 16, n + 5])),
        local_only=local_only,
        softcap=draw(st.sampled_from([None, 2.0])) if local_only else None,
        sinks=draw(st.sampled_from([0, 1, 3, 20])),
        new_doc=draw(st.sampled_from([0.0, 0.05, 0.3, 0.9])),  # 0.9: mostly 1-token documents
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def random_documents(b: int, n: int, new_doc: float, *, seed: int) -> torch.Tensor:
    """``[b, n]`` document ids: each token starts a new document with probability ``new_doc``
    (every sample its own layout)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.cumsum(torch.rand(b, n, generator=gen) < new_doc, dim=1)  # [b, n]


def run_documents(p: dict, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = random_qkv(p["b"], p["n"], p["h"], p["hkv"], p["d"], seed=p["seed"],
                         dtype=torch.float32)  # fmt: skip
    probs = skewed_probs(p["b"], p["n"], p["k_groups"], seed=p["seed"] + 1, skew=1.0)
    documents = random_documents(p["b"], p["n"], p["new_doc"], seed=p["seed"] + 2)
    with torch.no_grad():
        return focus_attention(
            q,
            k,
            v,
            Routing(probs.float()),
            window=p["window"],
            mode="hard",
            top_k=1,
            softcap=p["softcap"],
            local_only=p["local_only"],
            backend=backend,
            return_lse=True,
            sinks=p["sinks"],
            documents=documents,
        )


@settings(max_examples=40, deadline=None)
@given(document_problems())
def test_decomposed_with_documents_equals_reference(p):
    """Packed documents (of one token, shorter than the window, different per sample), GQA,
    per-document sinks: the decomposed output and log-sum-exp equal the reference's."""
    want, want_lse = run_documents(p, "reference")
    got, lse = run_documents(p, "decomposed")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_auto_picks_decomposed_for_long_packed_documents():
    n = CPU_DECOMPOSED_MIN_SEQ + 76
    assert select_backend("auto", request(seq=n, documents=True, sinks=2)).name == "decomposed"
    p = dict(b=2, n=n, h=4, hkv=2, d=8, k_groups=6, window=24, local_only=False, softcap=None,
             sinks=2, new_doc=0.01, seed=5)  # fmt: skip
    want, want_lse = run_documents(p, "reference")
    got, lse = run_documents(p, "auto")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_sorted_layout_keeps_documents_apart():
    member = 1 << torch.randint(0, 4, (2, 60))
    documents = document_starts(random_documents(2, 60, 0.1, seed=3))
    layout = GroupSortedLayout.build(member, documents)
    assert torch.equal(layout.document, layout.pack(documents))
    for s in range(layout.num_segments):
        lo, hi = layout.cu_seqlens[s], layout.cu_seqlens[s + 1]
        if lo == hi:
            continue  # an empty entry of the fixed table
        assert (layout.member[lo:hi] == layout.member[lo]).all()
        assert (layout.sample[lo:hi] == layout.sample[lo]).all()
        assert (layout.document[lo:hi] == layout.document[lo]).all()
        assert (layout.position[lo:hi].diff() > 0).all()  # stable: causal order kept
    keys = torch.stack([documents, member], dim=-1)  # [2, 60, 2]: (document, group) per token
    used = layout.segment_lengths() > 0  # the fixed table's empty entries skipped
    assert int(used.sum()) == sum(len(row.unique(dim=0)) for row in keys)


def test_merge_of_empty_parts():
    out = torch.randn(1, 3, 2, 4)
    lse = torch.randn(1, 3, 2)
    empty = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    merged, merged_lse = merge_by_lse((out, lse), empty)
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(merged_lse, lse)
    nothing, nothing_lse = merge_by_lse(empty, empty)
    assert (nothing == 0).all() and torch.isneginf(nothing_lse).all()


def dense_blocks(mask) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept, full)`` ``[nq, nk]`` bool block matrices of a BlockMask."""

    def to_dense(num, idx):
        nb = idx.shape[-1]
        dense = torch.zeros(num.shape[-1], nb, dtype=torch.bool)
        for row in range(num.shape[-1]):
            dense[row, idx[0, 0, row, : num[0, 0, row]].long()] = True
        return dense

    partial = to_dense(mask.kv_num_blocks, mask.kv_indices)
    full = torch.zeros_like(partial)
    if mask.full_kv_num_blocks is not None:
        full = to_dense(mask.full_kv_num_blocks, mask.full_kv_indices)
    assert not (partial & full).any()
    return partial | full, full


def check_block_mask(mask, allowed: torch.Tensor, block: int) -> None:
    """Every allowed pair of ``allowed [T, T]`` in a kept block; full blocks all allowed."""
    kept, full = dense_blocks(mask)
    t = allowed.shape[0]
    pad = kept.shape[0] * block - t

    def per_block(padding: bool) -> torch.Tensor:  # [nq, block, nk, block]
        padded = torch.nn.functional.pad(allowed, (0, pad, 0, pad), value=padding)
        return padded.view(kept.shape[0], block, kept.shape[1], block)

    any_allowed = per_block(False).any(dim=3).any(dim=1)
    all_allowed = per_block(True).all(dim=3).all(dim=1)  # padding rows/columns never computed
    assert not (any_allowed & ~kept).any(), "an allowed pair lies in a skipped block"
    assert not (full & ~all_allowed).any(), "a full block holds a disallowed pair"
    return kept


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("block", [8, 32])
def test_same_group_block_mask_covers_pattern(top_k, block):
    b, n, groups = 2, 160, 6
    probs = skewed_probs(b, n, groups, seed=top_k, skew=0.7)
    member = Routing(probs).membership(top_k)
    layout = GroupSortedLayout.build(member)
    mask = same_group_block_mask(layout, block)
    # allowed pairs that share a group, in the packed layout: brute force from the pattern
    gpos = layout.sample * n + layout.position
    shares = (layout.member[:, None] & layout.member[None, :]) != 0
    same_sample = layout.sample[:, None] == layout.sample[None, :]
    allowed = shares & same_sample & (gpos[:, None] >= gpos[None, :])
    check_block_mask(mask, allowed, block)


@pytest.mark.parametrize("top_k, most", [(1, 1.1), (2, 1.1)])
def test_same_group_block_mask_is_tight(top_k, most):
    """At realistic segment lengths (many blocks each) the mask keeps about the needed blocks."""
    n, groups, block = 2048, 4, 16
    member = Routing(random_probs(1, n, groups, seed=top_k, sharpness=3.0)).membership(top_k)
    layout = GroupSortedLayout.build(member)
    gpos = layout.position
    allowed = ((layout.member[:, None] & layout.member[None, :]) != 0) & (
        gpos[:, None] >= gpos[None, :]
    )
    kept = check_block_mask(same_group_block_mask(layout, block), allowed, block)
    nb = kept.shape[0]
    needed = allowed.view(nb, block, nb, block).any(dim=3).any(dim=1)
    assert kept.sum() <= most * needed.sum()
    causal_blocks = nb * (nb + 1) / 2
    density = allowed.sum() / (n * (n + 1) / 2)
    # the pair-count ideal in blocks, plus the partial blocks where two segments' positions
    # interleave (about two per segment and block row; negligible at long lengths)
    segments = int((layout.segment_lengths() > 0).sum())
    assert kept.sum() <= density * causal_blocks + 2 * segments * nb


@pytest.mark.parametrize("window", [0, 5, 40, 1000])
@pytest.mark.parametrize("cross", [False, True])
def test_band_block_mask_covers_band(window, cross):
    n, block = 150, 16
    member = Routing(random_probs(1, n, 4, seed=window)).membership(1)
    mask = band_block_mask(n, window, member if cross else None, torch.device("cpu"), block)
    positions = torch.arange(n)
    allowed = allowed_pairs(positions, positions, window, local_only=True)[0]
    if cross:
        allowed = allowed & ((member[0][:, None] & member[0][None, :]) == 0)
    kept = check_block_mask(mask, allowed, block)
    assert kept.sum() <= kept.shape[0] * (window // block + 2)  # O(n w), not O(n^2)


def test_compiled_cpu_flex_skips_blocks_exactly():
    """The compiled CPU kernel honours the sparse block mask (eager ignores it): still exact."""
    b, n, h, d, groups = 2, 96, 2, 16, 4
    q, k, v = random_qkv(b, n, h, h, d, seed=5, dtype=torch.float32)
    member = Routing(random_probs(b, n, groups, seed=6, sharpness=3.0)).membership(2)
    layout = GroupSortedLayout.build(member)
    mask = same_group_block_mask(layout, 16)
    packed = [layout.pack(t).transpose(0, 1)[None] for t in (q, k, v)]  # [1, H, T, D]
    compiled = torch.compile(flex_attention, dynamic=False)
    got = compiled(*packed, block_mask=mask, scale=0.25)
    eager = flex_attention(*packed, block_mask=mask, scale=0.25)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)


def request(**overrides) -> AttentionRequest:
    base = dict(
        device="cpu",
        dtype=torch.float32,
        batch=1,
        seq=4096,
        heads=8,
        heads_kv=8,
        head_dim=64,
        mode="hard",
        top_k=1,
        local_only=False,
        window=128,
        softcap=False,
        needs_grad=False,
    )
    return AttentionRequest(**{**base, **overrides})


def test_auto_selection_on_cpu():
    assert select_backend("auto", request()).name == "decomposed"
    assert select_backend("auto", request(seq=128)).name == "reference"
    assert select_backend("auto", request(top_k=2)).name == "reference"
    assert select_backend("auto", request(mode="soft")).name == "reference"
    # differentiable top-1 on the sorted layout: hard with gradients, sparse training
    assert select_backend("auto", request(needs_grad=True)).name == "segments"
    assert select_backend("auto", request(softcap=True)).name == "segments"
    gated = dict(mode="hard_gated", needs_grad=True)
    assert select_backend("auto", request(**gated)).name == "segments"
    assert select_backend("auto", request(**gated, seq=128)).name == "reference"
    assert select_backend("auto", request(**gated, top_k=2)).name == "reference"
    assert select_backend("auto", request(sinks=4)).name == "decomposed"  # exact with sinks
    assert select_backend("auto", request(sinks=4, top_k=2)).name == "reference"
    with pytest.raises(ValueError, match="'decomposed' cannot run mode='hard', top_k=2"):
        select_backend("decomposed", request(top_k=2))
    with pytest.raises(ValueError, match=r"'flex' cannot run .*needs_grad=True"):
        select_backend("flex", request(needs_grad=True))
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        select_backend("fast", request())


def test_hard_mode_with_gradients_uses_an_exact_differentiable_backend():
    q, k, v = random_qkv(1, 1100, 2, 2, 8, seed=1, dtype=torch.float32, requires_grad=True)
    probs = random_probs(1, 1100, 4, seed=2).float()
    out = focus_attention(q, k, v, Routing(probs), window=16, mode="hard")  # auto: segments
    out.square().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "mode, top_k",
    [("soft", 1), ("hard", 1), ("hard", 2), ("hard_gated", 1), ("hard_gated", 2),
     ("hard_gated", 3)],
)  # fmt: skip
@pytest.mark.parametrize("softcap, sinks", [(None, 0), (3.0, 0), (None, 4)])
def test_flex_gradients_equal_reference_on_gpu(mode, top_k, softcap, sinks):
    """FlexAttention's backward (GPU only): q, k, v and, in the gated modes, the assignments."""
    assert_flex_gradients_equal_reference(mode=mode, top_k=top_k, softcap=softcap, sinks=sinks)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode, top_k", [("soft", 1), ("hard", 2), ("hard_gated", 1)])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "documents"])
def test_flex_gradients_with_the_keys_rule_equal_reference_on_gpu(mode, top_k, packed):
    """``key_groups="own_and_previous"`` (the keys on their own sorted layout, the gate on the
    keys' assignments): flex's backward equals the reference's, sinks on, packed or not."""
    documents = packed_documents(2, [300, 17, 383], seed=3) if packed else None
    assert_flex_gradients_equal_reference(
        mode=mode, top_k=top_k, sinks=4, key_groups="own_and_previous", documents=documents
    )


def assert_flex_gradients_equal_reference(
    n: int = 700, documents: torch.Tensor | None = None, local_only: bool = False, **kwargs
) -> None:
    """GPU: flex's output and gradients (q, k, v; the assignments in soft mode) equal the
    reference's (2e-4) on random ``[2, n]`` inputs, window 64; ``kwargs``: mode, top_k,
    softcap, sinks; ``documents``: packed document ids ``[2, n]``."""
    b, h, hkv, d = 2, 4, 2, 64
    q, k, v = (t.cuda() for t in random_qkv(b, n, h, hkv, d, seed=1, dtype=torch.float32))
    probs = random_probs(b, n, 8, seed=2, sharpness=3.0).float().cuda()
    extra = {} if documents is None else {"documents": documents.cuda()}
    grads = {}
    for name in ("reference", "flex"):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, probs)]
        out = focus_attention(
            *leaves[:3], Routing(leaves[3]), window=64, local_only=local_only, backend=name,
            **kwargs, **extra,
        )  # fmt: skip
        (out * torch.linspace(-1, 1, d, device="cuda")).sum().backward()
        gated = kwargs["mode"] in ("soft", "hard_gated")
        differentiable = 4 if gated and not local_only else 3
        grads[name] = [out] + [t.grad for t in leaves[:differentiable]]
    for want, got in zip(grads["reference"], grads["flex"], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("sinks", [0, 4])
def test_fast_backends_on_gpu(dtype, top_k, sinks):
    b, n, h, hkv, d = 2, 3000, 8, 2, 64
    q, k, v = (t.cuda() for t in random_qkv(b, n, h, hkv, d, seed=3, dtype=dtype))
    routing = Routing(random_probs(b, n, 8, seed=4, sharpness=3.0).float().cuda())
    kwargs = dict(window=128, mode="hard", top_k=top_k, sinks=sinks)
    with torch.no_grad():
        want = focus_attention(q, k, v, routing, backend="reference", **kwargs).float()
        for name in ["flex", "auto"] + (["decomposed"] if top_k == 1 else []):
            got = focus_attention(q, k, v, routing, backend=name, **kwargs).float()
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)


def test_backend_config_names_match_the_registry_and_refuse_bad_choices():
    from focus_pretrain.focus import FocusConfig, available_backends
    from focus_pretrain.focus import config as focus_config
    from focus_pretrain.focus.backends import backend_names, training_backend_names

    assert sorted(backend_names()[1:]) == available_backends()
    for alias, reader in [
        ("BACKEND_NAMES", backend_names),
        ("TRAINING_BACKENDS", training_backend_names),
    ]:
        with pytest.warns(
            DeprecationWarning, match=rf"{alias} is deprecated .*backends\.{reader.__name__}\(\)"
        ):
            assert getattr(focus_config, alias) == reader()  # the one-release alias
    with pytest.raises(ValueError, match=r"focus\.backend must be one of"):
        FocusConfig(backend="decomposed")  # the soft training gate has no decomposed form
    with pytest.raises(ValueError, match="'decomposed' computes hard top-1 attention only"):
        FocusConfig(inference_backend="decomposed", top_k=2)
    assert FocusConfig(inference_backend="decomposed").inference_backend == "decomposed"


NEW_BACKEND = """
import torch
from focus_pretrain.focus import FocusConfig, focus_attention
from focus_pretrain.focus.backends import (
    Backend, Capabilities, backend_names, register_backend, ring_backend_names, select_backend,
)
from focus_pretrain.focus.reference import reference_attention

calls = []

def mine(q, k, v, pattern):  # a new backend's module: here, the reference under a new name
    calls.append(pattern.mode)
    return reference_attention(q, k, v, pattern)

modes = frozenset({"soft", "hard", "hard_gated", "local"})
register_backend(Backend("mine", mine, Capabilities(modes), lambda r: -100, "blockwise"))
assert "mine" in backend_names() and "mine" in ring_backend_names()
FocusConfig(backend="mine", inference_backend="mine", training_mode="hard")  # validated
gen = torch.Generator().manual_seed(3)
q, k, v = (torch.randn(2, 40, 4, 16, generator=gen, requires_grad=True) for _ in range(3))
probs = torch.softmax(torch.randn(2, 40, 4, generator=gen), -1).requires_grad_()
for mode in ("soft", "hard", "hard_gated"):
    outs = [
        focus_attention(q, k, v, probs, window=6, mode=mode, sinks=2, backend=b)
        for b in ("mine", "reference")
    ]
    inputs = (q, k, v, probs)
    grads = [torch.autograd.grad(o.square().sum(), inputs, allow_unused=True) for o in outs]
    assert torch.equal(outs[0], outs[1]), mode
    for a, b in zip(*grads):
        assert (a is None and b is None) or torch.equal(a, b), mode
assert calls == ["soft", "hard", "hard_gated"]
from focus_pretrain.parallel.context_parallel import ring_block_kernel
from focus_pretrain.convert.hf_export import _focus_section
assert ring_block_kernel("mine") == "blockwise"
assert _focus_section(FocusConfig(backend="mine", inference_backend="mine"))["backend"] == "auto"
print("ok")
"""


def test_a_new_backend_is_its_function_and_one_registration():
    """docs/architecture.md's walk-through, run: a function and one ``register_backend`` (in a
    fresh process: the registry is global) make a backend that ``focus.backend`` accepts, the
    dispatcher runs by name (exactly the reference here, values and gradients), the ring steps
    with its ``ring_block`` kernel and the export maps to ``auto``; no other file changes."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", NEW_BACKEND], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
