"""Data: the demo corpus, SentencePiece training, corpora to Megatron indexed datasets."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from focus_pretrain.data import (
    DemoSpec,
    Tokenizer,
    demo_document,
    demo_documents,
    load_texts,
    tokenize_to_indexed,
    train_tokenizer,
)
from focus_pretrain.data.demo_corpus import VALUES

ROOT = pathlib.Path(__file__).parents[2]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> pathlib.Path:
    prefix = tmp_path_factory.mktemp("tok") / "demo"
    return train_tokenizer(demo_documents(120, seed=1), prefix, vocab_size=384)


def test_demo_corpus_is_deterministic_and_varied():
    assert demo_document(5, seed=2) == demo_document(5, seed=2)
    assert demo_document(5, seed=2) != demo_document(6, seed=2)
    assert demo_document(5, seed=2) != demo_document(5, seed=3)
    assert list(demo_documents(3)) == [demo_document(i) for i in range(3)]


@pytest.mark.parametrize(
    "spec, window",
    [
        (DemoSpec(pairs=3, filler_sentences=16), 128),
        (DemoSpec(pairs=1, values=4, filler_sentences=2), 16),
    ],
)
def test_demo_recalls_lie_beyond_the_window(tokenizer_path, spec, window):
    """Every recalled value is defined more than ``window`` tokens earlier (the default shape
    and configs/tiny.yaml's): the sliding window cannot see the definition, Focus's same-group
    attention can."""
    tok = Tokenizer(tokenizer_path)
    for index in range(20):
        doc = demo_document(index, spec=spec)
        definitions = dict(re.findall(r"^the code of (\w+) is (\w+)\.$", doc, re.M))
        recalls = re.findall(r"^recall: the code of (\w+) is (\w+)\.$", doc, re.M)
        assert len(definitions) == spec.pairs and sorted(recalls) == sorted(definitions.items())
        assert len(set(definitions.values())) == spec.pairs
        assert set(definitions.values()) <= set(VALUES[: spec.values])
        for value in definitions.values():  # a value occurs only where it is defined/recalled
            assert doc.count(value) == 2, (index, value)
        for key, _ in recalls:
            before_def = doc.index(f"the code of {key} is")
            before_recall = doc.index(f"recall: the code of {key} is")
            gap = len(tok.encode(doc[:before_recall])) - len(tok.encode(doc[:before_def]))
            assert gap > window, (index, key, gap)


def test_tokenizer_is_llama_style_and_round_trips(tokenizer_path):
    tok = Tokenizer(tokenizer_path)
    assert (tok.vocab_size, tok.bos, tok.eod) == (384, 1, 2)
    assert tok.pad == tok.vocab_size  # outside the real ids
    pieces = [tok.processor.id_to_piece(i) for i in tok.encode("code 4821")]
    assert pieces[-4:] == ["4", "8", "2", "1"]  # one token per digit
    for text in [demo_document(200), "Unseen: ünïcödé ☃ text\twith  spaces\n"]:
        assert tok.decode(tok.encode(text)) == text  # identity normalisation, byte fallback
    assert (
        tok.unique_identifiers["sha256"] == Tokenizer(tokenizer_path).unique_identifiers["sha256"]
    )


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer model .*nope.model does not exist"):
        Tokenizer(tmp_path / "nope.model")


def test_indexed_dataset_matches_direct_tokenisation(tokenizer_path, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = [demo_document(i) for i in range(30)] + ["a tiny one", ""]
    serial = tokenize_to_indexed(texts, tokenizer_path, tmp_path / "serial", batch_size=7)
    parallel = tokenize_to_indexed(texts, tokenizer_path, tmp_path / "par", workers=2, batch_size=5)
    assert serial == parallel and serial["documents"] == 32
    for suffix in (".bin", ".idx"):  # identical bytes whatever the worker count
        assert (tmp_path / f"serial{suffix}").read_bytes() == (
            tmp_path / f"par{suffix}"
        ).read_bytes()
    dataset = IndexedDataset(str(tmp_path / "serial"))
    tok = Tokenizer(tokenizer_path)
    assert len(dataset) == 32
    for i, text in enumerate(texts):
        np.testing.assert_array_equal(dataset[i], [*tok.encode(text), tok.eod])
    assert not list(tmp_path.glob(".*tmp*"))  # temporary files renamed away


def test_load_texts_from_local_files(tmp_path):
    rows = [{"text": f"doc {i}", "id": i} for i in range(3)]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_texts(str(jsonl))["text"] == ["doc 0", "doc 1", "doc 2"]
    body = tmp_path / "body.jsonl"
    body.write_text("".join(json.dumps({"body": r["text"]}) + "\n" for r in rows))
    assert load_texts(str(body), text_key="body")["text"][2] == "doc 2"
    with pytest.raises(ValueError, match=r"has no column 'text'"):
        load_texts(str(body))
    txt_dir = tmp_path / "txt"
    txt_dir.mkdir()
    (txt_dir / "a.txt").write_text("line one\nline two\n")
    (txt_dir / "b.txt").write_text("other\n")
    assert len(load_texts(str(txt_dir))) == 2  # one .txt file is one document
    assert len(load_texts("demo:7")) == 7
    with pytest.raises(FileNotFoundError, match=r"corpus file .*missing.jsonl does not exist"):
        load_texts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"no file matches"):
        load_texts(str(tmp_path / "*.parquet"))


def test_preprocess_tool_end_to_end(tmp_path):
    prefix = tmp_path / "demo"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "preprocess_data.py"),
            "--input",
            "demo:40",
            "--output-prefix",
            str(prefix),
            "--train-tokenizer",
            "--vocab-size",
            "300",
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    assert stats["documents"] == 40 and stats["tokens"] > 40 * 300
    assert (tmp_path / "demo.model").is_file() and (tmp_path / "demo.idx").is_file()
    assert "tokenising" in result.stderr  # the progress bar


def test_prepare_and_build_gpt_datasets(tmp_path):
    """demo -> tokenizer + token files (cached) -> Megatron GPTDataset train/valid splits."""
    from focus_pretrain.data.datasets import DataConfig, build_datasets, prepare_data

    config = DataConfig(
        sources=["demo:60"],
        vocab_size=300,
        seq_length=64,
        cache_dir=str(tmp_path / "cache"),
        split="90,10,0",
    )
    tokenizer_path, prefixes = prepare_data(config)
    stamp = pathlib.Path(f"{prefixes[0]}.idx").stat().st_mtime_ns
    assert prepare_data(config) == (tokenizer_path, prefixes)  # cached, not rebuilt
    assert pathlib.Path(f"{prefixes[0]}.idx").stat().st_mtime_ns == stamp
    tok = Tokenizer(tokenizer_path)
    train, valid = build_datasets(config, tok, prefixes, train_samples=50, valid_samples=8)
    assert len(train) >= 50 and len(valid) >= 8
    sample = train[0]
    assert sample["tokens"].shape == (64,) and sample["labels"].shape == (64,)
    assert (sample["tokens"][1:] == sample["labels"][:-1]).all()  # next-token labels
    assert int(sample["tokens"].max()) < tok.vocab_size


def test_data_config_errors():
    from focus_pretrain.data.datasets import DataConfig

    with pytest.raises(ValueError, match=r"data.weights has 1 entries for 2 data.sources"):
        DataConfig(sources=["a", "b"], weights=[1.0])
    with pytest.raises(ValueError, match=r"data.split must be three numbers like '98,2,0'"):
        DataConfig(split="90,10")
    with pytest.raises(FileNotFoundError, match=r"tokenizer model .*x.model does not exist"):
        from focus_pretrain.data.datasets import prepare_data

        prepare_data(DataConfig(tokenizer="/nonexistent/x.model"))
    with pytest.raises(ValueError, match=r"data.demo_pairs \(5\) <= data.demo_values \(4\)"):
        DataConfig(demo_pairs=5, demo_values=4)
    with pytest.raises(ValueError, match=r"pairs \(2\) <= values \(65\) <= 64"):
        demo_document(0, spec=DemoSpec(pairs=2, values=65))


def test_resumable_sampler_continues_the_same_stream():
    from focus_pretrain.data.datasets import ResumableSampler

    full = [list(ResumableSampler(40, 0, 3, rank, 2)) for rank in (0, 1)]
    assert full[0][:2] == [[0, 1, 2], [6, 7, 8]] and full[1][0] == [3, 4, 5]
    resumed = [list(ResumableSampler(40, 2 * 3 * 2, 3, rank, 2)) for rank in (0, 1)]
    assert resumed[0] == full[0][2:] and resumed[1] == full[1][2:]
    assert len(ResumableSampler(40, 12, 3, 0, 2)) == len(resumed[0])


def test_token_files_of_another_tokenizer_are_refused(tokenizer_path, tmp_path):
    """Token files record their tokenizer; pairing them with another one is a clear error."""
    from focus_pretrain.data.datasets import DataConfig, prepare_data

    prefix = tmp_path / "tokens" / "demo"
    tokenize_to_indexed(demo_documents(10, seed=3), tokenizer_path, prefix)
    same = DataConfig(sources=[str(prefix)], tokenizer=str(tokenizer_path), cache_dir=str(tmp_path))
    assert prepare_data(same) == (tokenizer_path, [str(prefix)])
    other = train_tokenizer(demo_documents(60, seed=4), tmp_path / "other", vocab_size=300)
    wrong = DataConfig(sources=[str(prefix)], tokenizer=str(other), cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"were made with tokenizer .* but data.tokenizer is"):
        prepare_data(wrong)


def test_huggingface_tokenizer_directory(tmp_path):
    """A pretrained model's own tokenizer (``tokenizer.json``) tokenises corpora for retrofit."""
    from focus_pretrain.data.datasets import DataConfig, build_datasets, prepare_data
    from tests.helpers import make_hf_tokenizer

    path = make_hf_tokenizer(tmp_path / "hf-tok", demo_documents(100, seed=5), vocab_size=400)
    tok = Tokenizer(path)
    assert tok.vocab_size == 400 and tok.eod == tok.bos == 0 and tok.pad == 400
    text = demo_document(3, seed=9)
    assert tok.decode(tok.encode(text)) == text
    assert [t for t, _, _ in tok.encode_with_offsets(text)] == tok.encode(text)
    config = DataConfig(
        sources=["demo:40"], tokenizer=str(path), seq_length=64, cache_dir=str(tmp_path / "c")
    )
    tokenizer_path, prefixes = prepare_data(config)
    assert tokenizer_path == path
    train, _ = build_datasets(config, tok, prefixes, train_samples=20, valid_samples=2)
    sample = train[0]["tokens"].tolist()
    assert tok.eod in sample or len(set(sample)) > 10
    assert max(sample) < 400
    with pytest.raises(FileNotFoundError, match=r"directory without tokenizer.json"):
        Tokenizer(tmp_path)


@pytest.mark.parametrize("blank", ["", "\n  \n"], ids=["empty", "whitespace"])
def test_a_job_tokenising_an_empty_file_refuses_it_as_preprocess_does(
    tokenizer_path, tmp_path, blank
):
    """``data.tokenize_in_job`` with an empty file among the sources: one line naming it
    (was: a zero-weight blend, megatron's assertion; alone, a misleading split error); with a
    tokenizer to train on it, the same line. No token files of it, no tokenizer are made."""
    from focus_pretrain.data.datasets import DataConfig, prepare_data
    from focus_pretrain.errors import InputError

    empty, text = tmp_path / "empty.txt", tmp_path / "text.txt"
    empty.write_text(blank)
    text.write_text(" ".join(demo_documents(20, seed=2)))
    cache = tmp_path / "cache"
    for sources, tokenizer in [
        ([str(text), str(empty)], str(tokenizer_path)),
        ([str(empty)], str(tokenizer_path)),
        ([str(empty), str(text)], None),  # a tokenizer trained on data.sources[0]
    ]:
        config = DataConfig(
            sources=sources, tokenizer=tokenizer, cache_dir=str(cache), tokenize_in_job=True
        )
        with pytest.raises(InputError, match=rf"{re.escape(str(empty))} holds no text"):
            prepare_data(config, in_job=True)
    assert not list(cache.glob("*empty*")) and not list(cache.glob("tokenizer-*"))
