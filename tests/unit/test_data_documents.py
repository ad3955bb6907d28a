"""Document-aware samples: document starts, restarting positions, the EOD loss mask, and the
selection of short and long documents."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from focus_pretrain.data.documents import document_fields, eod_document_starts, select_documents

EOD = 2


def test_document_fields_of_a_constructed_sample():
    tokens = torch.tensor([5, 6, EOD, 7, EOD, EOD, 8, 9, 4])
    sample = dict(
        tokens=tokens,
        labels=torch.roll(tokens, -1),
        loss_mask=torch.ones(9),
        position_ids=torch.arange(9),
    )
    starts = eod_document_starts(tokens, EOD)
    assert starts.tolist() == [0, 0, 0, 3, 3, 5, 6, 6, 6]  # the EOD ends its document
    out = document_fields(sample, EOD, document_mask=True, reset_position_ids=True,
                          eod_mask_loss=True)  # fmt: skip
    assert torch.equal(out["documents"], starts)
    assert out["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 0, 1, 2]
    assert torch.equal(out["rope_positions"], out["position_ids"])
    assert out["loss_mask"].tolist() == [1, 1, 0, 1, 0, 0, 1, 1, 1]
    plain = document_fields(sample, EOD, document_mask=False, reset_position_ids=False,
                            eod_mask_loss=False)  # fmt: skip
    assert set(plain) == set(sample) and torch.equal(plain["position_ids"], torch.arange(9))


def test_select_documents_filters_and_repeats():
    lengths = np.array([5, 50, 1, 200, 30, 120])
    indices = np.array([0, 1, 3, 4, 5])  # document 2 is in another split
    assert select_documents(lengths, indices).tolist() == [0, 1, 3, 4, 5]
    assert select_documents(lengths, indices, min_tokens=30).tolist() == [1, 3, 4, 5]
    repeated = select_documents(lengths, indices, min_tokens=10, long_tokens=100, long_repeat=3)
    assert repeated.tolist() == [1, 3, 3, 3, 4, 5, 5, 5]


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    from focus_pretrain.data.datasets import DataConfig, prepare_data
    from focus_pretrain.data.tokenizer import Tokenizer

    config = DataConfig(
        sources=["demo:40"],
        demo_filler_sentences=2,  # short documents: many boundaries per sample
        vocab_size=300,
        seq_length=256,
        cache_dir=str(tmp_path_factory.mktemp("cache")),
        split="90,10,0",
    )
    tokenizer_path, prefixes = prepare_data(config)
    return config, Tokenizer(tokenizer_path), prefixes


def test_gpt_dataset_samples_carry_the_document_fields(demo_data):
    from dataclasses import replace

    from focus_pretrain.data.datasets import build_datasets

    base, tok, prefixes = demo_data
    config = replace(base, document_mask=True, reset_position_ids=True, eod_mask_loss=True)
    train, _ = build_datasets(config, tok, prefixes, train_samples=20, valid_samples=2)
    plain, _ = build_datasets(base, tok, prefixes, train_samples=20, valid_samples=2)
    eods = 0
    for i in range(20):
        sample, reference = train[i], plain[i]
        assert torch.equal(sample["tokens"], reference["tokens"])  # the same packing
        tokens = sample["tokens"]
        is_eod = tokens == tok.eod
        eods += int(is_eod.sum())
        # loss masked exactly on the EOD inputs (counted), nowhere else
        assert int((sample["loss_mask"] == 0).sum()) == int(is_eod.sum())
        assert (sample["loss_mask"][is_eod] == 0).all()
        starts = sample["documents"]
        assert torch.equal(sample["position_ids"], torch.arange(len(tokens)) - starts)
        after_eod = torch.nonzero(is_eod[:-1]).flatten() + 1
        assert (sample["position_ids"][after_eod] == 0).all()
    assert eods > 5  # demo documents are shorter than a sample: there were boundaries


def test_min_and_long_document_options_change_the_documents(demo_data):
    from dataclasses import replace

    from focus_pretrain.data.datasets import build_datasets

    base, tok, prefixes = demo_data
    plain, _ = build_datasets(base, tok, prefixes, train_samples=10, valid_samples=2)
    lengths = plain.dataset.sequence_lengths
    cut = int(np.median(lengths[plain.indices]))
    config = replace(base, min_document_tokens=cut, long_document_tokens=cut + 1,
                     long_document_repeat=2)  # fmt: skip
    chosen, _ = build_datasets(config, tok, prefixes, train_samples=10, valid_samples=2)
    want = select_documents(lengths, plain.indices, min_tokens=cut, long_tokens=cut + 1,
                            long_repeat=2)  # fmt: skip
    assert chosen.indices.tolist() == want.tolist()
    assert (lengths[chosen.indices] >= cut).all() and len(set(chosen.indices)) < len(want)
    valid_plain, valid_chosen = (
        build_datasets(c, tok, prefixes, train_samples=10, valid_samples=2)[1]
        for c in (base, config)
    )
    assert valid_chosen.indices.tolist() == valid_plain.indices.tolist()  # validation as is
    with pytest.raises(ValueError, match=r"data\.min_document_tokens=100000 leaves no document"):
        build_datasets(replace(base, min_document_tokens=100_000), tok, prefixes, 10, 2)


def test_document_keys_are_validated():
    from focus_pretrain.data.datasets import DataConfig

    with pytest.raises(ValueError, match=r"data\.long_document_tokens"):
        DataConfig(long_document_repeat=4)
    with pytest.raises(ValueError, match=r"data\.min_document_tokens"):
        DataConfig(min_document_tokens=-1)
    with pytest.raises(ValueError, match=r"data\.long_document_repeat is 1"):
        DataConfig(long_document_tokens=1000)


def test_probes_and_recall_are_scored_as_the_run_packs():
    """A run with document masking scores its probes with the same document fields (the EOD
    padding before a probe is a document of its own)."""
    from focus_pretrain.train.scoring import Packing

    tokens = torch.tensor([[EOD, EOD, 5, 6, 7, EOD, 8]])
    fields = Packing(EOD, document_mask=True, reset_position_ids=True).fields(tokens)
    assert fields["documents"].tolist() == [[0, 1, 2, 2, 2, 2, 6]]
    assert fields["rope_positions"].tolist() == [[0, 0, 0, 1, 2, 3, 0]]
    assert Packing(EOD, document_mask=False, reset_position_ids=False).fields(tokens) == {}
