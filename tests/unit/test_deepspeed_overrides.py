"""``parallel.deepspeed``: merged over the generated DeepSpeed config; keys the recipe owns are
refused naming the recipe key (tests/e2e/test_deepspeed_passthrough.py runs a CSV monitor)."""

from __future__ import annotations

import pathlib

import pytest

from focus_pretrain.config import load_config, save_config
from focus_pretrain.train.optim import deepspeed_config

RECIPE = pathlib.Path(__file__).parents[2] / "configs" / "tiny.yaml"


def test_entries_merge_over_the_generated_config(tmp_path):
    sets = [
        "parallel.deepspeed.csv_monitor.enabled=true",
        f"parallel.deepspeed.csv_monitor.output_path={tmp_path}",
        "parallel.deepspeed.zero_optimization.reduce_bucket_size=1000",
        "parallel.deepspeed.fp16.initial_scale_power=12",
        "parallel.deepspeed.wall_clock_breakdown=true",
    ]
    config = load_config(RECIPE, sets)
    plain = deepspeed_config(load_config(RECIPE), grad_accum=2)
    merged = deepspeed_config(config, grad_accum=2)
    assert merged["csv_monitor"] == {"enabled": True, "output_path": str(tmp_path)}
    # mappings merge key by key: the recipe's stage stays next to the new bucket size
    assert merged["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}
    assert merged["fp16"] == {"enabled": False, "initial_scale_power": 12}
    assert merged["wall_clock_breakdown"] is True and plain["wall_clock_breakdown"] is False
    assert {k: v for k, v in merged.items() if k != "csv_monitor"} != plain
    assert merged["gradient_accumulation_steps"] == 2 == plain["gradient_accumulation_steps"]
    assert "csv_monitor" not in plain and config.parallel.deepspeed["csv_monitor"]["enabled"]
    saved = save_config(config, tmp_path / "config.yaml")  # in every run and checkpoint
    assert load_config(saved) == config


@pytest.mark.parametrize(
    ("override", "ours"),
    [
        ("train_micro_batch_size_per_gpu=2", "train.micro_batch_size"),
        ("train_batch_size=64", "train.global_batch_size"),
        ("gradient_accumulation_steps=4", "train.global_batch_size"),
        ("gradient_clipping=0.5", "train.clip_grad"),
        ("zero_optimization.stage=3", "parallel.zero_stage"),
        ("zero_optimization.offload_optimizer.device=cpu", "parallel.cpu_offload"),
        ("bf16.enabled=true", "train.precision"),
        ("bf16=true", "train.precision"),  # a value replacing the owned section
        ("optimizer.params.lr=0.1", "train.lr"),
        ("scheduler.type=WarmupLR", "train.schedule"),
        ("checkpoint.load_universal=true", "train.load_universal"),
    ],
)
def test_keys_the_recipe_owns_are_refused_naming_ours(override, ours):
    key = override.split("=")[0]
    with pytest.raises(
        ValueError, match=rf"parallel\.deepspeed\.{key} is set by the recipe: use {ours}"
    ):
        load_config(RECIPE, [f"parallel.deepspeed.{override}"])


def test_deepspeed_must_be_a_mapping():
    with pytest.raises(ValueError, match=r"parallel\.deepspeed must be a mapping, got 3"):
        load_config(RECIPE, ["parallel.deepspeed=3"])
