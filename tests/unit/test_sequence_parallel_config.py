"""``parallel.sequence_parallel``: validation, the router's gathered projection, and the memory
plan's activation formula with and without it (Korthikanti et al. 2022, Table 2)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from focus_pretrain.config import load_config
from focus_pretrain.focus import FocusRouter
from focus_pretrain.model import ModelConfig
from focus_pretrain.parallel import ParallelConfig
from focus_pretrain.train.plan import GB, focus_layers, layer_activations, memory_plan

ROOT = pathlib.Path(__file__).parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
MILLION = ROOT / "configs" / "7b-1m.yaml"


def test_sequence_parallel_needs_tensor_parallelism():
    with pytest.raises(ValueError, match=r"parallel.sequence_parallel needs parallel.tensor_par"):
        ParallelConfig(sequence_parallel=True)
    assert ParallelConfig(tensor_parallel_size=2, sequence_parallel=True).sequence_parallel
    with pytest.raises(ValueError, match=r"parallel.sequence_parallel must be bool, got 'maybe'"):
        load_config(TINY, ["parallel.tensor_parallel_size=2", "parallel.sequence_parallel=maybe"])


@pytest.mark.parametrize(
    "sets, message",
    [
        (  # 126 tokens over 4 tensor-parallel ranks
            ["parallel.tensor_parallel_size=4", "data.seq_length=126"],
            r"data.seq_length \(126\) must be divisible by parallel.tensor_parallel_size x "
            r"context_parallel_size \(4 x 1 = 4\) with parallel.sequence_parallel",
        ),
        (  # 124 = 2 x 2 x 31 suits CP=2 (two chunks each) but not TP=4 x CP=2
            [
                "parallel.tensor_parallel_size=4",
                "parallel.context_parallel_size=2",
                "parallel.cp_mode=ring",
                "data.seq_length=124",
            ],
            r"data.seq_length \(124\) must be divisible by .* \(4 x 2 = 8\)",
        ),
        (
            ["parallel.tensor_parallel_size=4", "probes.lengths=[66]"],
            r"probes.lengths\[\] \(66\) must be divisible by .* \(4 x 1 = 4\)",
        ),
    ],
)
def test_sequences_must_split_over_the_tensor_parallel_ranks(sets, message):
    with pytest.raises(ValueError, match=message):
        load_config(TINY, ["parallel.sequence_parallel=true", *sets])
    sets = [s for s in sets if not s.startswith(("data.seq_length", "probes"))]
    config = load_config(TINY, ["parallel.sequence_parallel=true", *sets])  # 128 splits
    assert config.parallel.sequence_parallel


def test_router_on_a_slice_with_its_projection_gathered_equals_the_whole_sequence():
    """``gather_tokens`` (what sequence parallelism passes): the router projects its slice of
    the tokens ``[b, s / 2, d]``, the projection is gathered, and the routing, the balance
    statistic and the load counts are those of the whole sequence; a NaN anywhere raises."""
    hidden = torch.randn(2, 12, 32)  # [b, s, d]
    routers = [FocusRouter(32, num_groups=4) for _ in range(2)]
    routers[1].load_state_dict(routers[0].state_dict())
    whole = routers[0](hidden)
    other = routers[1].proj(hidden[:, 6:]).detach()  # the other rank's projection
    part = routers[1](hidden[:, :6], gather_tokens=lambda x: torch.cat([x, other], dim=1))
    torch.testing.assert_close(part.probs, whole.probs)
    torch.testing.assert_close(routers[1].balance_target(), routers[0].balance_target())
    assert torch.equal(routers[1].pop_load(), routers[0].pop_load())
    with pytest.raises(ValueError, match="contains NaN or inf"):
        routers[1](hidden[:, :6], gather_tokens=lambda x: torch.cat([x, other * torch.nan], 1))


def test_layer_activations_follow_korthikanti_table_2():
    """Bytes per ``s b h``: ``10 + 24 / t`` with tensor parallelism alone (norm inputs,
    dropout masks, first linears' inputs replicated), ``34 / t`` with sequence parallelism."""
    assert layer_activations(1, 1, 1, 1, False) == layer_activations(1, 1, 1, 1, True) == 34
    assert layer_activations(1, 1, 1, 8, False) == 13
    assert layer_activations(1, 1, 1, 8, True) == 34 / 8
    assert layer_activations(4096, 2, 1024, 4, True) == 4096 * 2 * 1024 * 34 / 4
    gemma = ModelConfig(family="gemma2", num_layers=4, sliding_window=8)
    assert focus_layers(gemma) == 2 and focus_layers(ModelConfig(num_layers=3)) == 3


def _million_plan(*sets: str) -> dict:
    counts = {"sharded": 7_000_000_000, "replicated": 240_000_000, "trainable": 7_240_000_000}
    return memory_plan(load_config(MILLION, list(sets)), counts)


def test_million_token_plan_with_and_without_sequence_parallelism():
    """configs/7b-1m.yaml (TP 8 x CP 8, 131,072 tokens per GPU, full recompute, bf16): the
    32 layer inputs ``[s, b, h]`` (bf16) are split over TP 8 with sequence parallelism, one
    layer's working set drops from ``13 s b h`` to ``4.25 s b h``, the routers' fp32 input copy
    from ``4 s b h`` to ``0.5 s b h``."""
    sbh = 131_072 * 4096
    with_sp, without = _million_plan(), _million_plan("parallel.sequence_parallel=false")
    assert with_sp["sequence_parallel"] and not without["sequence_parallel"]
    want_without = 32 * 2 * sbh + 13 * sbh + 4 * sbh
    want_with = 32 * 2 * sbh / 8 + 34 / 8 * sbh + 4 * sbh / 8
    assert without["activations_gb"] == pytest.approx(want_without / GB)
    assert with_sp["activations_gb"] == pytest.approx(want_with / GB)
    assert without["activations_gb"] - with_sp["activations_gb"] > 30  # GB per GPU
    for key in ("weights_gb", "optimizer_gb", "logits_gb", "context_parallel_gb"):
        assert with_sp[key] == without[key]
    assert with_sp["fits"] and with_sp["total_gb"] < without["total_gb"]


def test_plan_without_recompute_counts_every_layer():
    """No recompute: every layer's working set, plus each Focus layer's router input copy."""
    config = load_config(TINY, ["train.precision=bf16", "parallel.tensor_parallel_size=2"])
    counts = {"sharded": 1000, "replicated": 10, "trainable": 1010}
    sbh = 128 * 16 * 128  # seq 128, micro-batch 16, hidden 128
    plan = memory_plan(config, counts)
    assert plan["activations_gb"] == pytest.approx(2 * (22 * sbh + 4 * sbh) / GB)
    sp = load_config(
        TINY,
        [
            "train.precision=bf16",
            "parallel.tensor_parallel_size=2",
            "parallel.sequence_parallel=true",
        ],
    )
    assert memory_plan(sp, counts)["activations_gb"] == pytest.approx(2 * (17 + 2) * sbh / GB)
