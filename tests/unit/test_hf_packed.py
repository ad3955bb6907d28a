"""Packed inputs to the shipped HF modeling code: several documents in one row, told apart by
``position_ids`` that restart (as transformers detects packed sequences for flash-attention
varlen), with ``attention_mask`` ``None`` or all ones.

Each document of a packed row gets the logits it gets alone, through the package's
``focus_attention(documents=)`` and the package-less dense path; unpacked inputs are unchanged;
packing with padding and continuing a packed KV cache are refused. Tiny random models are built
in-process from the shipped classes (``test_hf_generation.focus_model``), one of them saved and
loaded back with ``trust_remote_code`` like an export.
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM, DynamicCache

from focus_pretrain.convert.hf_export import MODELING_DIR, SHIPPED_MODELING_FILES
from focus_pretrain.convert.hf_modeling.focus_cache import cache_kwargs, returned_cache
from tests.unit.test_hf_generation import (  # noqa: F401 (local_modeling: an autouse fixture)
    focus_model,
    greedy,
    local_modeling,
    modeling,
    padded,
    sequences,
)

pytestmark = pytest.mark.hf  # also run against other transformers (tools/hf_compat.py)

# window 3: a 9-token document is longer than the window, a 2-token one shorter, and a
# 1-token one has nothing but itself; row 1 starts with a 1-token document
ROWS = [(9, 2, 1), (1, 5, 6)]
FOCUS = {
    "hard1": dict(inference_mode="hard", top_k=1),
    "hard2": dict(inference_mode="hard", top_k=2),
    "soft": dict(inference_mode="soft", top_k=1),
    "window_only": dict(window_only=True),
    "keys": dict(inference_mode="hard", top_k=1, key_groups="own_and_previous"),
    "keys_soft": dict(inference_mode="soft", top_k=1, key_groups="own_and_previous"),
}


def packed_batch(seed: int = 0) -> tuple[list[list[torch.Tensor]], torch.Tensor, torch.Tensor]:
    """``(documents per row, ids [b, s], position_ids [b, s])``: each row's documents back to
    back, each document's positions from 0."""
    docs = [sequences(*lengths, seed=seed + r) for r, lengths in enumerate(ROWS)]
    ids = torch.stack([torch.cat(row) for row in docs])  # [b, s]
    positions = torch.stack([torch.cat([torch.arange(len(d)) for d in row]) for row in docs])
    return docs, ids, positions


def assert_each_document_alone(model, docs, logits: torch.Tensor) -> None:
    """``logits [b, s, V]`` of a packed batch equal each document's logits run alone."""
    with torch.no_grad():
        for r, row in enumerate(docs):
            alone = torch.cat([model(d[None]).logits[0] for d in row])  # [s, V]
            torch.testing.assert_close(logits[r], alone, rtol=1e-5, atol=1e-5)


@pytest.fixture
def package_calls(monkeypatch) -> list[bool]:
    """Records, per call of the package's ``focus_attention``, whether it got ``documents``."""
    calls, package = [], modeling._package_focus_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("documents") is not None)
        return package(*args, **kwargs)

    monkeypatch.setattr(modeling, "_package_focus_attention", spy)
    return calls


CASES = [  # (family, sinks, focus): every family, mode and sink setting at least once
    ("Llama", 0, "hard1"),
    ("Llama", 2, "hard2"),
    ("Llama", 2, "soft"),
    ("GPT2", 2, "window_only"),
    ("Gemma2", 2, "hard1"),
    ("Gemma3", 2, "soft"),
    ("Llama", 1, "keys"),  # a document's first token has no predecessor
    ("Gemma2", 0, "keys_soft"),
]


