"""RoPE scaling, Qwen3 and Gemma-3 at the HF boundary: frequencies bit-identical to
transformers', config.json read in both spellings as transformers reads it, the exported
config.json giving the same HF model, and every unsupported variant refused by name."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers

from focus_pretrain.convert import hf_model_config
from focus_pretrain.convert.hf_export import hf_config_dict, shipped_classes
from focus_pretrain.model.config import RopeScaling
from focus_pretrain.model.rope import hf_inv_freq
from tests.multiprocess.test_hf_import import HF_CONFIGS, make_hf_model, tokens

pytestmark = pytest.mark.hf  # also run against other transformers (tools/hf_compat.py)


def _config_json(path, name: str, **changes) -> None:
    """``config.json`` of the test model ``name`` (as transformers writes it), edited."""
    class_name, kwargs = HF_CONFIGS[name]
    config = getattr(transformers, class_name)(**kwargs).to_dict()
    config.update(changes)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("seed", range(6))
def test_inv_freq_is_bit_identical_to_transformers(seed):
    """Any llama3 parameters (not only Llama-3.x's), linear and default, several head sizes."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rng = random.Random(seed)
    head_dim = rng.choice([16, 24, 64, 128])
    low = rng.uniform(0.5, 2.0)
    rope = dict(
        rope_type="llama3",
        rope_theta=rng.choice([1e4, 5e5, 1e6]),
        factor=rng.uniform(1.0, 32.0),
        low_freq_factor=low,
        high_freq_factor=low + rng.uniform(0.5, 8.0),
        original_max_position_embeddings=rng.choice([16, 256, 8192]),
    )
    hf = transformers.LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, rope_parameters=rope
    )
    scaling = RopeScaling(type="llama3", **{k: rope[k] for k in list(rope)[2:]})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)
    assert torch.equal(hf_inv_freq(head_dim, rope["rope_theta"], scaling), want)
    hf.rope_parameters = dict(rope_type="linear", rope_theta=rope["rope_theta"], factor=3.0)
    want, _ = ROPE_INIT_FUNCTIONS["linear"](hf)
    linear = RopeScaling(type="linear", factor=3.0)
    assert torch.equal(hf_inv_freq(head_dim, rope["rope_theta"], linear), want)
    model = transformers.LlamaForCausalLM(  # the default RoPE: Megatron's formula, HF's numbers
        transformers.LlamaConfig(
            hidden_size=4 * head_dim,
            num_attention_heads=4,
            num_hidden_layers=1,
            intermediate_size=8,
            vocab_size=8,
            rope_theta=rope["rope_theta"],
        )
    )
    want = model.model.rotary_emb.inv_freq
    assert torch.equal(hf_inv_freq(head_dim, rope["rope_theta"]), want)


def _hf_rotary(path):
    """The rotary embedding of the HF model transformers builds from ``path/config.json``
    (building it settles the RoPE parameters: top-level keys are applied only then)."""
    config = transformers.AutoConfig.from_pretrained(path)
    return config, transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb


@pytest.mark.parametrize(
    "spelling",
    [
        dict(  # transformers 4.x: rope_scaling with "type", theta outside, no original length
            rope_parameters=None,
            rope_theta=5e5,
            rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0),
        ),
        dict(
            rope_parameters=None,
            rope_theta=5e5,
            rope_scaling=dict(rope_type="linear", factor=2.0),
        ),
        dict(  # Phi-3 style: the top-level original length wins
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=1e4,
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=2.0,
                original_max_position_embeddings=32,
            ),
            original_max_position_embeddings=16,
        ),
    ],
)
def test_both_rope_spellings_read_as_transformers_reads_them(tmp_path, spelling):
    _config_json(tmp_path, "llama", **spelling)
    ours = hf_model_config(tmp_path)
    config, rotary = _hf_rotary(tmp_path)
    theirs = config.rope_parameters
    inv_freq = hf_inv_freq(ours.kv_channels, ours.rotary_base, ours.rope_scaling)
    assert torch.equal(inv_freq, rotary.inv_freq)
    assert ours.rotary_base == theirs["rope_theta"]
    assert ours.rope_scaling.type == theirs["rope_type"]
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        assert getattr(ours.rope_scaling, name) == theirs.get(name)
    if ours.rope_scaling.type == "llama3":
        expected = theirs["original_max_position_embeddings"]
        assert ours.rope_scaling.original_max_position_embeddings == expected


