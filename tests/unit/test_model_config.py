"""Model config validation: bad values fail before anything is built, naming the key."""

from __future__ import annotations

import pathlib

import pytest

from focus_pretrain.config import load_config, save_config
from focus_pretrain.model import ModelConfig
from focus_pretrain.model.config import RopeScaling

ROOT = pathlib.Path(__file__).parents[2]


@pytest.mark.parametrize(
    "kwargs, message",
    [
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
        (
            dict(family="gemma3", sliding_window=8, attn_softcap=50.0),
            r"model.attn_softcap is not supported for family gemma3: transformers' Gemma-3 does "
            r"not soft-cap attention logits",
        ),
        (dict(family="gpt2", num_query_groups=2), r"must equal model.num_attention_heads"),
        (dict(num_layers=0), r"model.num_layers must be >= 1, got 0"),
        (dict(rope_scaling=dict(type="yarn")), r"model.rope_scaling.type must be one of 'llama3'"),
        (
            dict(rope_scaling=dict(type="llama3", factor=8.0)),
            r"model.rope_scaling.low_freq_factor is required for type llama3",
        ),
        (
            dict(rope_scaling=dict(type="linear", factor=2.0, low_freq_factor=1.0)),
            r"model.rope_scaling.low_freq_factor is only used by type llama3",
        ),
        (
            dict(rope_scaling=dict(type="linear", factor=2.0, beta=1.0)),
            r"unknown key\(s\) model.rope_scaling.beta; allowed keys: type, factor",
        ),
        (
            dict(
                rope_scaling=dict(
                    type="llama3",
                    factor=8.0,
                    low_freq_factor=4.0,
                    high_freq_factor=1.0,
                    original_max_position_embeddings=8192,
                )
            ),
            r"model.rope_scaling.high_freq_factor \(1.0\) must be > model.rope_scaling.low_freq",
        ),
        (
            dict(family="gpt2", rope_scaling=dict(type="linear", factor=2.0)),
            r"model.rope_scaling is for RoPE families; gpt2 has learned absolute positions",
        ),
        (dict(family="gemma3"), r"model.sliding_window is required for family gemma3"),
        (dict(local_rotary_base=1e4), r"model.local_rotary_base is only used by family gemma3"),
        (
            dict(family="gemma2", sliding_window=4, sliding_window_pattern=3),
            r"model.sliding_window_pattern must be 2 for family gemma2",
        ),
    ],
)
def test_bad_model_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ["model.hidden_size=72", "model.num_attention_heads=6"],
            r"model.num_attention_heads \(6\) must be divisible by parallel.tensor_parallel_size",
        ),
        (
            ["model.num_attention_heads=8", "model.num_query_groups=2"],
            r"model.num_query_groups \(2\) must be divisible by parallel.tensor_parallel_size",
        ),
    ],
)
def test_heads_must_split_over_tensor_parallel_ranks(sets, message):
    """Tensor parallelism is set only in ``parallel``; the model's heads must divide by it."""
    with pytest.raises(ValueError, match=message):
        load_config(None, [*sets, "parallel.tensor_parallel_size=4"])


def test_parallel_sizes_live_only_in_the_parallel_section(tmp_path):
    """Recipes and checkpoints written with ``model.tensor_parallel_size`` (and CP size, mode)
    still load: the values move to ``parallel``; a contradiction is refused."""
    from focus_pretrain.model import ModelConfig

    legacy = ["model.tensor_parallel_size=2", "model.cp_mode=ring"]
    config = load_config(None, [*legacy, "parallel.tensor_parallel_size=2"])
    assert (config.parallel.tensor_parallel_size, config.parallel.cp_mode) == (2, "ring")
    assert not hasattr(config.model, "tensor_parallel_size") and "cp_mode" not in str(
        ModelConfig.__dataclass_fields__
    )
    with pytest.raises(ValueError, match=r"model.tensor_parallel_size \(2\) differs from "):
        load_config(None, [*legacy, "parallel.tensor_parallel_size=1"])


def test_recipe_model_sections_load():
    for name in ("7b.yaml", "gpt2-124m-retrofit.yaml"):
        config = load_config(ROOT / "configs" / name).model
        assert config.focus.num_groups == 4
    head_dim_only = ModelConfig(hidden_size=66, num_attention_heads=4, head_dim=16)
    assert head_dim_only.kv_channels == 16


def test_rope_scaling_from_a_recipe_and_back(tmp_path):
    """``model.rope_scaling`` is a nested section (YAML or dotted overrides); a saved config
    (every default filled in) loads back to the same model section."""
    sets = [
        "model.rope_scaling.type=llama3",
        "model.rope_scaling.factor=8",
        "model.rope_scaling.low_freq_factor=1",
        "model.rope_scaling.high_freq_factor=4",
        "model.rope_scaling.original_max_position_embeddings=8192",
    ]
    config = load_config(None, sets)
    assert config.model.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert isinstance(config.model.rope_scaling.factor, float)
    save_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml").model == config.model
    linear = load_config(None, ["model.rope_scaling.type=linear", "model.rope_scaling.factor=2"])
    save_config(linear, tmp_path / "linear.yaml")
    assert load_config(tmp_path / "linear.yaml").model.rope_scaling == RopeScaling("linear", 2.0)
    with pytest.raises(ValueError, match=r"model.rope_scaling.factor must be float, got 'x'"):
        load_config(None, ["model.rope_scaling.factor=x"])
