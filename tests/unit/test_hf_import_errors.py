"""HF import refuses what it cannot reproduce, naming the problem."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest
import torch

from focus_pretrain.convert import (
    check_tokenizer_matches,
    hf_model_config,
    import_hf,
    load_hf_tensors,
)
from focus_pretrain.model.tp_rules import Geometry, rules_for
from tests.multiprocess.test_hf_import import HF_CONFIGS, make_hf_model

pytestmark = pytest.mark.hf  # also run against other transformers (tools/hf_compat.py)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_model("llama", tmp_path_factory.mktemp("hf"))[1]


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "bert", "architectures": ["BertModel"]})
    )
    with pytest.raises(ValueError, match=r"unsupported HuggingFace architecture model_type='bert'"):
        hf_model_config(tmp_path)


def test_missing_directory_or_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config.json does not exist"):
        hf_model_config(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"has no model.safetensors"):
        load_hf_tensors(tmp_path)


def test_config_and_weights_that_disagree(llama, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in llama.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    _edit_config(bad, intermediate_size=128)  # the weights say 96
    with pytest.raises(ValueError, match=r"does not fit .*linear_fc1.weight \(256, 64\)"):
        import_hf(bad, hf_model_config(bad), tp_rank=0)
    _edit_config(bad, intermediate_size=96, num_hidden_layers=3)  # a layer more than stored
    with pytest.raises(ValueError, match=r"lacks 9 tensor\(s\) its config.json implies"):
        import_hf(bad, hf_model_config(bad), tp_rank=0)


def test_recipe_that_disagrees_with_the_checkpoint(llama):
    config = hf_model_config(llama)
    with pytest.raises(
        ValueError, match=r"model.hidden_size is 96 but the HuggingFace checkpoint has 64"
    ):
        import_hf(llama, replace(config, hidden_size=96), tp_rank=0)
    with pytest.raises(ValueError, match=r"model.rotary_base is 10000.0 .* has 500000.0"):
        import_hf(llama, replace(config, rotary_base=10000.0), tp_rank=0)
    with pytest.raises(ValueError, match=r"model.head_dim is 32 but .* has 16"):
        import_hf(llama, replace(config, head_dim=32), tp_rank=0)
    explicit = replace(config, head_dim=16)  # the derived size, spelled out: accepted
    assert (
        import_hf(llama, explicit, tp_rank=0).keys() == import_hf(llama, config, tp_rank=0).keys()
    )


def test_missing_shard(tmp_path):
    _, path = make_hf_model("qwen2", tmp_path, shard_size="40KB")
    shards = sorted(path.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(
        FileNotFoundError, match=rf"checkpoint shard .*{shards[-1].name} .* is missing"
    ):
        import_hf(path, hf_model_config(path), tp_rank=0)


def test_unsupported_variants_are_refused(llama, tmp_path):
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text((llama / "config.json").read_text())
    _edit_config(odd, rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0})
    with pytest.raises(ValueError, match=r"RoPE scaling rope_type='yarn' .* is not supported"):
        hf_model_config(odd)
    _edit_config(
        odd, rope_parameters={"rope_type": "default", "rope_theta": 5e5}, hidden_act="gelu"
    )
    with pytest.raises(ValueError, match=r"llama with activation 'gelu' is not supported"):
        hf_model_config(odd)


@pytest.mark.parametrize(
    ("flag", "value"), [("scale_attn_by_inverse_layer_idx", True), ("scale_attn_weights", False)]
)
def test_gpt2_with_another_attention_scale_is_refused(tmp_path, flag, value):
    """Both flags change GPT-2's softmax scale, which our attention does not reproduce."""
    import transformers

    transformers.GPT2Config(**HF_CONFIGS["gpt2"][1], **{flag: value}).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=rf"GPT-2 with {flag}={str(value).lower()} is not supported: .*logits"
    ):
        hf_model_config(tmp_path)