def test_gemma3_old_spelling_and_layer_pattern(tmp_path):
    """Gemma-3 files without layer_types / rope_parameters (sliding_window_pattern,
    rope_local_base_freq, rope_scaling for the global layers) read like transformers."""
    _config_json(
        tmp_path,
        "gemma3",
        num_hidden_layers=7,
        layer_types=None,
        sliding_window_pattern=3,
        rope_parameters=None,
        rope_theta=5e5,
        rope_local_base_freq=2e4,
        rope_scaling=dict(rope_type="linear", factor=8.0),
    )
    ours = hf_model_config(tmp_path)
    theirs, rotary = _hf_rotary(tmp_path)
    d = ours.kv_channels
    inv_freq = hf_inv_freq(d, ours.rotary_base, ours.rope_scaling)
    assert torch.equal(inv_freq, rotary.full_attention_inv_freq)
    assert torch.equal(hf_inv_freq(d, ours.local_rotary_base), rotary.sliding_attention_inv_freq)
    local = [ours.is_local_layer(n) for n in range(1, 8)]
    assert local == [kind == "sliding_attention" for kind in theirs.layer_types]
    assert ours.rotary_base == theirs.rope_parameters["full_attention"]["rope_theta"]
    assert ours.local_rotary_base == theirs.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.rope_scaling == RopeScaling(type="linear", factor=8.0)


@pytest.mark.parametrize("model_type", list(HF_CONFIGS))
def test_exported_config_gives_the_same_hf_model(tmp_path, model_type):
    """config.json as the export writes it (``hf_config_dict``: RoPE scaling, Gemma-3's layer
    types and per-type RoPE, ...) into the shipped Focus class, Focus off, with the original
    weights: the original HF model's logits."""
    original, path = make_hf_model(model_type, tmp_path)
    config = hf_model_config(path)
    config_cls, model_cls = shipped_classes(config.family)
    hf_config = config_cls(focus=dict(enabled=False), **hf_config_dict(config))
    exported = model_cls(hf_config).eval()
    missing, unexpected = exported.load_state_dict(original.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if config.tied:
        exported.tie_weights()
    with torch.no_grad():
        want, got = original(tokens()).logits, exported(tokens()).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert hf_model_config(path) == config  # and it reads back to the same architecture
    (tmp_path / "back").mkdir()
    hf_config.save_pretrained(tmp_path / "back")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    back["model_type"] = json.loads((path / "config.json").read_text())["model_type"]
    (tmp_path / "back" / "config.json").write_text(json.dumps(back))
    assert hf_model_config(tmp_path / "back") == config


ROPE_REFUSED = {
    "yarn": dict(factor=4.0, original_max_position_embeddings=16),
    "longrope": dict(short_factor=[1.0] * 8, long_factor=[2.0] * 8),
    "dynamic": dict(factor=2.0),
}


@pytest.mark.parametrize("kind", list(ROPE_REFUSED))
def test_other_rope_types_are_refused_by_name(tmp_path, kind):
    rope = dict(rope_type=kind, rope_theta=1e4, **ROPE_REFUSED[kind])
    _config_json(tmp_path, "llama", rope_parameters=rope)
    with pytest.raises(
        ValueError,
        match=rf"RoPE scaling rope_type='{kind}' \(llama rope_parameters: .*\) is not "
        r"supported: .* logits would differ .* Supported, and reproduced exactly: 'default', "
        r"'llama3', 'linear' .* import a checkpoint that uses one of them",
    ):
        hf_model_config(tmp_path)


@pytest.mark.parametrize(
    ("model_type", "changes", "message"),
    [
        (
            "gemma3",
            dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]),
            r"model_type='gemma3': multimodal Gemma-3 .* is not supported; import a text-only "
            r"Gemma-3 checkpoint \(model_type gemma3_text, Gemma3ForCausalLM",
        ),
        ("qwen3", dict(attention_bias=True), r"qwen3 with attention_bias=true is not supported"),
        (
            "qwen3",
            dict(
                rope_parameters=dict(rope_type="default", rope_theta=1e4), partial_rotary_factor=0.5
            ),
            r"qwen3 with partial_rotary_factor=0.5 is not supported",
        ),
        (
            "gemma3",
            dict(use_bidirectional_attention=True),
            r"use_bidirectional_attention=true .* is not supported: Focus attention is causal",
        ),
        (
            "gemma3",
            dict(layer_types=["sliding_attention", "full_attention"] + ["sliding_attention"] * 2),
            r"gemma3_text layer_types .* are not 1 sliding-window layers then one full-attention "
            r"layer, repeated",
        ),
        (
            "gemma3",
            dict(layer_types=["full_attention"] + ["sliding_attention"] * 3),
            r"gemma3_text layer_types .* are not 0 sliding-window layers",
        ),
        (
            "gemma3",
            dict(
                rope_parameters=dict(
                    sliding_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e4),
                    full_attention=dict(rope_type="default", rope_theta=1e6),
                )
            ),
            r"gemma3_text with RoPE scaling on its sliding-window layers .* is not supported",
        ),
        (
            "gemma3",
            dict(
                rope_parameters=dict(
                    sliding_attention=dict(rope_type="default", rope_theta=1e4),
                    full_attention=dict(rope_type="yarn", factor=2.0, rope_theta=1e6),
                )
            ),
            r"rope_type='yarn' \(gemma3_text rope_parameters.full_attention",
        ),
    ],
)
def test_unsupported_variants_of_the_new_families_are_refused(
    tmp_path, model_type, changes, message
):

    _config_json(tmp_path, model_type, **changes)
    with pytest.raises(ValueError, match=message):
        hf_model_config(tmp_path)


