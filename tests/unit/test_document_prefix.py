"""``data.add_bos``: what every tokenised document begins with, on every path that tokenises
(in-job token files, the sharded ``preprocess`` run, ``--output-prefix``, inspection samples),
checked against ``transformers``' own encoding and recorded where token files are made."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from focus_pretrain.data import Tokenizer, demo_documents, tokenize_to_indexed, train_tokenizer
from focus_pretrain.errors import InputError
from tests.helpers import make_hf_tokenizer

TEXTS = [f"document {i}: " + " ".join(demo_documents(3, seed=i))[: 80 + 17 * i] for i in range(9)]


def hf_tokenizer(
    directory: pathlib.Path, template: str | None, add_bos_token: bool | None = None
) -> pathlib.Path:
    """A byte-level BPE tokenizer with a ``<bos>`` and an ``<eos>`` (ids 0 and 1) whose
    post-processor applies ``template`` (e.g. ``"<bos> $A"``; ``None``: no post-processor)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    make_hf_tokenizer(directory, list(demo_documents(60, seed=2)), vocab_size=420)
    tokenizer = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens(["<bos>", "<eos>"])
    if template is not None:
        ids = [(name, tokenizer.token_to_id(name)) for name in ("<bos>", "<eos>")]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=ids
        )
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>"}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> pathlib.Path:
    prefix = tmp_path_factory.mktemp("tok") / "demo"
    return train_tokenizer(demo_documents(80, seed=1), prefix, vocab_size=300)


@pytest.mark.parametrize(
    "template, add_bos_token, auto_is_bos",
    [
        ("<bos> $A", None, True),  # Gemma, Llama 3
        ("<bos> $A <eos>", None, True),  # a post-processor that also ends with EOS
        (None, None, False),  # Qwen2, SmolLM2
        ("$A", None, False),
        ("<bos> $A", False, False),  # tokenizer_config.json's switch wins (transformers')
        (None, True, True),
    ],
)
def test_auto_begins_documents_as_the_tokenizer_itself_does(
    tmp_path, template, add_bos_token, auto_is_bos
):
    path = hf_tokenizer(tmp_path / "tok", template, add_bos_token)
    tok = Tokenizer(path)
    bos = tok.bos
    assert bos is not None and tok.hf.id_to_token(bos) == "<bos>"
    assert tok.document_prefix("auto") == ([bos] if auto_is_bos else [])
    assert tok.document_prefix(True) == [bos] and tok.document_prefix(False) == []
    documents = tok.encode_documents(TEXTS, tok.document_prefix())
    for text, ids in zip(TEXTS, documents, strict=True):
        assert ids == [*tok.document_prefix(), *tok.encode(text), tok.eod]
    if add_bos_token is None:  # the post-processor alone decides: transformers encodes so
        from transformers import PreTrainedTokenizerFast

        reference = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
        for text, ids in zip(TEXTS, documents, strict=True):
            expected = reference(text)["input_ids"]
            assert expected[: len(ids) - 1] == ids[:-1]


def test_sentencepiece_auto_adds_nothing_and_true_adds_its_bos(sentencepiece):
    tok = Tokenizer(sentencepiece)
    assert tok.bos == 1 and tok.document_prefix() == [] and tok.document_prefix(True) == [1]
    for bad in ("yes", 1, None, "Auto"):
        with pytest.raises(InputError, match=r"data.add_bos is .*: use auto, true or false"):
            tok.document_prefix(bad)


def test_a_bos_asked_of_a_tokenizer_without_one_is_refused(tmp_path):
    path = make_hf_tokenizer(tmp_path / "tok", list(demo_documents(40, seed=2)), vocab_size=300)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = Tokenizer(path)
    assert tok.bos is None and tok.document_prefix() == []
    with pytest.raises(InputError, match=r"add_bos is true but tokenizer .* has no BOS"):
        tok.document_prefix(True)


