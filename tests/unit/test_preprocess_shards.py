"""Offline preprocessing at scale: sharded token files (deterministic whatever the worker
count, resumable), strict reading of bad input, training on the shards, and the data wait of a
distributed job."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
import torch.distributed as dist

from focus_pretrain.config import load_config
from focus_pretrain.data import Tokenizer, demo_documents, tokenize_to_indexed, train_tokenizer
from focus_pretrain.data.coordinate import DataWaitError, prepare_data_in_job, rank0_first
from focus_pretrain.data.corpus import BadRecordError, ReadOptions
from focus_pretrain.data.datasets import DataConfig, blend_weights, build_datasets, prepare_data
from focus_pretrain.data.shards import (
    KILL_HOOK,
    preprocess_corpus,
    read_manifest,
    tokenizer_sha256,
)
from focus_pretrain.errors import InputError
from tests.helpers import make_hf_tokenizer

ROOT = pathlib.Path(__file__).parents[2]
TOOL = str(ROOT / "tools" / "preprocess_data.py")


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> pathlib.Path:
    prefix = tmp_path_factory.mktemp("tok") / "demo"
    return train_tokenizer(demo_documents(80, seed=1), prefix, vocab_size=300)


def write_jsonl(path: pathlib.Path, texts: list[str]) -> pathlib.Path:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def shard_files(out: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*")) if p.suffix != ".json"}


def run_tool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, TOOL, *args],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, **(env or {})},
    )


def test_workers_do_not_change_the_shards(tokenizer_path, tmp_path):
    """Many inputs of every kind -> shards of 8 records; 1 and 2 workers write the same bytes,
    and the shards hold every document, in input order, each ending with EOD."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    a = [*demo_documents(11, seed=2), ""]  # an empty text is still a document (EOD alone)
    b = list(demo_documents(9, seed=3))
    write_jsonl(tmp_path / "a.jsonl", a)
    write_jsonl(tmp_path / "b.jsonl", b)
    rows = [f"parquet row {i}: {t[:200]}" for i, t in enumerate(demo_documents(6, seed=4))]
    pq.write_table(pa.table({"text": rows}), tmp_path / "c.parquet", row_group_size=4)
    (tmp_path / "txt" / "deep").mkdir(parents=True)
    (tmp_path / "txt" / "x.txt").write_text("first file\nline two\r\n")
    (tmp_path / "txt" / "deep" / "y.txt").write_text("second file ünïcödé")
    inputs = [str(tmp_path / "*.jsonl"), str(tmp_path / "c.parquet"), str(tmp_path / "txt")]
    inputs.append("demo:5")
    texts = [*a, *b, *rows, "second file ünïcödé", "first file\nline two\r\n"]
    texts += list(demo_documents(5))
    one = preprocess_corpus(inputs, tmp_path / "w1", tokenizer_path, shard_documents=8)
    two = preprocess_corpus(inputs, tmp_path / "w2", tokenizer_path, shard_documents=8, workers=2)
    assert one["shards"] == two["shards"] == 5 and one["documents"] == len(texts) == 34
    assert shard_files(tmp_path / "w1") == shard_files(tmp_path / "w2")
    assert len(shard_files(tmp_path / "w1")) == 10
    manifest = read_manifest(tmp_path / "w1" / "manifest.json")
    assert manifest == read_manifest(tmp_path / "w2" / "manifest.json")
    tok = Tokenizer(tokenizer_path)
    assert manifest["tokenizer"]["sha256"].startswith(tok.unique_identifiers["sha256"])
    assert [s["documents"] for s in manifest["shards"]] == [8, 8, 8, 8, 2]
    documents = []
    for shard in manifest["shards"]:
        dataset = IndexedDataset(str(tmp_path / "w1" / shard["name"]))
        assert shard["tokens"] == int(dataset.sequence_lengths.sum())
        documents += [dataset[i].tolist() for i in range(len(dataset))]
    assert documents == [[*tok.encode(t), tok.eod] for t in texts]
    assert manifest["tokens"] == one["tokens"] == sum(map(len, documents))


