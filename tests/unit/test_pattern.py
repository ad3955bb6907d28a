"""The pattern module: allowed pairs, the soft gate, bitmasks and pair counting."""

from __future__ import annotations

import math

import pytest
import torch

from focus_pretrain.focus import (
    Routing,
    allowed_pairs,
    count_allowed_pairs,
    pair_bias,
    pattern_density,
    soft_gate,
)
from focus_pretrain.focus.pattern import shares_group, sink_only_pairs
from tests.helpers import random_probs


def test_allowed_pairs_matches_the_definition_elementwise():
    n, w = 9, 2
    member = torch.tensor([[1, 2, 1, 4, 3, 2, 1, 4, 6]])  # bitmasks; 3 = {0, 1}, 6 = {1, 2}
    pos = torch.arange(n)
    got = allowed_pairs(pos, pos, w, member_q=member, member_k=member)[0]
    for i in range(n):
        for j in range(n):
            expected = j <= i and (i - j <= w or (int(member[0, i]) & int(member[0, j])) != 0)
            assert bool(got[i, j]) == expected, (i, j)
    soft = allowed_pairs(pos, pos, w)[0]
    assert torch.equal(soft, torch.ones(n, n, dtype=torch.bool).tril())
    local = allowed_pairs(pos, pos, w, local_only=True)[0]
    assert torch.equal(
        local,
        torch.ones(n, n, dtype=torch.bool).tril()
        & ~torch.ones(n, n, dtype=torch.bool).tril(-w - 1),
    )


def test_allowed_pairs_with_shifted_positions():
    """Positions are global: a key block that lies entirely in the future is fully masked."""
    q_pos, k_pos = torch.arange(10, 14), torch.arange(20, 24)
    member = torch.full((1, 4), 1)
    assert not allowed_pairs(q_pos, k_pos, 3, member_q=member, member_k=member).any()
    assert allowed_pairs(k_pos, q_pos, 3, member_q=member, member_k=member).all()


def test_soft_gate_values_and_bias():
    assert soft_gate(torch.tensor(0.5), 10.0).item() == pytest.approx(math.log(0.5))
    assert soft_gate(torch.tensor(1.0), 10.0).item() == pytest.approx(-math.log1p(math.exp(-5)))
    probs = random_probs(1, 6, 3, seed=0)
    pos = torch.arange(6)
    bias = pair_bias(pos, pos, 1, mode="soft", probs_q=probs, probs_k=probs, gate_lambda=3.0)[0]
    for i in range(6):
        for j in range(6):
            if j > i:
                assert bias[i, j] == float("-inf")
            elif i - j <= 1:
                assert bias[i, j] == 0.0
            else:
                expected = torch.nn.functional.logsigmoid(3.0 * (probs[0, i] @ probs[0, j] - 0.5))
                torch.testing.assert_close(bias[i, j], expected)


@pytest.mark.parametrize(
    "n, k, top_k, window",
    [(1, 1, 1, 0), (50, 4, 1, 3), (97, 8, 2, 10), (64, 5, 3, 70), (40, 3, 2, 0)],
)
def test_count_allowed_pairs_equals_materialised_pattern(n, k, top_k, window):
    member = Routing(random_probs(3, n, k, seed=n)).membership(top_k)
    pos = torch.arange(n)
    brute = allowed_pairs(pos, pos, window, member_q=member, member_k=member).flatten(1).sum(1)
    assert torch.equal(count_allowed_pairs(member, window), brute)
    density = pattern_density(member, window)
    torch.testing.assert_close(density, brute.double() / (n * (n + 1) / 2))


@pytest.mark.parametrize("sinks", [1, 3, 6])
def test_sinks_match_the_definition_elementwise(sinks):
    """A key ``j < sinks`` is allowed for every query ``i >= j``, in the hard, soft (no gate)
    and local-only patterns; everything else is as without sinks."""
    n, w = 11, 2
    member = torch.tensor([[1, 2, 1, 4, 3, 2, 1, 4, 6, 8, 8]])
    probs = random_probs(1, n, 4, seed=sinks)
    pos = torch.arange(n)
    hard = allowed_pairs(pos, pos, w, member_q=member, member_k=member, sinks=sinks)[0]
    local = allowed_pairs(pos, pos, w, local_only=True, sinks=sinks)[0]
    bias = pair_bias(pos, pos, w, mode="soft", probs_q=probs, probs_k=probs, sinks=sinks)[0]
    for i in range(n):
        for j in range(n):
            near = j <= i and (i - j <= w or j < sinks)
            shares = (int(member[0, i]) & int(member[0, j])) != 0
            assert bool(hard[i, j]) == (near or (j <= i and shares)), (i, j)
            assert bool(local[i, j]) == near, (i, j)
            if j > i:
                assert bias[i, j] == float("-inf")
            elif near:
                assert bias[i, j] == 0.0  # a sink is not gated
            else:
                gate = torch.nn.functional.logsigmoid(10.0 * (probs[0, i] @ probs[0, j] - 0.5))
                torch.testing.assert_close(bias[i, j], gate)


@pytest.mark.parametrize("sinks, window, top_k", [(1, 0, 1), (3, 2, 2), (9, 4, 1), (40, 3, 2)])
def test_sink_only_pairs_complete_the_decomposition(sinks, window, top_k):
    """Same-group pairs, the cross-group band and the sink-only pairs are disjoint and their
    union is the hard pattern with sinks (what the fast backends merge by log-sum-exp)."""
    n = 30
    member = Routing(random_probs(2, n, 4, seed=window)).membership(top_k)
    pos = torch.arange(n)
    causal = pos[:, None] >= pos[None, :]
    same = causal & shares_group(member, member)  # [b, n, n]
    band = allowed_pairs(pos, pos, window, local_only=True) & ~shares_group(member, member)
    extra = sink_only_pairs(pos, pos, window, sinks, member_q=member, member_k=member)
    full = allowed_pairs(pos, pos, window, member_q=member, member_k=member, sinks=sinks)
    assert extra.any() and not (extra & (same | band)).any() and not (same & band).any()
    assert torch.equal(same | band | extra, full)
    local = sink_only_pairs(pos, pos, window, sinks)[0]  # sliding-window layers
    plain = allowed_pairs(pos, pos, window, local_only=True)[0]
    assert torch.equal(
        local | plain, allowed_pairs(pos, pos, window, local_only=True, sinks=sinks)[0]
    )


@pytest.mark.parametrize(
    "n, k, top_k, window, sinks",
    [(50, 4, 1, 3, 1), (97, 8, 2, 10, 4), (40, 5, 2, 0, 45), (5, 2, 1, 9, 2)],
)
def test_count_allowed_pairs_with_sinks(n, k, top_k, window, sinks):
    member = Routing(random_probs(3, n, k, seed=n)).membership(top_k)
    pos = torch.arange(n)
    brute = allowed_pairs(pos, pos, window, member_q=member, member_k=member, sinks=sinks)
    brute = brute.flatten(1).sum(1)
    assert torch.equal(count_allowed_pairs(member, window, sinks), brute)
    if n > window + 1:
        assert (brute > count_allowed_pairs(member, window)).any()
    torch.testing.assert_close(
        pattern_density(member, window, sinks), brute.double() / (n * (n + 1) / 2)
    )
