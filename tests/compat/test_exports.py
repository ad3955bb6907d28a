"""Exports written by this version load and generate under the transformers installed here,
with or without ``focus_pretrain`` (the user's environment, not ours).

``tools/hf_compat.py`` runs this module in small environments of their own (torch, the
lowest and the newest supported transformers, pytest), once with ``focus_pretrain`` importable
(its fast attention path) and once without (standalone), on exports the locked environment wrote
(``FOCUS_COMPAT_EXPORTS``). In the main test run it writes them itself. Imports nothing of ours
but :mod:`tests.compat.cases`.

What each export must do: give the logits and greedy tokens it gave the exporter (hard and soft
pattern), warn about the transformers version exactly when it is outside the range recorded in
its ``config.json``, generate through the KV cache (sparse decode steps) what full recomputation
gives, greedy and beam search, and generate for a left-padded batch what each prompt gives
alone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.compat.cases import CASES, NEW_TOKENS, PROMPT, expected_outputs, tokens

pytestmark = pytest.mark.hf
if os.environ.get("FOCUS_COMPAT_PACKAGE") == "0":  # standalone: as if it were not installed
    sys.modules["focus_pretrain"] = None  # importing it raises ImportError (the code's fallback)


@pytest.fixture(scope="session")
def exports(tmp_path_factory) -> Path:
    given = os.environ.get("FOCUS_COMPAT_EXPORTS")
    if given:
        return Path(given)
    from tests.compat.write_exports import write_exports  # needs focus_pretrain

    out = tmp_path_factory.mktemp("compat-exports")
    write_exports(out)
    return out


_LOADED: dict[str, tuple] = {}


def load(exports: Path, name: str):
    """``(model, version warnings of its first load)``: each export loaded once per process
    (its code's module, and so its warn-once state, lives as long)."""
    if name not in _LOADED:
        from transformers import AutoModelForCausalLM

        os.environ["HF_HUB_OFFLINE"] = "1"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = AutoModelForCausalLM.from_pretrained(exports / name, trust_remote_code=True)
        versions = [w for w in caught if type(w.message).__name__.endswith("VersionWarning")]
        _LOADED[name] = (model.eval(), versions)
    return _LOADED[name]


def greedy(model, ids, **kwargs):
    n = NEW_TOKENS
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)


def attention_modules(model) -> list:
    if hasattr(model, "transformer"):  # GPT-2
        return [block.attn for block in model.transformer.h]
    return [layer.self_attn for layer in model.model.layers]


def test_the_environment_is_the_one_asked_for():
    """The run's environment (``FOCUS_COMPAT_TRANSFORMERS``, ``FOCUS_COMPAT_PACKAGE``) is the
    one this process has: a check of the harness itself."""
    expected = os.environ.get("FOCUS_COMPAT_TRANSFORMERS")
    if expected:
        assert Version(transformers.__version__) == Version(expected)
    package = os.environ.get("FOCUS_COMPAT_PACKAGE")
    if package == "1":
        importlib.import_module("focus_pretrain.focus")
    if package == "0":  # none of the package's own dependencies either: a user's environment
        with pytest.raises(ImportError):
            importlib.import_module("focus_pretrain.focus")
        for name in ("megatron", "deepspeed", "datasets", "sentencepiece"):
            assert importlib.util.find_spec(name) is None, name