def test_an_interrupted_run_resumes_without_redoing_shards(tokenizer_path, tmp_path):
    """SIGKILL while the third shard is half written: the rerun removes the partial files,
    keeps the two finished shards untouched and ends with what an uninterrupted run writes."""
    corpus = write_jsonl(tmp_path / "c.jsonl", list(demo_documents(23, seed=5)))
    args = ["--input", str(corpus), "--tokenizer", str(tokenizer_path), "--shard-documents", "5"]
    out = tmp_path / "out"
    killed = run_tool(*args, "--output", str(out), "--workers", "1", env={KILL_HOOK: "2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert sorted(p.name for p in out.glob("shard-*.idx")) == ["shard-00000.idx", "shard-00001.idx"]
    assert list(out.glob(".shard-00002.tmp*.bin")) and not (out / "manifest.json").exists()
    done = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    time.sleep(0.05)  # a rewrite would show in the mtimes
    resumed = run_tool(*args, "--output", str(out), "--workers", "2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    stats = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert (stats["shards"], stats["shards_reused"], stats["shards_written"]) == (5, 2, 3)
    assert "resumed: 2 of 5 shards were already done" in resumed.stdout
    assert "tokens/s" in resumed.stdout and "tokenising" in resumed.stderr  # rate, progress bar
    assert {name: (out / name).stat().st_mtime_ns for name in done} == done
    assert not list(out.glob(".*tmp*"))
    whole = preprocess_corpus([str(corpus)], tmp_path / "whole", tokenizer_path, shard_documents=5)
    assert shard_files(out) == shard_files(tmp_path / "whole")
    assert read_manifest(out / "manifest.json") == read_manifest(tmp_path / "whole/manifest.json")
    assert whole["documents"] == stats["documents"] == 23
    assert json.loads((out / "stats.json").read_text())["shards_written"] == 3
    again = preprocess_corpus([str(corpus)], out, tokenizer_path, shard_documents=5)
    assert again["shards_written"] == 0  # complete: nothing to do
    with pytest.raises(ValueError, match=r"other settings \(shard_documents differ\).*--overwrite"):
        preprocess_corpus([str(corpus)], out, tokenizer_path, shard_documents=4)


def test_a_trained_tokenizer_is_part_of_the_run(tmp_path):
    """The tokenizer the run trains follows its inputs and --vocab-size: a changed vocab_size is
    refused once a shard is finished, and before that (as are changed inputs) trains again."""
    corpus = write_jsonl(tmp_path / "c.jsonl", list(demo_documents(80, seed=9)))
    out, model = tmp_path / "out", tmp_path / "out" / "tokenizer.model"

    def run(vocab_size: int, **kwargs) -> dict:
        kwargs.setdefault("tokenizer", None)
        return preprocess_corpus(
            [str(corpus)], out, vocab_size=vocab_size, shard_documents=30, progress=False, **kwargs
        )

    def interrupt_before_any_shard() -> None:
        for path in [*out.glob("shard-*"), out / "manifest.json"]:
            path.unlink()

    run(300)
    first = tokenizer_sha256(model)
    assert Tokenizer(model).vocab_size == 300
    with pytest.raises(ValueError, match=r"other settings \(vocab_size differ\)"):
        run(320)
    assert run(300)["shards_written"] == 0 and tokenizer_sha256(model) == first
    interrupt_before_any_shard()
    run(320)
    assert (
        Tokenizer(model).vocab_size
        == read_manifest(out / "manifest.json")["tokenizer"]["vocab_size"]
        == 320
    )
    second = tokenizer_sha256(model)
    interrupt_before_any_shard()
    write_jsonl(corpus, [f"zebra quokka {t}" for t in demo_documents(80, seed=10)])
    run(320)
    third = tokenizer_sha256(model)
    assert len({first, second, third}) == 3  # trained again on the new inputs
    assert read_manifest(out / "manifest.json")["tokenizer"]["sha256"] == third
    run(320, tokenizer=model, overwrite=True)  # a given tokenizer is never removed
    assert tokenizer_sha256(model) == third


@pytest.mark.parametrize("trained", [True, False], ids=["train-tokenizer", "given-tokenizer"])
def test_a_users_files_where_the_run_writes_are_refused_and_kept(tokenizer_path, tmp_path, trained):
    """An --output directory that is no run of this command (no plan) but holds a file of the
    names a run writes (tokenizer.model and .vocab when it trains one, stats.json) is refused,
    the files kept; --overwrite replaces them."""
    out = tmp_path / "out"
    out.mkdir()
    names = ["tokenizer.model", "tokenizer.vocab"] if trained else ["stats.json"]
    for name in [*names, "notes.txt"]:
        (out / name).write_text(f"the user's {name}")
    tokenizer = None if trained else tokenizer_path

    def run(**kwargs) -> dict:
        return preprocess_corpus(
            ["demo:40"], out, tokenizer, vocab_size=300, progress=False, **kwargs
        )

    with pytest.raises(InputError, match=rf"{out} already holds {names[0]}.* but no \.plan"):
        run()
    for name in [*names, "notes.txt"]:
        assert (out / name).read_text() == f"the user's {name}"
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, "notes.txt"])
    assert run(overwrite=True)["documents"] == 40
    assert (out / "notes.txt").read_text() == "the user's notes.txt"
    assert (out / "stats.json").read_text() != "the user's stats.json"


def test_adding_skip_bad_records_resumes_the_run(tokenizer_path, tmp_path):
    """A run stopped by a bad record resumes with --skip-bad-records, keeping the finished
    shards; turning it off again, with shards finished under it, is refused."""
    texts = list(demo_documents(12, seed=11))
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    lines = corpus.read_text().splitlines(keepends=True)
    corpus.write_text("".join([*lines[:7], '{"text": 3}\n', *lines[7:]]))
    out = tmp_path / "out"
    skip = ReadOptions(skip_bad_records=True)

    def run(options: ReadOptions, where=out) -> dict:
        return preprocess_corpus(
            [str(corpus)], where, tokenizer_path, shard_documents=5, options=options, progress=False
        )

    with pytest.raises(BadRecordError, match=r"c.jsonl:8: .*or pass --skip-bad-records"):
        run(ReadOptions())
    assert [p.name for p in out.glob("shard-*.idx")] == ["shard-00000.idx"]
    done = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-00000.*")}
    time.sleep(0.05)
    stats = run(skip)
    assert (stats["shards"], stats["shards_reused"], stats["shards_written"]) == (3, 1, 2)
    assert stats["skipped"] == {"not_a_string": 1} and stats["documents"] == 12
    assert {name: (out / name).stat().st_mtime_ns for name in done} == done
    run(skip, tmp_path / "whole")
    assert shard_files(out) == shard_files(tmp_path / "whole")
    assert read_manifest(out / "manifest.json") == read_manifest(tmp_path / "whole/manifest.json")
    assert read_manifest(out / "manifest.json")["skip_bad_records"] is True
    assert run(skip)["shards_written"] == 0
    with pytest.raises(ValueError, match=r"other settings \(skip_bad_records differ\)"):
        run(ReadOptions())


BAD_INPUTS = [  # file, content, error (file:line: what; fix), kind, good documents left
    (
        "empty.jsonl",
        b"",
        r"empty.jsonl: empty input file \(no records\); remove it",
        "empty_files",
        2,
    ),
    (
        "bad.jsonl",
        b'{"text": "good"}\n{"body": "no text"}\n',
        r"bad.jsonl:2: the record has no 'text' field \(its fields: body\); pass --text-key",
        "missing_field",
        3,
    ),
    (
        "bad.jsonl",
        b'{"text": "good"}\n\n{"text": "caf\xe9"}\n',
        r"bad.jsonl:3: not valid UTF-8 \(byte 0xe9 at column 14\); re-encode the file as UTF-8",
        "invalid_utf8",
        3,
    ),
    (
        "bad.jsonl",
        b'{"text": "good"}\n{"text": "no comma" "x": 1}\n',
        r"bad.jsonl:2: invalid JSON \(Expecting ',' delimiter at column 21\); fix or remove",
        "invalid_json",
        3,
    ),
    (
        "bad.txt",
        b"one\ntwo \xff\n",
        r"bad.txt:2: not valid UTF-8 \(byte 0xff at column 5\)",
        "invalid_utf8",
        2,
    ),
]


@pytest.mark.parametrize("name, content, message, kind, good", BAD_INPUTS)
def test_bad_input_names_file_and_line_or_is_skipped(
    tokenizer_path, tmp_path, name, content, message, kind, good
):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / name).write_bytes(content)
    write_jsonl(tmp_path / "in" / "ok.jsonl", ["fine one", "fine two"])
    inputs = [str(tmp_path / "in")]
    with pytest.raises(BadRecordError, match=message + r".*or pass --skip-bad-records"):
        preprocess_corpus(inputs, tmp_path / "out", tokenizer_path, progress=False)
    skip = ReadOptions(skip_bad_records=True)
    stats = preprocess_corpus(inputs, tmp_path / "out", tokenizer_path, options=skip)
    assert stats["skipped"] == {kind: 1} and stats["documents"] == good
    assert re.search(message.split(";")[0], stats["skipped_examples"][0])
    manifest = read_manifest(tmp_path / "out" / "manifest.json")
    assert manifest["skipped"] == {kind: 1} and manifest["skipped_total"] == 1