def test_qwen3_sliding_window_warns(tmp_path):
    # layers from max_window_layers on slide (the to_dict() layer_types, computed without a
    # window, are dropped: transformers recomputes them)
    _config_json(
        tmp_path,
        "qwen3",
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        layer_types=None,
    )
    assert "sliding_attention" in transformers.AutoConfig.from_pretrained(tmp_path).layer_types
    with pytest.warns(UserWarning, match=r"qwen3 sliding_window=8 is not reproduced"):
        hf_model_config(tmp_path)


def test_recipe_must_match_the_checkpoints_rope_and_layer_pattern(tmp_path):
    """``import_hf`` compares RoPE scaling, Gemma-3's pattern and local base with the
    checkpoint's; defaults that mean the same (pattern 6, local base = global) are accepted."""
    from dataclasses import replace

    from focus_pretrain.convert import import_hf

    _, llama3 = make_hf_model("llama3", tmp_path)
    config = hf_model_config(llama3)
    with pytest.raises(ValueError, match=r"model.rope_scaling is None but the HuggingFace"):
        import_hf(llama3, replace(config, rope_scaling=None), tp_rank=0)
    _, gemma3 = make_hf_model("gemma3", tmp_path)
    config = hf_model_config(gemma3)
    assert (config.sliding_window_pattern, config.local_rotary_base) == (3, 10000.0)
    with pytest.raises(ValueError, match=r"model.sliding_window_pattern is 6 but .* has 3"):
        import_hf(gemma3, replace(config, sliding_window_pattern=None), tp_rank=0)
    with pytest.raises(ValueError, match=r"model.local_rotary_base is 1000000.0 but .* 10000.0"):
        import_hf(gemma3, replace(config, local_rotary_base=None), tp_rank=0)
    _config_json(tmp_path / "six", "gemma3", num_hidden_layers=6, layer_types=None)
    six = hf_model_config(tmp_path / "six")
    assert six.sliding_window_pattern == 6 and six.is_local_layer(5) and not six.is_local_layer(6)
