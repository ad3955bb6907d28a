"""The router: Sinkhorn, causal balancing, hard membership, load statistics, parameter counts."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from focus_pretrain.focus import (
    FocusConfig,
    FocusRouter,
    Routing,
    focus_attention,
    group_load,
    membership_bitmask,
    router_parameter_count,
    sinkhorn_log,
)


def test_sinkhorn_rows_sum_to_one_and_columns_to_n_over_k():
    gen = torch.Generator().manual_seed(0)
    b, n, k = 3, 96, 8
    logits = torch.randn(b, n, k, generator=gen) * 3.0 + torch.linspace(0, 4, k)  # skewed
    log_p, potential = sinkhorn_log(logits, 10)
    p = log_p.exp()
    torch.testing.assert_close(p.sum(-1), torch.ones(b, n))
    torch.testing.assert_close(p.sum(1), torch.full((b, k), n / k), rtol=2e-2, atol=0.0)
    raw_columns = torch.softmax(logits, -1).sum(1)
    assert (raw_columns.max(-1).values / (n / k)).min() > 1.5  # it really had to balance
    # the column potential reproduces the assignment as a per-group offset on the logits
    torch.testing.assert_close(torch.softmax(logits + potential[:, None], -1), p)


@pytest.mark.parametrize("normalize, iters, tolerance", [(True, 10, 0.02), (False, 100, 0.02)])
def test_router_sinkhorn_mode_is_balanced_per_sequence(normalize, iters, tolerance):
    """Paper defaults (K=8, tau=0.1, 10 iterations) balance cosine routing to 2%; plain
    dot-product logits are ~10x larger and need far more iterations (see the next test)."""
    torch.manual_seed(0)
    router = FocusRouter(
        32, num_groups=8, balance="sinkhorn", normalize=normalize, sinkhorn_iters=iters
    )
    hidden = torch.randn(2, 512, 32) + 2.0  # a shared direction skews raw routing
    p = router(hidden).probs
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 512))
    torch.testing.assert_close(p.sum(1), torch.full((2, 8), 64.0), rtol=tolerance, atol=0.0)
    raw = torch.softmax(router.logits(hidden), -1).sum(1)
    assert (raw.max(-1).values / 64.0).min() > 1.3  # the raw routing was unbalanced


def test_dot_product_routing_is_not_balanced_by_ten_sinkhorn_iterations():
    """Grounds the cosine-routing default: the literal dot product at tau=0.1 leaves columns far
    from n/K after the paper's 10 iterations, where cosine routing is within 2%."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 512, 32) + 2.0
    errors = {}
    for normalize in (True, False):
        router = FocusRouter(32, num_groups=8, balance="sinkhorn", normalize=normalize)
        columns = router(hidden).probs.sum(1)  # [b, K]
        errors[normalize] = float((columns / 64.0 - 1).abs().max())
    assert errors[True] < 0.02 and errors[False] > 0.2, errors


def test_sinkhorn_sharded_through_column_hook_equals_full_sequence():
    """Two "ranks" (threads) each hold half the sequence; the hook all-reduces the column
    log-sum-exp between them, as context parallelism will: the result equals one process."""
    logits = torch.randn(2, 40, 4) * 3.0
    full, full_potential = sinkhorn_log(logits, 6)
    halves = logits[:, :20], logits[:, 20:]
    board: dict[int, torch.Tensor] = {}
    barrier = threading.Barrier(2, timeout=600)  # a deadlock guard, not a timing test
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def all_reduce_logsumexp(rank):
        def column_logsumexp(x):
            board[rank] = torch.logsumexp(x, dim=1, keepdim=True)  # [b, 1, K] local
            barrier.wait()
            total = torch.logaddexp(board[0], board[1])
            barrier.wait()
            return total

        return column_logsumexp

    def run(rank):
        results[rank] = sinkhorn_log(
            halves[rank], 6, column_logsumexp=all_reduce_logsumexp(rank), num_tokens=40
        )

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat([results[0][0], results[1][0]], 1), full)
    torch.testing.assert_close(results[0][1], full_potential)
    # without the hook and the global n, a shard balances only itself: a different answer
    alone, _ = sinkhorn_log(halves[0], 6)
    assert (alone - full[:, :20]).abs().max() > 1e-3