def test_gpt2_reorder_and_upcast_attn_is_accepted(tmp_path):
    """``reorder_and_upcast_attn`` only computes the same scores in fp32: accepted, the same
    architecture and (HF's own eager model) the same logits as without it."""
    import transformers

    kwargs = HF_CONFIGS["gpt2"][1]
    plain = transformers.GPT2Config(**kwargs)
    plain.save_pretrained(tmp_path / "plain")
    upcast = transformers.GPT2Config(**kwargs, reorder_and_upcast_attn=True)
    upcast.save_pretrained(tmp_path / "upcast")
    assert hf_model_config(tmp_path / "upcast") == hf_model_config(tmp_path / "plain")
    plain._attn_implementation = "eager"  # the path that reads the flag
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(plain).eval()
    x = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x).logits
        for block in model.transformer.h:
            block.attn.reorder_and_upcast_attn = True
        torch.testing.assert_close(model(x).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", list(HF_CONFIGS))
def test_key_maps_round_trip_exactly(tmp_path, model_type):
    """HF tensors -> ours -> HF tensors is bit-identical for every rule (export's inverse),
    except Gemma's ``1 + w`` norms, which round once in fp32 (at most an ulp of 1.0)."""
    _, path = make_hf_model(model_type, tmp_path)
    config = hf_model_config(path)
    geometry = Geometry(config.num_attention_heads, config.kv_heads, config.kv_channels)
    tensors = load_hf_tensors(path)
    hf_type = json.loads((path / "config.json").read_text())["model_type"]
    rules = rules_for(hf_type, config.num_layers, config.tied)
    covered = set()
    for rule in rules:
        originals = [tensors[k] for k in rule.hf]
        back = rule.to_hf(geometry, rule.to_ours(geometry, *originals))
        assert len(back) == len(originals)
        for a, b in zip(originals, back, strict=True):
            gemma_norm = model_type.startswith("gemma") and "norm" in rule.ours
            tolerance = 2**-23 if gemma_norm else 0.0
            torch.testing.assert_close(b, a, rtol=0, atol=tolerance, msg=rule.ours)
        covered.update(rule.hf)
    assert covered == set(tensors)  # every stored HF tensor has a rule


def test_an_export_accepts_the_sentencepiece_model_its_tokenizer_was_rebuilt_from(tmp_path):
    """Retrofitting our own export: its ``tokenizer.json`` was rebuilt from the run's
    SentencePiece ``.model``, which ``focus_export.json`` records by hash; that file (and only
    that file) is accepted as ``data.tokenizer``."""
    source, other = tmp_path / "run.model", tmp_path / "other.model"
    source.write_bytes(b"sentencepiece bytes of the run")
    other.write_bytes(b"another tokenizer")
    export = tmp_path / "hf"
    export.mkdir()
    (export / "tokenizer.json").write_text("{}")
    record = {"tokenizer_source": {"sha256": hashlib.sha256(source.read_bytes()).hexdigest()}}
    (export / "focus_export.json").write_text(json.dumps(record))
    check_tokenizer_matches(export, source)
    check_tokenizer_matches(export, export)  # the shipped tokenizer itself
    with pytest.raises(ValueError, match="ships its own tokenizer"):
        check_tokenizer_matches(export, other)
    with pytest.raises(ValueError, match="ships its own tokenizer"):
        check_tokenizer_matches(export, None)


def test_a_retrofit_uses_the_checkpoints_own_tokenizer_in_every_form(tmp_path):
    """``tokenizer.json`` (``data.tokenizer: DIR``), a SentencePiece ``tokenizer.model``
    (``data.tokenizer: DIR/tokenizer.model``), slow-tokenizer files only (refused with the
    command that writes ``tokenizer.json``) or none (refused unless ``data.tokenizer`` names
    the model's tokenizer): never a silently trained new one."""
    from focus_pretrain.convert.hf_import import checkpoint_tokenizer

    other = tmp_path / "other.model"
    other.write_bytes(b"another tokenizer")
    sentencepiece = tmp_path / "sp"
    sentencepiece.mkdir()
    (sentencepiece / "tokenizer.model").write_bytes(b"the model's sentencepiece bytes")
    model_file = sentencepiece / "tokenizer.model"
    assert checkpoint_tokenizer(sentencepiece) == str(model_file)
    check_tokenizer_matches(sentencepiece, model_file)
    for wrong in (None, other):
        with pytest.raises(ValueError, match=rf"set data.tokenizer: {model_file}"):
            check_tokenizer_matches(sentencepiece, wrong)

    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "vocab.json").write_text("{}")
    (slow / "merges.txt").write_text("")
    assert checkpoint_tokenizer(slow) is None
    with pytest.raises(ValueError, match=r"only as slow-tokenizer files \(vocab.json, merges.txt\)"
                       r".*AutoTokenizer.from_pretrained.*save_pretrained"):  # fmt: skip
        check_tokenizer_matches(slow, None)

    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ValueError, match=r"ships no tokenizer and data\.tokenizer is not set"):
        check_tokenizer_matches(bare, None)
    check_tokenizer_matches(bare, other)  # named by the user: nothing shipped to compare with