@pytest.mark.parametrize(
    "family,sinks,focus",
    [(f, s, FOCUS[m]) for f, s, m in CASES],
    ids=[f"{f}-{s}-{m}" for f, s, m in CASES],
)
@pytest.mark.parametrize("path", ["package", "standalone"])
def test_packed_rows_give_each_document_its_own_logits(
    family, focus, sinks, path, package_calls, monkeypatch
):
    """With ``attention_mask`` absent or all ones, with and without a KV cache (transformers
    builds a packed mask only without both): every layer, the families' own sliding-window
    layers included, attends inside each document, whose sinks are its own first tokens."""
    if path == "standalone":
        monkeypatch.setattr(modeling, "_package_focus_attention", None)  # no focus_pretrain
    model = focus_model(family, sinks=sinks, **focus)
    docs, ids, positions = packed_batch(seed=sinks)
    with torch.no_grad():
        for kwargs in ({}, {"use_cache": False}, {"attention_mask": torch.ones_like(ids)}):
            logits = model(ids, position_ids=positions, **kwargs).logits
            assert_each_document_alone(model, docs, logits)
    if path == "package":  # the documents went to the package (each layer, each forward)
        assert package_calls.count(True) == 3 * model.config.num_hidden_layers
    assert model.base_model.focus_documents.starts is None  # the last forward: one document


def test_the_document_mask_matters_and_the_packed_paths_agree(monkeypatch):
    """Without document detection a packed row is one sequence (other logits); the package's
    backends and the dense path give the same packed logits."""
    model = focus_model("Gemma2", sinks=2, top_k=2)
    _, ids, positions = packed_batch(seed=3)
    with torch.no_grad():
        fast = model(ids, position_ids=positions).logits
        model.config.focus["inference_backend"] = "dense"
        dense = model(ids, position_ids=positions).logits
        inputs = sys.modules[modeling.capture_documents.__module__]  # focus_inputs
        monkeypatch.setattr(inputs, "packed_documents", lambda *args: None)
        merged = model(ids, position_ids=positions).logits
    torch.testing.assert_close(fast, dense, rtol=1e-5, atol=1e-5)
    assert (merged - dense).abs().max() > 1e-3


def test_an_export_loaded_with_remote_code_runs_packed_rows_without_the_package(
    tmp_path, monkeypatch
):
    """The shipped files in an exported directory (``trust_remote_code``), with and without
    the package's ``focus_attention``."""
    model = focus_model("Llama", sinks=2, **FOCUS["hard2"])
    config = model.config
    config.auto_map = {
        "AutoConfig": f"configuration_focus.{type(config).__name__}",
        "AutoModelForCausalLM": f"modeling_focus.{type(model).__name__}",
    }
    model.save_pretrained(tmp_path)
    for name in SHIPPED_MODELING_FILES:
        shutil.copyfile(MODELING_DIR / name, tmp_path / name)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    shipped = __import__(type(loaded).__module__, fromlist=["_package_focus_attention"])
    assert shipped is not modeling  # the directory's own copy
    docs, ids, positions = packed_batch(seed=5)
    for package in (shipped._package_focus_attention, None):
        monkeypatch.setattr(shipped, "_package_focus_attention", package)
        with torch.no_grad():
            logits = loaded(ids, position_ids=positions).logits
        assert_each_document_alone(loaded, docs, logits)
        assert_each_document_alone(model, docs, logits)