@pytest.mark.parametrize("name", list(CASES))
def test_version_warning_only_outside_the_recorded_range(exports, name):
    record = json.loads((exports / name / "config.json").read_text())["focus_transformers"]
    assert record["exported_with"] and SpecifierSet(record["tested"])  # what the export says
    model, versions = load(exports, name)
    inside = SpecifierSet(record["tested"]).contains(Version(transformers.__version__), True)
    assert len(versions) == (0 if inside else 1)
    for warning in versions:
        assert transformers.__version__ in str(warning.message)
        assert record["tested"] in str(warning.message)
    with warnings.catch_warnings(record=True) as again:  # once per process
        warnings.simplefilter("always")
        type(model.config)(focus_transformers=record)
    assert not [w for w in again if type(w.message).__name__.endswith("VersionWarning")]


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_tokens_are_the_exporters(exports, name):
    model, _ = load(exports, name)
    modeling = sys.modules[type(model).__module__]
    package = os.environ.get("FOCUS_COMPAT_PACKAGE")
    if package is not None:  # the export's code found focus_pretrain's fast path, or not
        assert (modeling._package_focus_attention is not None) == (package == "1")
    expected = torch.load(exports / name / "expected.pt", weights_only=True)
    outputs = expected_outputs(model)  # what the exporter computed, computed here
    hard, soft, tokens_out = outputs["hard"], outputs["soft"], outputs["greedy"]
    assert not torch.allclose(hard, soft, atol=1e-3)  # the two patterns differ here
    torch.testing.assert_close(hard, expected["hard"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(soft, expected["soft"], rtol=1e-4, atol=1e-4)
    assert tokens_out.tolist() == expected["greedy"].tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_sparse_decode_equals_full_recomputation(exports, name):
    model, _ = load(exports, name)
    ids = tokens(1, PROMPT, seed=2)
    for attn in attention_modules(model):
        attn.focus_keys_read = 0
    kwargs = dict(output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        cached = greedy(model, ids, **kwargs)
        recomputed = greedy(model, ids, use_cache=False, **kwargs)
    assert cached.sequences.tolist() == recomputed.sequences.tolist()
    for a, b in zip(cached.logits, recomputed.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    routed = [a for a in attention_modules(model) if getattr(a, "router", None) is not None]
    reads = [attn.focus_keys_read for attn in routed]
    dense = sum(range(PROMPT + 1, PROMPT + NEW_TOKENS))  # keys of the one-token steps
    assert reads and all(0 < r < dense for r in reads)  # the sparse step ran, reading fewer


@pytest.mark.parametrize("name", list(CASES))
def test_beam_search_with_the_cache_equals_without(exports, name):
    model, _ = load(exports, name)
    ids = tokens(1, PROMPT, seed=3)
    kwargs = dict(num_beams=3, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        cached = greedy(model, ids, **kwargs)
        recomputed = greedy(model, ids, use_cache=False, **kwargs)
    assert cached.sequences.tolist() == recomputed.sequences.tolist()
    torch.testing.assert_close(cached.sequences_scores, recomputed.sequences_scores)


@pytest.mark.parametrize("name", list(CASES))
def test_left_padded_batch_generates_each_prompt_as_alone(exports, name):
    model, _ = load(exports, name)
    prompts = [tokens(1, n, seed=4 + n)[0] for n in (PROMPT, 7, 13)]
    ids = torch.zeros(len(prompts), PROMPT, dtype=torch.long)  # pad id 0, on the left
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, PROMPT - len(prompt) :], mask[row, PROMPT - len(prompt) :] = prompt, 1
    with torch.no_grad():
        batched = greedy(model, ids, attention_mask=mask, pad_token_id=0)[:, PROMPT:]
        for row, prompt in enumerate(prompts):
            alone = greedy(model, prompt[None], pad_token_id=0)[0, len(prompt) :]
            assert batched[row].tolist() == alone.tolist()


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(top_k=0), r"focus.top_k must be >= 1, got 0"),
        (dict(window=-1), r"focus.window must be >= 0, got -1"),
        (dict(inference_mode="hrad"), r"focus.inference_mode must be one of 'hard', 'soft'"),
    ],
)
def test_bad_focus_settings_are_refused_without_the_package(exports, tmp_path, change, message):
    """An export's config.json edited by hand, and a loaded model's settings edited: a clear
    error, not another pattern silently (standalone, the package's checks are absent)."""
    import shutil

    from transformers import AutoModelForCausalLM

    edited = tmp_path / "edited"
    shutil.copytree(exports / "llama", edited)
    config = json.loads((edited / "config.json").read_text())
    config["focus"].update(change)
    (edited / "config.json").write_text(json.dumps(config))
    os.environ["HF_HUB_OFFLINE"] = "1"
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_pretrained(edited, trust_remote_code=True)
    model, _ = load(exports, "llama")
    saved = dict(model.config.focus)
    model.config.focus.update(change)
    try:
        with torch.no_grad(), pytest.raises(ValueError, match=message):
            model(tokens(1, 6, seed=0))
    finally:
        model.config.focus.clear()
        model.config.focus.update(saved)