def _skewed_hidden(n_tokens: int, d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, n_tokens, d, generator=gen) + 1.5  # shared direction -> one group wins


def test_causal_balance_offsets_prevent_collapse():
    torch.manual_seed(0)
    k = 8
    router = FocusRouter(64, num_groups=k, balance="causal", balance_rate=0.5).train()
    before = group_load(router(_skewed_hidden(512, 64, 1))).max_share
    router.update_balance()
    assert before > 0.4, before  # collapsed to begin with
    for step in range(20):
        router(_skewed_hidden(512, 64, 100 + step))
        router.update_balance()
    after = group_load(router.eval()(_skewed_hidden(2048, 64, 999)))
    assert after.max_share < 1.6 / k, after
    assert after.fraction.min() > 0.4 / k, after
    assert not router.balance_offsets.requires_grad
    assert "balance_offsets" not in dict(router.named_parameters())
    assert "balance_offsets" in router.state_dict()


def test_balance_update_is_a_noop_without_data_and_in_sinkhorn_mode():
    router = FocusRouter(8, num_groups=4, balance="causal").train()
    router.update_balance()
    assert torch.equal(router.balance_offsets, torch.zeros(4))
    router.eval()(torch.randn(1, 10, 8))  # eval forwards accumulate nothing
    assert router.balance_target() is None
    sink = FocusRouter(8, num_groups=4, balance="sinkhorn").train()
    sink(torch.randn(1, 10, 8))
    sink.update_balance(torch.ones(4))
    assert torch.equal(sink.balance_offsets, torch.zeros(4))


def test_causal_routing_is_causal_and_sinkhorn_is_not():
    """Router + attention: perturbing positions > i leaves outputs at <= i unchanged (causal)."""
    torch.manual_seed(0)
    b, s, d, h, hd, i = 2, 40, 16, 2, 8, 24
    qkv = nn.Linear(d, 3 * h * hd)
    hidden = torch.randn(b, s, d)
    perturbed = hidden.clone()
    perturbed[:, i + 1 :] = torch.randn(b, s - i - 1, d) * 3.0

    def layer(router, x, mode):
        q, k, v = qkv(x).reshape(b, s, 3, h, hd).unbind(2)  # [b, s, h, hd] each
        return focus_attention(q, k, v, router(x), window=4, mode=mode, top_k=2)

    for mode in ("soft", "hard"):
        causal = FocusRouter(d, num_groups=4, balance="causal").eval()
        out, out_p = layer(causal, hidden, mode), layer(causal, perturbed, mode)
        assert torch.equal(out[:, : i + 1], out_p[:, : i + 1]), mode
        assert not torch.allclose(out[:, i + 1 :], out_p[:, i + 1 :])  # the perturbation bites
        sink = FocusRouter(d, num_groups=4, balance="sinkhorn").eval()
        out, out_p = layer(sink, hidden, mode), layer(sink, perturbed, mode)
        leak = (out[:, : i + 1] - out_p[:, : i + 1]).abs().max()
        assert leak > 1e-3, f"sinkhorn routing should leak the future ({mode}): {leak}"
        routing_leak = sink(hidden).probs[:, : i + 1] - sink(perturbed).probs[:, : i + 1]
        assert routing_leak.abs().max() > 1e-3


def test_membership_bitmask_matches_top_groups():
    probs = torch.softmax(torch.randn(2, 30, 6), -1)
    routing = Routing(probs)
    for top_k in (1, 2, 3):
        top = routing.top_groups(top_k)
        mask = routing.membership(top_k)
        assert mask.dtype == torch.int64
        for bit in range(6):
            has = (mask >> bit) & 1 == 1
            assert torch.equal(has, (top == bit).any(-1))
    assert membership_bitmask(torch.tensor([[63, 0]])).item() == (-(2**63)) | 1  # bit 63 works


