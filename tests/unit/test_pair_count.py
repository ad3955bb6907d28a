"""Sparse training's pair count (``focus/pair_count.py``): exact against the counting by
distinct membership, on the device with no host sync; and the FLOPs it feeds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from focus_pretrain.bench.dispatch import DispatchCounter
from focus_pretrain.config import load_config
from focus_pretrain.focus.pair_count import kept_pairs
from focus_pretrain.focus.pattern import count_allowed_pairs, document_starts, membership_bitmask
from focus_pretrain.train.metrics import flops_per_sample, step_flops_per_sample
from tests.e2e.runs import RECIPE


def _case(seed: int, b: int, n: int, groups: int, top_k: int, packed: bool):
    gen = torch.Generator().manual_seed(seed)
    top_groups = torch.rand(b, n, groups, generator=gen).topk(top_k, dim=-1).indices
    ids = torch.cumsum(torch.rand(b, n, generator=gen) < 0.1, dim=1)  # [b, n] document ids
    return top_groups, document_starts(ids) if packed else None


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "documents"])
def test_kept_pairs_equal_the_count_by_membership(seed, top_k, packed):
    """Random shapes, K, windows (0 to past the sequence), sinks (0 to more than a document),
    documents: the inclusion-exclusion count equals the count by distinct membership."""
    gen = torch.Generator().manual_seed(100 + seed)
    n = int(torch.randint(1, 120, (), generator=gen))
    groups = int(torch.randint(top_k, 9, (), generator=gen))
    window = int(torch.randint(0, n + 3, (), generator=gen))
    sinks = [0, 1, 4, 200][seed % 4]
    top_groups, documents = _case(seed, 2, n, groups, top_k, packed)
    got = kept_pairs(top_groups, window, sinks, documents)
    want = count_allowed_pairs(membership_bitmask(top_groups), window, sinks, documents)
    assert torch.equal(got, want)


def test_kept_pairs_make_no_host_sync():
    """Counted each micro-batch in every Focus layer: no device-to-host read."""
    top_groups, documents = _case(1, 2, 300, 8, 2, packed=True)
    kept_pairs(top_groups, 16, 2, documents)  # warm
    with DispatchCounter() as counter:
        kept_pairs(top_groups, 16, 2, documents)
    assert counter.host_syncs == 0, counter.sync_ops


def test_sparse_training_flops_count_the_pairs_computed():
    """FLOPs of sparse training scale the attention term by the measured density; the soft
    gate's and the dense matmuls' do not change."""
    model = load_config(RECIPE).model
    hard = dataclasses.replace(model, focus=dataclasses.replace(model.focus, training_mode="hard"))
    seq = 1024
    soft_flops = flops_per_sample(model, seq, density=0.25)
    assert soft_flops == flops_per_sample(model, seq)  # soft: every causal pair
    assert flops_per_sample(hard, seq) == soft_flops  # density unknown: every causal pair
    at = {d: flops_per_sample(hard, seq, density=d) for d in (0.25, 0.5, 1.0)}
    assert at[1.0] == soft_flops and at[0.25] < at[0.5] < at[1.0]
    per_pair = 4 * model.kv_channels * model.num_attention_heads * 3  # fwd + bwd
    causal = seq * (seq + 1) / 2
    focus_layers = sum(not model.is_local_layer(i) for i in range(1, model.num_layers + 1))
    assert at[1.0] - at[0.5] == pytest.approx(0.5 * causal * per_pair * focus_layers)


def test_attention_mass_flops_count_a_forward_and_the_extra_attention():
    """train.objective=attention_mass runs the dense model forward once (no backward) and, per
    Focus layer, four passes over every causal pair and the router's forward and backward:
    counted from the model's shapes by hand."""
    model = load_config(RECIPE).model
    seq, h, d, heads = 512, model.hidden_size, model.kv_channels, model.num_attention_heads
    focus, layers = model.focus, model.num_layers
    routed = sum(not model.is_local_layer(i) for i in range(1, layers + 1))
    assert routed >= 1
    causal = seq * (seq + 1) / 2
    gated = model.family_spec.gated_mlp
    matmuls = 2 * (h * (heads + 2 * model.kv_heads) * d + heads * d * h)
    matmuls += 2 * h * model.ffn_hidden_size * (3 if gated else 2)
    dense_forward = seq * layers * matmuls + 4 * d * heads * causal * layers
    dense_forward += seq * 2 * h * model.vocab_size
    router = seq * 2 * (h * focus.group_dim + focus.group_dim * focus.num_groups)
    want = dense_forward + routed * (3 * router + 4 * 4 * d * heads * causal)
    assert step_flops_per_sample(model, seq, "attention_mass") == pytest.approx(want, rel=1e-12)
    assert step_flops_per_sample(model, seq, "distill") == flops_per_sample(model, seq)
    assert step_flops_per_sample(model, seq, "attention_mass") < flops_per_sample(model, seq)