@pytest.mark.parametrize("family", ["Llama", "GPT2", "Gemma2"])
def test_unpacked_inputs_are_unchanged(family):
    """Consecutive position ids (from any offset) are one document per row, and padded
    batches with generate's or users' position ids (restarting only in the padding) are not
    packed."""
    model = focus_model(family, sinks=2, top_k=2)
    seqs = sequences(7, 12, 1, seed=7)
    ids, mask = padded(seqs, "left")
    generate_positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # what generate passes
    with torch.no_grad():
        plain = model(ids[1:2]).logits
        counted = model(ids[1:2], position_ids=torch.arange(12)[None]).logits
        assert model.base_model.focus_documents.starts is None
        torch.testing.assert_close(counted, plain, rtol=0, atol=0)
        alone = [model(s[None]).logits[0] for s in seqs]
        for positions in (generate_positions, (mask.cumsum(-1) - 1).clamp(min=0)):
            logits = model(ids, attention_mask=mask, position_ids=positions).logits
            assert model.base_model.focus_documents.starts is None
            for i in range(len(seqs)):
                real = logits[i][mask[i].bool()]
                torch.testing.assert_close(real, alone[i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_packed_rows_with_padding_are_refused(side):
    model = focus_model(sinks=2)
    docs, _, _ = packed_batch()
    rows = [torch.cat(row) for row in docs] + [sequences(4)[0]]
    ids, mask = padded(rows, side)
    positions = torch.zeros_like(ids)
    for r, row in enumerate([*docs, [rows[-1]]]):
        real = torch.cat([torch.arange(len(d)) for d in row])
        positions[r, mask[r].bool()] = real
    with pytest.raises(ValueError, match="packed documents with padding are not supported"):
        model(ids, attention_mask=mask, position_ids=positions)


def test_position_ids_of_another_length_are_refused_clearly():
    model = focus_model(sinks=2)
    _, ids, positions = packed_batch()
    for wrong in (positions[:, :-1], torch.cat([positions, positions[:, -1:] + 1], dim=1)):
        with torch.no_grad(), pytest.raises(ValueError, match=r"positions for 12 tokens: pass one"):
            model(ids, position_ids=wrong)


@pytest.mark.parametrize("focus", [FOCUS["hard1"], FOCUS["window_only"]], ids=["hard", "window"])
def test_a_packed_cache_cannot_be_continued(focus):
    """A packed forward may fill a cache (``use_cache`` defaults to True), but no step
    continues it, nor ``generate`` from packed ids; packed ids after cached tokens are refused;
    the same cache filled again without packing decodes."""
    model = focus_model(window=3, sinks=2, **focus)
    _, ids, positions = packed_batch()
    step = dict(input_ids=torch.tensor([[3], [4]]), position_ids=torch.tensor([[12], [12]]))
    with torch.no_grad():
        cache = returned_cache(model(ids, position_ids=positions))
        with pytest.raises(ValueError, match=r"filled by packed documents.*cannot be continued"):
            model(**step, **cache_kwargs(model, cache))
        with pytest.raises(ValueError, match="filled by packed documents"):
            greedy(model, ids, 3, position_ids=positions)
        fresh = DynamicCache(config=model.config)
        model(ids[:, :4], **cache_kwargs(model, fresh))
        with pytest.raises(ValueError, match="after 4 cached tokens are not supported"):
            model(ids[:, 4:], position_ids=positions[:, 4:], **cache_kwargs(model, fresh))
        cache.reset()
        model(ids, **cache_kwargs(model, cache))  # one document per row: continuable
        cached = model(**step, **cache_kwargs(model, cache)).logits[:, -1]
        full = torch.cat([ids, step["input_ids"]], dim=1)
        torch.testing.assert_close(cached, model(full, use_cache=False).logits[:, -1])


def test_generate_without_the_cache_continues_the_last_packed_document():
    """``generate(use_cache=False)`` recomputes the packed row at every step (transformers
    extends ``position_ids``): its tokens are those of the row's last document alone."""
    model = focus_model(window=3, sinks=2, top_k=2)
    docs, ids, positions = packed_batch(seed=9)
    if Version(transformers.__version__) < Version("5.2"):  # (a dense model fails there too)
        with torch.no_grad(), pytest.raises(ValueError, match="12 positions for 13 tokens"):
            greedy(model, ids[:1], 8, position_ids=positions[:1], use_cache=False)
        return
    with torch.no_grad():
        out = greedy(model, ids[:1], 8, position_ids=positions[:1], use_cache=False)
        last = docs[0][-1][None]
        alone = greedy(model, last, 8)
    assert out[0, ids.shape[1] :].tolist() == alone[0, last.shape[1] :].tolist()
