"""``key_groups="own_and_previous"``: a key also counts as in its predecessor's groups.

The rule (:mod:`focus_pretrain.focus.pattern`, "Key groups") against the brute-force loop
(which writes it from the spec alone), with packed documents, sinks, GQA and soft-capping, in
the three patterns; its gradients against finite differences; the backends that do not compute
it refuse it by name, and ``auto`` picks one that does; the recipe and the ring refuse what
they cannot run, each in one line; the export takes it (its shipped code:
tests/unit/test_hf_generation.py, test_hf_static_*.py, tests/multiprocess/test_hf_import.py).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import flex_attention

from focus_pretrain.analysis.groups import kept_pairs_by_distance
from focus_pretrain.config import load_config
from focus_pretrain.convert.exportable import export_refusal
from focus_pretrain.focus import Routing, flex, focus_attention
from focus_pretrain.focus.backends import available_backends, get_backend
from focus_pretrain.focus.config import FocusConfig
from focus_pretrain.focus.pattern import (
    allowed_pairs,
    count_allowed_pairs,
    document_starts,
    key_assignments,
    key_memberships,
    membership_bitmask,
    pattern_density,
)
from focus_pretrain.focus.pattern_settings import FocusPattern
from focus_pretrain.focus.sorted_layout import GroupSortedLayout, segment_slots
from focus_pretrain.parallel.ring import ring_focus_attention
from tests.helpers import brute_force_focus, packed_documents, random_probs, random_qkv
from tests.unit.test_backends import check_block_mask, dense_blocks
from tests.unit.test_reference_exact import problems  # the reference's random problems

OWN_AND_PREVIOUS = "own_and_previous"
ROOT = pathlib.Path(__file__).parents[2]


@settings(max_examples=60, deadline=None)
@given(problems(), st.booleans())
def test_reference_equals_brute_force(p, documents):
    """The reference's random problems (shapes, K, top_k, window, mode, local-only, sinks,
    soft-cap), with packed documents or not."""
    q, k, v = random_qkv(p["b"], p["s"], p["h"], p["hkv"], p["d"], seed=p["seed"])
    probs = random_probs(p["b"], p["s"], p["k_groups"], seed=p["seed"] + 1, sharpness=2.0)
    ids = None
    if documents:
        ids = packed_documents(p["b"], [max(1, p["s"] // 3), p["s"]], seed=p["seed"])[:, : p["s"]]
    kwargs = dict(
        window=p["window"], mode=p["mode"], gate_lambda=p["gate_lambda"], softcap=p["softcap"],
        sinks=p["sinks"], top_k=p["top_k"], local_only=p["local_only"],
    )  # fmt: skip
    want = brute_force_focus(
        q, k, v, probs, key_groups=OWN_AND_PREVIOUS, **kwargs,
        documents=None if ids is None else ids.tolist(),
    )  # fmt: skip
    got = focus_attention(
        q, k, v, Routing(probs), key_groups=OWN_AND_PREVIOUS, documents=ids, **kwargs
    )
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    own = brute_force_focus(
        q, k, v, probs, **kwargs, documents=None if ids is None else ids.tolist()
    )  # the loop's two rules differ on these inputs, or the test above could not fail
    routed = not p["local_only"] and p["k_groups"] > 1 and p["mode"] == "soft"
    if routed and p["s"] >= p["window"] + 4 and not p["sinks"] and ids is None:
        assert not torch.allclose(own, want)


def test_the_rules_differ_where_they_should():
    """Hard top-1, window 0: a query sees the key after a token of its group, not that token's
    predecessor; a document's first token takes nothing from the document before it."""
    b, s, k_groups = 1, 8, 3
    groups = torch.tensor([[0, 1, 2, 0, 1, 2, 1, 0]])
    member = membership_bitmask(groups[..., None])  # [1, 8]
    keys = key_memberships(member)
    assert keys.tolist() == [[1, 3, 6, 5, 3, 6, 6, 3]]
    starts = document_starts(torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]]))
    assert key_memberships(member, starts).tolist() == [[1, 3, 6, 5, 2, 6, 6, 3]]
    probs = torch.nn.functional.one_hot(groups, k_groups).double()  # [1, 8, 3]
    soft_keys = key_assignments(probs, starts)
    assert torch.equal(membership_from(soft_keys), key_memberships(member, starts))
    q, k, v = random_qkv(b, s, 2, 1, 4, seed=0)
    own = focus_attention(q, k, v, probs, mode="hard", window=0)
    shifted = focus_attention(q, k, v, probs, mode="hard", window=0, key_groups=OWN_AND_PREVIOUS)
    assert torch.equal(own[:, 0], shifted[:, 0])  # position 0 sees itself alone either way
    assert not torch.allclose(own[:, 4], shifted[:, 4])  # query 4 (group 1) also sees key 2