def test_the_tool_reports_bad_records(tokenizer_path, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(b'{"text": "good"}\n{"text": 3}\n{"text": "also good"}\n')
    args = ["--input", str(corpus), "--tokenizer", str(tokenizer_path), "--workers", "1"]
    failed = run_tool(*args, "--output", str(tmp_path / "a"))
    assert failed.returncode != 0
    assert f"error: {corpus}:2: field 'text' is int, not a string" in failed.stderr
    skipped = run_tool(*args, "--output-prefix", str(tmp_path / "b"), "--skip-bad-records")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert "skipped 1 bad records (not_a_string: 1)" in skipped.stdout
    stats = json.loads(skipped.stdout.strip().splitlines()[-1])
    assert stats["documents"] == 2 and stats["skipped"] == {"not_a_string": 1}


# -- training on shards ------------------------------------------------------------------------


@pytest.fixture
def process_group(tmp_path):
    """A one-rank gloo group: Megatron's blends need one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_training_reads_a_shard_directory(tokenizer_path, tmp_path, process_group):
    out = tmp_path / "shards"
    texts = list(demo_documents(40, seed=6))
    preprocess_corpus(
        [str(write_jsonl(tmp_path / "c.jsonl", texts))],
        out,
        tokenizer_path,
        shard_documents=15,
        progress=False,
    )
    single = tmp_path / "single" / "demo"
    tokenize_to_indexed(demo_documents(20, seed=7), tokenizer_path, single)
    config = DataConfig(
        sources=[str(out), str(single)],
        tokenizer=str(tokenizer_path),
        seq_length=64,
        split="50,50,0",  # each shard is split on its own: every one needs valid documents
        cache_dir=str(tmp_path / "cache"),
    )
    tokenizer_file, prefixes = prepare_data_in_job(config)  # tokenised already: allowed
    assert tokenizer_file == tokenizer_path
    assert prefixes == [str(out / f"shard-0000{k}") for k in range(3)] + [str(single)]
    shard_tokens = [s["tokens"] for s in read_manifest(out / "manifest.json")["shards"]]
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    single_dataset = IndexedDataset(str(single))  # alive while its mapped lengths are read
    single_tokens = int(single_dataset.sequence_lengths.sum())
    assert blend_weights(config, prefixes) == [*shard_tokens, single_tokens]  # by size
    weighted = replace(config, weights=[3.0, 1.0])
    weights = blend_weights(weighted, prefixes)
    assert sum(weights[:3]) == pytest.approx(3.0) and weights[3] == 1.0
    assert weights[0] / weights[1] == pytest.approx(shard_tokens[0] / shard_tokens[1])
    by_manifest = replace(config, sources=[str(out / "manifest.json")])
    assert prepare_data(by_manifest)[1] == prefixes[:3]
    tok = Tokenizer(tokenizer_path)
    train, valid = build_datasets(config, tok, prefixes, train_samples=40, valid_samples=4)
    assert len(train) >= 40 and len(valid) >= 4
    assert int(train[0]["tokens"].max()) < tok.vocab_size


def test_shard_directories_are_checked(tokenizer_path, tmp_path):
    out = tmp_path / "shards"
    preprocess_corpus(["demo:12"], out, tokenizer_path, shard_documents=5, progress=False)
    other = train_tokenizer(demo_documents(60, seed=8), tmp_path / "other", vocab_size=320)
    config = DataConfig(sources=[str(out)], tokenizer=str(other), cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"shards of .*manifest.json were made with tokenizer"):
        prepare_data(config)
    untrained = DataConfig(sources=[str(out)], cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"data.tokenizer is null.*is token files"):
        prepare_data(untrained)
    (out / "manifest.json").unlink()
    mine = DataConfig(sources=[str(out)], tokenizer=str(tokenizer_path), cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"no manifest.json: .* rerun the same command"):
        prepare_data(mine)


def test_a_job_refuses_a_raw_corpus(tokenizer_path, tmp_path):
    """A recipe naming a raw corpus, without data.tokenize_in_job, fails with the command."""
    corpus = write_jsonl(tmp_path / "web.jsonl", ["some text", "more text"])
    sets = [f'data.sources=["{corpus}"]', f"data.cache_dir={tmp_path / 'cache'}"]
    config = load_config(
        ROOT / "configs" / "tiny.yaml", [*sets, f"data.tokenizer={tokenizer_path}"]
    )
    assert not config.data.tokenize_in_job and config.data.prepare_timeout_s == 1800
    with pytest.raises(ValueError) as refused:
        prepare_data_in_job(config.data)
    text = str(refused.value)
    assert f"data.sources {corpus}: a raw corpus" in text
    out = tmp_path / "cache" / "shards"
    assert f"focus-pretrain preprocess --input {corpus} --output {out}/web_jsonl-" in text
    assert f"--tokenizer {tokenizer_path} --workers $(nproc)" in text
    assert "--set 'data.sources=[" in text and "data.tokenize_in_job=true" in text
    untrained = load_config(ROOT / "configs" / "tiny.yaml", sets)
    with pytest.raises(
        ValueError, match=r"(?s)--train-tokenizer --vocab-size 1024 .*data.tokenizer="
    ):
        prepare_data_in_job(untrained.data)
    assert not (tmp_path / "cache").exists()  # nothing tokenised or trained
    hf_tokenizer = make_hf_tokenizer(tmp_path / "hf", ["some text", "more text"] * 20, 300)
    retrofit = load_config(
        ROOT / "configs" / "tiny.yaml", [*sets, f"data.tokenizer={hf_tokenizer}"]
    )
    with pytest.raises(
        InputError
    ) as refused:  # a retrofit's: its model's tokenizer, never a new one
        prepare_data_in_job(retrofit.data)
    assert f"--tokenizer {hf_tokenizer} --workers" in str(refused.value)
    assert "--train-tokenizer" not in str(refused.value)
    allowed = load_config(
        ROOT / "configs" / "tiny.yaml",
        [*sets, f"data.tokenizer={tokenizer_path}", "data.tokenize_in_job=true"],
    )
    _, prefixes = prepare_data_in_job(allowed.data)
    assert pathlib.Path(f"{prefixes[0]}.idx").is_file()
    missing = load_config(ROOT / "configs" / "tiny.yaml", ['data.sources=["/no/such/c.jsonl"]'])
    with pytest.raises(FileNotFoundError, match=r"corpus file /no/such/c.jsonl does not exist"):
        prepare_data_in_job(missing.data)
    with pytest.raises(ValueError, match=r"data.prepare_timeout_s must be > 0"):
        DataConfig(prepare_timeout_s=0)


# -- the data wait of a job --------------------------------------------------------------------


def run_ranks(fns, timeout_s: float) -> list[object]:
    """``rank0_first(fns[r])`` on two threads sharing one store: each rank's result or error."""
    store = dist.HashStore()
    results: list[object] = [None, None]

    def rank(r: int) -> None:
        try:
            results[r] = rank0_first(
                fns[r], timeout_s=timeout_s, group=(store, r, 2), key="test/prepare"
            )
        except Exception as error:
            results[r] = error

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)  # a hang guard
    return results