def read_documents(prefix: pathlib.Path | str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return [dataset[i].tolist() for i in range(len(dataset))]


def test_every_tokenising_path_writes_and_records_the_prefix(tmp_path):
    """``tokenize_to_indexed`` (1 and 2 workers) and the sharded run write the same documents,
    each ``[BOS, text..., EOD]`` for a BOS-adding tokenizer, and record the prefix."""
    from focus_pretrain.data.shards import preprocess_corpus

    path = hf_tokenizer(tmp_path / "tok", "<bos> $A")
    tok = Tokenizer(path)
    expected = [[tok.bos, *tok.encode(t), tok.eod] for t in TEXTS]
    for workers in (1, 2):
        prefix = tmp_path / f"single{workers}"
        stats = tokenize_to_indexed(TEXTS, path, prefix, workers=workers, batch_size=4)
        assert stats["document_prefix"] == [tok.bos]
        assert read_documents(prefix) == expected
        assert json.loads((tmp_path / f"single{workers}.tokenizer.json").read_text())[
            "document_prefix"
        ] == [tok.bos]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    preprocess_corpus([str(corpus)], tmp_path / "shards", path, shard_documents=4, workers=2)
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["document_prefix"] == [tok.bos]
    sharded = [d for k in range(3) for d in read_documents(tmp_path / "shards" / f"shard-{k:05d}")]
    assert sharded == expected
    plain = tokenize_to_indexed(TEXTS, path, tmp_path / "plain", add_bos=False)
    assert plain["tokens"] == stats["tokens"] - len(TEXTS)
    assert read_documents(tmp_path / "plain") == [d[1:] for d in expected]


def test_jobs_keep_prefixed_token_files_apart_and_check_recorded_ones(sentencepiece, tmp_path):
    from focus_pretrain.data.datasets import DataConfig, prepare_data
    from focus_pretrain.data.shards import preprocess_corpus

    def config(sources, **more) -> DataConfig:
        return DataConfig(
            sources=sources, tokenizer=str(sentencepiece), cache_dir=str(tmp_path / "c"), **more
        )

    _, (auto,) = prepare_data(config(["demo:12"]))
    _, (bos,) = prepare_data(config(["demo:12"], add_bos=True))
    assert auto != bos and bos.endswith("-prefix1")  # never the other's cached files
    assert [d[1:] for d in read_documents(bos)] == read_documents(auto)
    assert {d[0] for d in read_documents(bos)} == {1}
    assert prepare_data(config([auto], add_bos=False))[1] == [auto]  # recorded [] == asked
    with pytest.raises(InputError, match=r"beginning with \[\] but data.add_bos=true asks for"):
        prepare_data(config([auto], add_bos=True))
    shards = tmp_path / "shards"
    preprocess_corpus(["demo:12"], shards, sentencepiece, shard_documents=5, add_bos=True)
    assert prepare_data(config([str(shards)]))[1][0].startswith(str(shards))  # auto: as made
    with pytest.raises(InputError, match=r"preprocess --add-bos false\) or set data.add_bos"):
        prepare_data(config([str(shards)], add_bos=False))
    with pytest.raises(ValueError, match=r"data.add_bos is 'sometimes'"):
        config(["demo:12"], add_bos="sometimes")


def test_the_preprocess_command_takes_add_bos(sentencepiece, tmp_path):
    from focus_pretrain.data.shards import preprocess_corpus

    def command(*args: str) -> subprocess.CompletedProcess:
        run = [sys.executable, "-m", "focus_pretrain.cli", "preprocess", "--input", "demo:6"]
        return subprocess.run([*run, *args], capture_output=True, text=True, timeout=300)

    out = tmp_path / "one"
    done = command(
        "--output-prefix", str(out), "--tokenizer", str(sentencepiece), "--add-bos", "true"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(pathlib.Path(f"{out}.tokenizer.json").read_text())["document_prefix"] == [1]
    assert {d[0] for d in read_documents(out)} == {1}
    bad = command(
        "--output", str(tmp_path / "x"), "--tokenizer", str(sentencepiece), "--add-bos", "on"
    )
    assert bad.returncode == 2 and "'on': use auto, true or false" in bad.stderr
    assert not (tmp_path / "x").exists()
    no_bos = make_hf_tokenizer(tmp_path / "hf", list(demo_documents(40, seed=2)), vocab_size=300)
    (no_bos / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    with pytest.raises(InputError, match=r"has no BOS token"):
        preprocess_corpus(["demo:6"], tmp_path / "y", no_bos, add_bos=True)
    assert not (tmp_path / "y").exists()  # refused before anything is written


def test_inspection_samples_begin_as_training_documents(tmp_path):
    from focus_pretrain.analysis.inputs import corpus_samples, text_samples

    tok = Tokenizer(hf_tokenizer(tmp_path / "tok", "<bos> $A"))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    prefix = tok.document_prefix()
    (sample,) = corpus_samples(
        str(corpus), tok, samples=1, length=64, max_length=128, prefix=prefix
    )
    stream = [i for t in TEXTS for i in (tok.bos, *tok.encode(t), tok.eod)]
    assert sample.ids.tolist() == stream[:64]
    (tmp_path / "a.txt").write_text(TEXTS[0])
    (text,) = text_samples([tmp_path / "a.txt"], tok, 128, None, prefix)
    assert text.ids.tolist() == [tok.bos, *tok.encode(TEXTS[0])]
    assert np.all(text.ids.numpy() < tok.vocab_size)


def megatron_like_sample(text: list[int], pad: int, masked: tuple[int, ...] = ()) -> dict:
    """What Megatron's GPTDataset returns for the ``s + 1`` window ``text``."""
    import torch

    window = torch.tensor(text)
    loss_mask = (window[1:] != pad).float()
    loss_mask[list(masked)] = 0.0
    s = len(text) - 1
    return {"tokens": window[:-1], "labels": window[1:], "loss_mask": loss_mask,
            "position_ids": torch.arange(s)}  # fmt: skip


@pytest.mark.parametrize("prefix", [(7,), (7, 8)])
def test_a_prefixed_sample_is_the_window_shifted_behind_the_prefix(prefix):
    """Brute force over a window: the new sample reads prefix + window, predicts the window's
    first token from the prefix, keeps each text token's loss weight, drops the prefix's
    own predictions and the last tokens; a window that already begins with it is kept."""
    from focus_pretrain.data.documents import prefixed_sample

    pad, s = 99, 12
    text = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, pad, pad]  # s + 1 tokens, padded at the end
    sample = megatron_like_sample(text, pad, masked=(4,))  # e.g. an EOD-masked prediction
    out = prefixed_sample(sample, prefix, pad)
    stream = [*prefix, *text][: s + 1]
    weight = {j: 1.0 for j in range(len(text))}  # of predicting text[j]
    weight.update({j + 1: float(sample["loss_mask"][j]) for j in range(s)})
    for i in range(s):
        assert int(out["tokens"][i]) == stream[i] and int(out["labels"][i]) == stream[i + 1]
        expected = 0.0 if i + 1 < len(prefix) else weight[i + 1 - len(prefix)]
        assert float(out["loss_mask"][i]) == expected, i
    assert out["position_ids"].tolist() == list(range(s))
    already = megatron_like_sample([*prefix, *text][: s + 1], pad)
    kept = prefixed_sample(already, prefix, pad)
    assert all(kept[k] is already[k] for k in already)
    assert prefixed_sample(sample, (), pad)["tokens"] is sample["tokens"]


def test_every_sample_begins_with_the_bos_when_asked(tmp_path):
    """``data.bos_every_sample`` on a BOS-adding tokenizer: every training and validation
    sample begins with it and stays a consistent next-token sample; off, windows begin
    anywhere; on a tokenizer that adds nothing, nothing changes."""
    from focus_pretrain.data.datasets import DataConfig, build_datasets, prepare_data

    path = hf_tokenizer(tmp_path / "tok", "<bos> $A")
    tok = Tokenizer(path)

    def samples(**more) -> list[dict]:
        config = DataConfig(
            sources=["demo:30"], tokenizer=str(path), seq_length=48, split="80,20,0",
            cache_dir=str(tmp_path / "c"), **more,
        )  # fmt: skip
        _, prefixes = prepare_data(config)
        train, valid = build_datasets(config, tok, prefixes, train_samples=24, valid_samples=6)
        return [train[i] for i in range(len(train))] + [valid[i] for i in range(len(valid))]

    plain, every = samples(), samples(bos_every_sample=True)
    assert sum(int(x["tokens"][0]) != tok.bos for x in plain) > len(plain) // 2
    assert len(every) == len(plain) and all(int(x["tokens"][0]) == tok.bos for x in every)
    for x, y in zip(plain, every, strict=True):
        assert x["labels"][:-1].tolist() == x["tokens"][1:].tolist()
        assert y["labels"][:-1].tolist() == y["tokens"][1:].tolist()
        if int(x["tokens"][0]) != tok.bos:  # the same window, behind the BOS
            assert y["tokens"][1:].tolist() == x["tokens"][:-1].tolist()
    no_bos = hf_tokenizer(tmp_path / "plain-tok", None)
    plain_tok = Tokenizer(no_bos)
    config = DataConfig(sources=["demo:30"], tokenizer=str(no_bos), seq_length=48,
                        cache_dir=str(tmp_path / "c2"), bos_every_sample=True)  # fmt: skip
    _, prefixes = prepare_data(config)
    train, _ = build_datasets(config, plain_tok, prefixes, train_samples=8, valid_samples=2)
    assert any(int(train[i]["tokens"][0]) != plain_tok.bos for i in range(len(train)))
