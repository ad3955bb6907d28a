"""The import reads a ``config.json`` as transformers does: a missing key takes the config
class's default (not ``None``), flags transformers ignores are ignored, and what transformers would
run bidirectionally is refused. (Logits parity with every option set explicitly:
``tests/multiprocess/test_hf_import.py``.)"""

from __future__ import annotations

import json
import warnings

import pytest
import transformers

from focus_pretrain.convert import hf_model_config

pytestmark = pytest.mark.hf  # also run against other transformers (tools/hf_compat.py)

# hand-written configs with only the shape keys: every other key takes its class default
SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=32,
    intermediate_size=96,
    vocab_size=64,
)
MINIMAL = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=64, n_positions=32),
    "llama": SHAPE,
    "mistral": SHAPE,
    "qwen2": SHAPE,
    "qwen3": SHAPE,
    "olmo2": SHAPE,
    "gemma2": SHAPE,
    "gemma3_text": SHAPE,
}


def _write(path, model_type: str, **changes) -> None:
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": model_type, **MINIMAL[model_type], **changes}
    (path / "config.json").write_text(json.dumps(config))


def _import(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = hf_model_config(path)
    return config, [str(w.message) for w in caught if "is not reproduced" in str(w.message)]


@pytest.mark.parametrize("model_type", list(MINIMAL))
def test_a_missing_key_means_what_transformers_assumes(tmp_path, model_type):
    _write(tmp_path, model_type)
    ours, window_warnings = _import(tmp_path)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    if model_type == "gpt2":
        assert ours.norm_epsilon == theirs.layer_norm_epsilon and ours.tied
        return
    heads = theirs.num_attention_heads
    assert ours.kv_heads == theirs.num_key_value_heads
    assert ours.kv_channels == (getattr(theirs, "head_dim", None) or theirs.hidden_size // heads)
    assert ours.norm_epsilon == theirs.rms_norm_eps  # OLMo-2's is 1e-5, the others' 1e-6
    assert ours.tied == theirs.tie_word_embeddings
    if model_type in ("gemma2", "gemma3_text"):
        assert ours.final_softcap == theirs.final_logit_softcapping
        assert ours.query_pre_attn_scalar == theirs.query_pre_attn_scalar
        assert ours.sliding_window == theirs.sliding_window
    if model_type == "gemma2":  # 50 and 30 by default: they bind
        assert ours.attn_softcap == theirs.attn_logit_softcapping is not None
    else:  # Gemma-3's attention ignores attn_logit_softcapping; the others have none
        assert ours.attn_softcap is None
    # the only family transformers runs with a sliding window by default: Mistral (4096)
    assert bool(window_warnings) == (model_type == "mistral"), window_warnings


@pytest.mark.parametrize("model_type", list(MINIMAL))
def test_bidirectional_attention_is_refused(tmp_path, model_type):
    _write(tmp_path, model_type, is_causal=False)
    with pytest.raises(ValueError, match=r"is_causal=false \(bidirectional attention.* causal"):
        hf_model_config(tmp_path)
    if model_type in ("gemma2", "gemma3_text"):
        _write(tmp_path, model_type, use_bidirectional_attention=True)
        with pytest.raises(ValueError, match=r"use_bidirectional_attention=true .* is causal"):
            hf_model_config(tmp_path)
    _write(tmp_path, model_type, is_causal=True, use_bidirectional_attention=False)
    hf_model_config(tmp_path)


def test_the_activation_is_read_from_the_key_the_family_uses(tmp_path):
    _write(tmp_path, "llama", hidden_act="gelu", hidden_activation="silu")
    with pytest.raises(ValueError, match=r"llama with activation 'gelu' is not supported"):
        hf_model_config(tmp_path)
    _write(tmp_path, "gemma2", hidden_act="silu", hidden_activation="gelu_pytorch_tanh")
    hf_model_config(tmp_path)


@pytest.mark.parametrize(
    "model_type,changes,warned",
    [
        ("llama", dict(sliding_window=16), False),  # Llama ignores the key
        ("olmo2", dict(sliding_window=16), False),
        ("qwen2", dict(sliding_window=16), False),  # use_sliding_window defaults to False
        ("qwen2", dict(sliding_window=16, use_sliding_window=True, max_window_layers=2), False),
        ("qwen3", dict(sliding_window=16, use_sliding_window=True, max_window_layers=1), True),
        ("mistral", dict(sliding_window=None), False),
        ("mistral", dict(sliding_window=16), True),
    ],
)
def test_a_sliding_window_is_warned_about_only_where_transformers_applies_it(
    tmp_path, model_type, changes, warned
):
    _write(tmp_path, model_type, **changes)
    _, window_warnings = _import(tmp_path)
    assert bool(window_warnings) == warned, window_warnings