def test_group_load_statistics():
    probs = torch.tensor([[[0.9, 0.1, 0.0], [0.8, 0.1, 0.1], [0.2, 0.7, 0.1], [0.1, 0.1, 0.8]]])
    load = group_load(Routing(probs))
    torch.testing.assert_close(load.fraction, torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64))
    assert load.max_share == 0.5
    torch.testing.assert_close(load.soft_fraction, probs[0].mean(0))


@pytest.mark.parametrize("k, expected", [(8, 148_992), (4, 148_224)])
def test_router_stack_parameter_count_gpt2_124m(k, expected):
    routers = nn.ModuleList(FocusRouter(768, num_groups=k, group_dim=16) for _ in range(12))
    assert sum(p.numel() for p in routers.parameters()) == expected
    assert router_parameter_count(12, 768, 16, k) == expected


def test_meta_device_build_and_from_config():
    config = FocusConfig(num_groups=4, group_dim=16, tau=0.2, balance="sinkhorn")
    router = FocusRouter.from_config(config, 4096, device="meta")
    assert router.centroids.is_meta and router.num_groups == 4 and router.balance == "sinkhorn"
    assert sum(p.numel() for p in router.parameters()) == 4096 * 16 + 4 * 16


def test_normalized_routing_bounds_logits():
    router = FocusRouter(16, num_groups=4, tau=0.1, normalize=True)
    logits = router.logits(torch.randn(2, 8, 16) * 100)
    assert logits.abs().max() <= 10.0 + 1e-4


def test_router_runs_in_fp32_for_bf16_weights():
    router = FocusRouter(16, num_groups=4, dtype=torch.bfloat16)
    routing = router(torch.randn(1, 8, 16, dtype=torch.bfloat16))
    assert routing.probs.dtype == torch.float32


def test_training_forwards_count_group_load():
    router = FocusRouter(16, num_groups=4).train()
    hidden = torch.randn(2, 30, 16)
    routing = router(hidden)
    router(hidden)
    counts = router.pop_load()
    expected = torch.bincount(routing.probs.argmax(-1).flatten(), minlength=4).float() * 2
    torch.testing.assert_close(counts, expected)
    assert router.pop_load().sum() == 0  # reset by the pop
    router.eval()(hidden)
    assert router.pop_load().sum() == 0  # eval forwards are not counted


def test_balance_none_is_plain_softmax_and_never_moves_offsets():
    """``balance: none`` (the E2 ablation): the token's own softmax, no balance offsets ever."""
    torch.manual_seed(0)
    router = FocusRouter(32, num_groups=4, balance="none")
    hidden = torch.randn(2, 40, 32)
    for _ in range(3):
        routing = router(hidden)
        router.update_balance()
    assert torch.equal(router.balance_offsets, torch.zeros(4))
    assert router.balance_target() is None
    torch.testing.assert_close(routing.probs, torch.softmax(router.logits(hidden), dim=-1))


def test_freeze_centroids_trains_only_the_centroids():
    """``train.freeze: centroids``: W_g is frozen with every original weight."""
    from focus_pretrain.config import TrainConfig
    from focus_pretrain.train.optim import apply_freeze_policy

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)
            self.router = FocusRouter(32, num_groups=4)

    model = torch.nn.Sequential(Layer(), Layer())
    counts = apply_freeze_policy(model, TrainConfig(freeze="centroids"))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["0.router.centroids", "1.router.centroids"]
    assert counts["trainable"] == 2 * 4 * 16 and counts["router"] == 2 * (32 * 16 + 4 * 16)
    with pytest.raises(ValueError, match="needs Focus routers"):
        apply_freeze_policy(torch.nn.Linear(3, 3), TrainConfig(freeze="centroids"))