def test_rank0_prepares_first_and_others_follow():
    order: list[int] = []

    def prepare(r: int):
        def fn() -> int:
            time.sleep(0.2 if r == 0 else 0)
            order.append(r)
            return r

        return fn

    assert run_ranks([prepare(0), prepare(1)], timeout_s=60) == [0, 1]
    assert order == [0, 1]


def test_waiting_ranks_time_out_with_a_clear_error():
    """Rank 0 takes longer than the timeout: rank 1 gives up with the setting and the fix, and
    rank 0, once done, fails too instead of waiting on a collective."""
    slow = [lambda: time.sleep(1.5), lambda: pytest.fail("must not run")]
    rank0, rank1 = run_ranks(slow, timeout_s=0.3)
    assert isinstance(rank1, DataWaitError)
    assert (
        "rank 1: rank 0 did not finish preparing the data within data.prepare_timeout_s=0.3 s"
        in str(rank1)
    )
    assert "focus-pretrain preprocess" in str(rank1)
    assert isinstance(rank0, DataWaitError) and "rank 1 (maybe others) gave up" in str(rank0)


def test_rank0_failure_reaches_every_rank():
    def fail():
        raise FileNotFoundError("corpus file /x.jsonl does not exist")

    rank0, rank1 = run_ranks([fail, lambda: pytest.fail("must not run")], timeout_s=60)
    assert isinstance(rank0, FileNotFoundError)
    assert isinstance(rank1, DataWaitError)
    assert "rank 0 failed to prepare the data: FileNotFoundError: corpus file /x.jsonl" in str(
        rank1
    )


