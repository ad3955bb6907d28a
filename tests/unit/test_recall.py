"""The long-range recall batch marks exactly the recall lines' keys and values."""

from __future__ import annotations

import re

import pytest

from focus_pretrain.data import DemoSpec, Tokenizer, demo_document, demo_documents, train_tokenizer
from focus_pretrain.train.recall import HELD_OUT_SEED_OFFSET, recall_batch


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    prefix = tmp_path_factory.mktemp("tok") / "demo"
    return Tokenizer(train_tokenizer(demo_documents(150, seed=1), prefix, vocab_size=400))


@pytest.mark.parametrize("pairs, filler, seq", [(1, 2, 96), (3, 4, 256), (4, 16, 512)])
def test_masks_mark_the_recalled_keys_and_values(tokenizer, pairs, filler, seq):
    spec = DemoSpec(pairs=pairs, filler_sentences=filler)
    batch = recall_batch(tokenizer, seq, 6, seed=7, spec=spec)
    assert batch.tokens.shape == batch.labels.shape == (6, seq)
    assert (batch.tokens[:, 1:] == batch.labels[:, :-1]).all()
    assert not (batch.key_mask & batch.value_mask).any()
    assert not ((batch.key_mask | batch.value_mask) & ~batch.valid_mask).any()
    for row in range(6):
        text = demo_document(row, 7 + HELD_OUT_SEED_OFFSET, spec)
        kept = len(tokenizer.decode(batch.labels[row].tolist()))  # characters the labels cover
        assert text.startswith(tokenizer.decode(batch.labels[row].tolist()).rstrip("\n"))
        recalls = list(re.finditer(r"recall: the code of (\w+) is (\w+)\.", text))
        assert recalls, "every document has recalls"

        keys = tokenizer.decode(batch.labels[row][batch.key_mask[row]].tolist())
        values = tokenizer.decode(batch.labels[row][batch.value_mask[row]].tolist())
        assert keys.split() == _fitting(text, recalls, 1, kept)
        assert values.split() == _fitting(text, recalls, 2, kept)
        assert _fitting(text, recalls, 2, kept), "at least one recalled value fits"


def _fitting(text: str, recalls: list, group: int, kept: int) -> list[str]:
    """The part of each recalled key (1) or value (2) that lies in the first ``kept`` chars."""
    return [
        text[m.start(group) : min(m.end(group), kept)] for m in recalls if m.start(group) < kept
    ]


def test_recalls_beyond_the_sequence_are_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match=r"raise data\.seq_length"):
        recall_batch(tokenizer, 32, 2, spec=DemoSpec(filler_sentences=16))
