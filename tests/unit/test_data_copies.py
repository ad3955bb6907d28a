"""Long-range copies in training samples (``data.copy_spans``): layout, content, and the
dataset that applies them to the training split only."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from focus_pretrain.data.copies import (
    copied_labels,
    copy_layout,
    copy_room,
    copy_room_refusal,
    long_range_copies,
)


def _sample(s: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(3, 10_000, (s + 1,), generator=g)  # [s + 1]: distinct-ish ids
    mask = (torch.rand(s, generator=g) > 0.1).float()  # some unweighted labels
    return {
        "tokens": stream[:s],
        "labels": stream[1:],
        "loss_mask": mask,
        "position_ids": torch.arange(s),
    }


@pytest.mark.parametrize("s,spans,span,distance", [(64, 1, 8, 0), (200, 3, 16, 40), (97, 2, 5, 60)])
def test_copies_repeat_earlier_text_at_the_end(s, spans, span, distance):
    sample = _sample(s, seed=s)
    out = long_range_copies(sample, spans, span, distance, np.random.default_rng(s))
    stream = torch.cat([sample["tokens"][:1], sample["labels"]])  # [s + 1]
    new = torch.cat([out["tokens"][:1], out["labels"]])  # [s + 1]
    weights = torch.cat([torch.ones(1), sample["loss_mask"]])  # [s + 1]: of stream[i]
    new_weights = torch.cat([torch.ones(1), out["loss_mask"]])
    assert torch.equal(out["tokens"][1:], out["labels"][:-1])  # still one stream
    start = s + 1 - spans * span
    assert torch.equal(new[:start], stream[:start])  # the text before the copies is kept
    assert torch.equal(new_weights[:start], weights[:start])
    assert torch.equal(out["position_ids"], sample["position_ids"])
    layout = copy_layout(s + 1, spans, span, distance, np.random.default_rng(s))
    for i, (a, b) in enumerate(layout):
        assert b == start + i * span
        assert a >= 1 and a + span <= start  # a source is text, never a copy
        assert b - (a + span) >= distance  # ends far enough before its copy
        assert torch.equal(new[b : b + span], stream[a : a + span])
        assert torch.equal(new_weights[b : b + span], weights[a : a + span])
    assert not torch.equal(new, stream)
    # the labels that predict a copied token from the copy before it: brute force
    want = torch.zeros(s, dtype=torch.bool)
    for _, b in layout:
        for j in range(b, b + span - 1):  # label j predicts stream[j + 1], after stream[j]
            want[j] = True
    assert torch.equal(copied_labels(s, spans, span), want)
    for _, b in layout:
        want[b - 1] = True  # the label of each copy's first token (stream[b], after stream[b-1])
    assert torch.equal(copied_labels(s, spans, span, with_first=True), want)


def test_copy_sources_are_drawn_over_the_whole_allowed_range():
    """A brute-force check of the layout rule: over many draws, the sources cover every start
    the rule allows, and no other."""
    s, spans, span, distance = 40, 2, 4, 10
    start = s + 1 - spans * span
    seen = [set() for _ in range(spans)]
    rng = np.random.default_rng(0)
    for _ in range(3000):
        for i, (a, _) in enumerate(copy_layout(s + 1, spans, span, distance, rng)):
            seen[i].add(a)
    for i in range(spans):
        b = start + i * span
        allowed = {a for a in range(1, s + 1) if a + span <= start and b - (a + span) >= distance}
        assert seen[i] == allowed


def test_copies_that_do_not_fit_are_refused():
    assert copy_room(2, 8, 10) == 2 * 8 + 8 + 10
    with pytest.raises(ValueError, match="do not fit"):
        copy_layout(34, 2, 8, 10, np.random.default_rng(0))  # needs 1 + 34 stream tokens
    copy_layout(35, 2, 8, 10, np.random.default_rng(0))  # exactly fits
    assert copy_room_refusal(34, 2, 8, 10) is None  # a 34-token sample: a 35-token stream
    assert "at least 34 tokens" in copy_room_refusal(33, 2, 8, 10)
    # a 3-token prefix is never copied: two tokens more than the first, and said why
    assert copy_room_refusal(36, 2, 8, 10, kept=3) is None
    with pytest.raises(ValueError, match="do not fit"):
        copy_layout(36, 2, 8, 10, np.random.default_rng(0), lo=3)  # a 35-token sample
    copy_layout(37, 2, 8, 10, np.random.default_rng(0), lo=3)
    assert "at least 36 tokens after a 3-token sample prefix" in copy_room_refusal(
        35, 2, 8, 10, kept=3
    )


def test_copy_settings_are_validated():
    from focus_pretrain.data.datasets import DataConfig

    DataConfig(seq_length=64, copy_spans=2, copy_span_tokens=16, copy_min_distance=16)
    with pytest.raises(ValueError, match=r"need samples of at least 65 tokens"):
        DataConfig(seq_length=64, copy_spans=2, copy_span_tokens=16, copy_min_distance=17)
    with pytest.raises(ValueError, match=r"data\.copy_span_tokens"):
        DataConfig(copy_spans=1, copy_span_tokens=0)
    with pytest.raises(ValueError, match=r"data\.copy_spans"):
        DataConfig(copy_spans=-1)
    for flag in ("document_mask", "reset_position_ids"):
        with pytest.raises(ValueError, match=r"data\.copy_spans with data\.document_mask"):
            DataConfig(copy_spans=1, **{flag: True})


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    from focus_pretrain.data.datasets import DataConfig, prepare_data
    from focus_pretrain.data.tokenizer import Tokenizer

    config = DataConfig(
        sources=["demo:40"],
        vocab_size=300,
        seq_length=128,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
        split="90,10,0",
    )
    tokenizer_path, prefixes = prepare_data(config)
    return config, Tokenizer(tokenizer_path), prefixes


@pytest.mark.parametrize("bos", [False, True])
def test_training_samples_get_copies_and_validation_does_not(demo_data, bos):
    from focus_pretrain.data.datasets import build_datasets

    base, tok, prefixes = demo_data
    base = replace(base, bos_every_sample=bos, add_bos=True if bos else "auto")
    config = replace(base, copy_spans=2, copy_span_tokens=8, copy_min_distance=30)
    train, valid = build_datasets(config, tok, prefixes, train_samples=8, valid_samples=4, seed=3)
    plain_train, plain_valid = build_datasets(base, tok, prefixes, 8, 4, seed=3)
    for i in range(len(plain_valid)):
        for key, value in plain_valid[i].items():
            assert torch.equal(valid[i][key], value)
    s = base.seq_length
    for i in range(8):
        sample, plain = train[i], plain_train[i]
        first = 1 if bos else 0
        if bos:  # the BOS prefix is kept first, never copied into the copies
            assert int(sample["tokens"][0]) == tok.bos
        rng = np.random.default_rng((3, i))  # the dataset's draw for sample i
        want = long_range_copies(plain, 2, 8, 30, rng, keep_first=first)
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(sample[key], want[key]), key
        assert torch.equal(sample["tokens"][: s - 16], plain["tokens"][: s - 16])
        assert not torch.equal(sample["labels"][-16:], plain["labels"][-16:])
        assert torch.equal(train[i]["tokens"], sample["tokens"])  # the same draw every time


def test_copies_after_a_longer_sample_prefix_are_refused_by_the_dataset(demo_data, monkeypatch):
    """The config checks the room after a 1-token prefix; a tokenizer whose prefix is longer
    gets one clear line when the datasets are built, not an error inside the loader."""
    from focus_pretrain.data.datasets import build_datasets
    from focus_pretrain.errors import InputError

    base, tok, prefixes = demo_data
    tight = 128 - 2 * 8 - 8  # the copies exactly fit after a 1-token prefix
    config = replace(
        base, bos_every_sample=True, add_bos=True, copy_spans=2, copy_span_tokens=8,
        copy_min_distance=tight,
    )  # fmt: skip
    train, _ = build_datasets(config, tok, prefixes, train_samples=2, valid_samples=2, seed=3)
    assert int(train[0]["tokens"][0]) == tok.bos
    monkeypatch.setattr(tok, "document_prefix", lambda add_bos: [tok.bos] * 3)
    with pytest.raises(InputError, match="after a 3-token sample prefix"):
        build_datasets(config, tok, prefixes, train_samples=2, valid_samples=2, seed=3)