def slow_rank0(rank: int, world_size: int) -> str:
    """Worker: rank 0 takes 3 s, the others wait 0.5 s at most (the default group's store)."""
    try:
        rank0_first(lambda: time.sleep(3 if rank == 0 else 0), timeout_s=0.5)
    except DataWaitError as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
def test_the_default_process_group_store_times_out():
    from tests.distributed import run_workers

    rank0, rank1 = run_workers("tests.unit.test_preprocess_shards:slow_rank0", 2)
    assert "rank 1: rank 0 did not finish preparing the data within" in rank1
    assert "gave up waiting" in rank0


def test_progress_moves_with_each_batch_and_each_phase_is_said(tmp_path, monkeypatch, capsys):
    """The bar counts documents as batches finish (not only at a shard's end): the reports
    sum to the run's documents and tokens; indexing, tokenizer training and the shard plan
    each print a line."""
    from focus_pretrain.data import shard_writer

    reports: list[tuple[int, int]] = []
    monkeypatch.setattr(shard_writer, "_BATCH_DOCUMENTS", 8)
    monkeypatch.setattr(shard_writer, "_report", lambda *counts: reports.append(counts))
    stats = preprocess_corpus(["demo:80"], tmp_path / "out", None, vocab_size=300, progress=True)
    assert len(reports) == 11 and all(records == 8 for records, _ in reports[:10])
    assert sum(r for r, _ in reports) == stats["documents"] == 80
    assert sum(t for _, t in reports) == stats["tokens"]
    said = capsys.readouterr().err
    for line in (
        "indexing 1 input(s) ...",
        "indexed 80 records in",
        "training a SentencePiece tokenizer (300 pieces) on 80 records",
        f"tokenizer: {tmp_path / 'out' / 'tokenizer.model'} (",
        "1 shard(s) of up to 20,000 records",
    ):
        assert line in said, said