def membership_from(soft: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` bitmasks of the groups whose soft assignment is 1 (one-hot inputs)."""
    bits = (soft > 0.5).long() << torch.arange(soft.shape[-1])
    return bits.sum(-1)


@pytest.mark.parametrize("mode", ["soft", "hard_gated"])
def test_gradients_match_finite_differences(mode):
    q, k, v = (t.requires_grad_() for t in random_qkv(1, 9, 2, 1, 3, seed=4))
    logits = torch.randn(1, 9, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    logits.requires_grad_()
    ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1]])

    def attend(q, k, v, logits):
        probs = torch.softmax(logits, -1)
        return focus_attention(
            q, k, v, probs, mode=mode, window=1, gate_lambda=4.0, sinks=1, documents=ids,
            key_groups=OWN_AND_PREVIOUS, backend="reference",
        )  # fmt: skip

    assert torch.autograd.gradcheck(attend, (q, k, v, logits))


@pytest.mark.parametrize("mode", ["soft", "hard", "hard_gated"])
def test_backends_without_the_rule_refuse_it_and_auto_picks_one_with_it(mode):
    q, k, v = random_qkv(1, 16, 2, 1, 4, seed=1)
    probs = random_probs(1, 16, 4, seed=2)
    kwargs = dict(mode=mode, window=2, key_groups=OWN_AND_PREVIOUS)
    want = focus_attention(q, k, v, probs, backend="reference", **kwargs)
    torch.testing.assert_close(focus_attention(q, k, v, probs, **kwargs), want)
    refusing = [
        name
        for name in available_backends()
        if OWN_AND_PREVIOUS not in get_backend(name).capabilities.key_groups
    ]
    assert "decomposed" in refusing and not {"reference", "flex"} & set(refusing)
    for name in refusing:
        with pytest.raises(ValueError, match="key_groups='own_and_previous'"):
            focus_attention(q, k, v, probs, backend=name, **kwargs)


def test_sliding_window_layers_ignore_the_rule():
    q, k, v = random_qkv(1, 12, 2, 2, 4, seed=3)
    kwargs = dict(local_only=True, window=3, sinks=1)
    for name in ("reference", "flex", "decomposed"):
        got = focus_attention(q, k, v, None, backend=name, key_groups=OWN_AND_PREVIOUS, **kwargs)
        torch.testing.assert_close(got, focus_attention(q, k, v, None, **kwargs))


def test_settings_are_checked():
    with pytest.raises(ValueError, match="key_groups must be one of"):
        FocusPattern(key_groups="previous").check()
    with pytest.raises(ValueError, match="needs gate_form='sigmoid'"):
        FocusPattern(key_groups=OWN_AND_PREVIOUS, gate_form="dot").check()
    with pytest.raises(ValueError, match=r"focus.key_groups must be one of"):
        FocusConfig(key_groups="both")
    with pytest.raises(ValueError, match=r"needs focus.gate_form='sigmoid'"):
        FocusConfig(key_groups=OWN_AND_PREVIOUS, gate_form="dot")
    with pytest.raises(ValueError, match=r"focus.inference_backend 'decomposed' does not comp"):
        FocusConfig(key_groups=OWN_AND_PREVIOUS, inference_backend="decomposed")
    config = FocusConfig(key_groups=OWN_AND_PREVIOUS, backend="reference")
    assert config.pattern().key_groups == OWN_AND_PREVIOUS


def test_the_ring_refuses_the_rule_and_a2a_and_the_export_take_it():
    recipe = ROOT / "configs" / "tiny.yaml"
    rule = [f"model.focus.key_groups={OWN_AND_PREVIOUS}"]
    cp = ["parallel.context_parallel_size=2"]
    sinkhorn = ["model.focus.balance=sinkhorn"]
    with pytest.raises(ValueError, match=r"key_groups 'own_and_previous' does not run inside"):
        load_config(recipe, [*rule, *cp, "parallel.cp_mode=ring"])
    config = load_config(recipe, [*rule, *cp, "parallel.cp_mode=a2a"])
    assert export_refusal(config) is None  # the shipped modeling code computes the rule
    assert "balance=sinkhorn" in export_refusal(load_config(recipe, [*rule, *sinkhorn]))
    q, k, v = random_qkv(1, 8, 2, 2, 4, seed=6)
    with pytest.raises(ValueError, match="use cp_mode 'a2a'"):
        ring_focus_attention(
            q, k, v, random_probs(1, 8, 3, seed=7), FocusPattern(key_groups=OWN_AND_PREVIOUS),
            group=None,
        )  # fmt: skip  # refused before any communication


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("top_k", [1, 2])
def test_kept_pairs_count_the_keys_groups(documents, top_k):
    """count_allowed_pairs and pattern_density with the keys' own bitmasks equal the pairs the
    rule allows, counted pair by pair; the group report's distance profile sums to them."""
    n, window, sinks = 37, 3, 2
    probs = random_probs(2, n, 5, seed=8)
    member = Routing(probs).membership(top_k)  # [2, n]
    starts = document_starts(packed_documents(2, [9, 1, 27], seed=9)) if documents else None
    keys = key_memberships(member, starts)
    pos = torch.arange(n)
    allowed = allowed_pairs(
        pos, pos, window, member_q=member, member_k=keys, sinks=sinks, q_doc=starts,
        k_doc=starts,
    )  # fmt: skip  # [2, n, n]
    want = allowed.flatten(1).sum(1)
    assert torch.equal(count_allowed_pairs(member, window, sinks, starts, keys), want)
    assert not torch.equal(count_allowed_pairs(member, window, sinks, starts), want)
    if not documents:
        causal = n * (n + 1) / 2
        density = pattern_density(member, window, sinks, key_member=keys)
        torch.testing.assert_close(density, want.double() / causal)
        no_sinks = allowed_pairs(pos, pos, window, member_q=member, member_k=keys).sum()
        assert int(kept_pairs_by_distance(member, window, keys).sum()) == int(no_sinks)


def rule_layouts(b: int, n: int, groups: int, top_k: int, *, seed: int, documents: bool):
    """The queries' layout and the keys' own (sorted by the keys' bitmasks under the rule), as
    the flex backend builds them, with or without packed documents."""
    member = Routing(random_probs(b, n, groups, seed=seed, sharpness=3.0)).membership(top_k)
    starts = None
    if documents:
        starts = document_starts(packed_documents(b, [40, 7, n - 47], seed=seed))
    slots = segment_slots(groups, top_k, documents=documents, key_groups=OWN_AND_PREVIOUS)
    keys = GroupSortedLayout.build(key_memberships(member, starts), starts, slots=slots)
    return member, starts, GroupSortedLayout.build(member, starts), keys


def rule_pairs(rows: GroupSortedLayout, cols: GroupSortedLayout) -> torch.Tensor:
    """``[T, T]`` bool: the same-group pairs of the rule, queries in ``rows``' order and keys
    in ``cols``': a shared group, one sample, one document, the key not after the query."""
    shares = (rows.member[:, None] & cols.member[None, :]) != 0
    one_sample = rows.sample[:, None] == cols.sample[None, :]
    causal = rows.position[:, None] >= cols.position[None, :]
    allowed = shares & one_sample & causal
    if rows.document is not None:
        allowed &= rows.document[:, None] == cols.document[None, :]
    return allowed


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("block", [8, 32])
def test_flex_block_mask_with_the_keys_layout_covers_the_rule(documents, top_k, block):
    """Every pair the rule lets share a group lies in a kept block of the two layouts' mask,
    every full block holds only such pairs; the keys' table bound holds (distinct bitmasks)."""
    _, _, rows, cols = rule_layouts(2, 160, 6, top_k, seed=block + top_k, documents=documents)
    check_block_mask(flex.same_group_block_mask(rows, block, cols), rule_pairs(rows, cols), block)
    if not documents:  # the keys' distinct bitmasks fit the table bound
        used = int((cols.segment_lengths() > 0).sum())
        assert used <= 2 * segment_slots(6, top_k, documents=False, key_groups=OWN_AND_PREVIOUS)


@pytest.mark.parametrize("top_k", [1, 2])
def test_flex_block_mask_with_the_keys_layout_is_tight(top_k):
    """At segments longer than a block the two layouts' mask keeps about the blocks that hold
    an allowed pair; top-1 of 8 fewer than half of causal attention's. (Top-2 of 8 under the
    rule allows ~70% of the pairs of random routing: in sorted layouts, whose blocks mix
    distant positions, no fewer blocks than causal attention; docs/focus-method.md.)"""
    n, block = 2048, 16
    _, _, rows, cols = rule_layouts(1, n, 8, top_k, seed=top_k, documents=False)
    allowed = rule_pairs(rows, cols)
    mask = flex.same_group_block_mask(rows, block, cols)
    check_block_mask(mask, allowed, block)
    kept, _ = dense_blocks(mask)
    nb = kept.shape[0]
    needed = allowed.view(nb, block, nb, block).any(dim=3).any(dim=1)
    assert kept.sum() <= 1.2 * needed.sum()
    if top_k == 1:
        assert kept.sum() < 0.5 * nb * (nb + 1) / 2


def test_compiled_cpu_flex_with_the_keys_layout_skips_blocks_exactly():
    """The compiled CPU kernel skips the blocks the two layouts' mask leaves out (eager
    ignores them): the same result as eager, and as attention over the rule's pairs."""
    b, n, groups = 2, 96, 4
    *_, rows, cols = rule_layouts(b, n, groups, 2, seed=6, documents=True)
    q, k, v = random_qkv(b, n, 2, 2, 16, seed=5, dtype=torch.float32)
    mask = flex.same_group_block_mask(rows, 16, cols)
    packed = [
        layout.pack(t).transpose(0, 1)[None]  # [b, s, H, D] -> [1, H, b * s, D]
        for layout, t in ((rows, q), (cols, k), (cols, v))
    ]
    compiled = torch.compile(flex_attention, dynamic=False)
    got = compiled(*packed, block_mask=mask, scale=0.25)
    torch.testing.assert_close(
        got, flex_attention(*packed, block_mask=mask, scale=0.25), rtol=1e-5, atol=1e-5
    )
    scores = torch.einsum("hqd,hkd->hqk", packed[0][0], packed[1][0]) * 0.25  # [H, T, T]
    weights = torch.softmax(scores.masked_fill(~rule_pairs(rows, cols), float("-inf")), -1)
    want = torch.einsum("hqk,hkd->hqd", weights, packed[2][0])  # [H, T, D]
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)
