"""Model config validation: bad values fail before anything is built, naming the key."""

from __future__ import annotations

import pathlib

import pytest

from focus_pretrain.config import load_config
from focus_pretrain.model import ModelConfig

ROOT = pathlib.Path(__file__).parents[2]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(hidden_size=72, num_attention_heads=6, tensor_parallel_size=4),
            r"model.num_attention_heads \(6\) must be divisible by model.tensor_parallel_size",
        ),
        (
            dict(num_attention_heads=8, num_query_groups=2, tensor_parallel_size=4),
            r"model.num_query_groups \(2\) must be divisible by model.tensor_parallel_size \(4\)",
        ),
        (
            dict(num_attention_heads=4, num_query_groups=3),
            r"model.num_attention_heads \(4\) must be divisible by model.num_query_groups \(3\)",
        ),
        (
            dict(hidden_size=66, num_attention_heads=4),
            r"model.hidden_size \(66\) must be divisible by model.num_attention_heads \(4\)",
        ),
        (dict(family="bert"), r"model.family must be one of 'gpt2', 'llama'"),
        (dict(recompute="some"), r"model.recompute must be one of 'none', 'full', 'selective'"),
        (dict(family="gemma2"), r"model.sliding_window is required for family gemma2"),
        (dict(family="llama", attn_softcap=50.0), r"model.attn_softcap is only used by family"),
        (dict(family="gpt2", num_query_groups=2), r"must equal model.num_attention_heads"),
        (dict(num_layers=0), r"model.num_layers must be >= 1, got 0"),
    ],
)
def test_bad_model_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_recipe_model_sections_load():
    for name in ("7b.yaml", "gpt2-124m-retrofit.yaml"):
        config = load_config(ROOT / "configs" / name).model
        assert config.focus.num_groups == 4
    head_dim_only = ModelConfig(hidden_size=66, num_attention_heads=4, head_dim=16)
    assert head_dim_only.kv_channels == 16
