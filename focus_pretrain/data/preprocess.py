"""Corpora to token files: read text with ``datasets``, tokenise in parallel, write a Megatron
indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

Sources (:func:`load_texts`):

* ``demo`` or ``demo:N``: the embedded demo corpus (N documents, default 2000);
* ``pystdlib`` or ``pystdlib:N``: the Python standard library's source files (a real local
  corpus, :mod:`focus_pretrain.data.stdlib_corpus`);
* a local ``.jsonl``/``.json`` (a ``text`` field per record), ``.parquet`` or ``.txt`` file, a
  glob of them, or a directory of them (one ``.txt`` file is one document);
* anything else is a HuggingFace hub dataset name (needs a machine that is online).
"""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from focus_pretrain.data.demo_corpus import DemoSpec, demo_count, demo_documents, is_demo_source
from focus_pretrain.data.stdlib_corpus import is_stdlib_source, stdlib_documents
from focus_pretrain.data.tokenizer import Tokenizer, check_document_prefix
from focus_pretrain.errors import InputError, MissingInputError

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def load_texts(
    source: str, *, text_key: str = "text", seed: int = 0, demo_spec: DemoSpec | None = None
):
    """A ``datasets.Dataset`` with one document per row in column ``text``.

    ``seed`` and ``demo_spec`` shape the demo corpus (``demo[:N]`` sources) only.
    """
    import datasets

    if is_demo_source(source):
        count = demo_count(source)
        documents = list(demo_documents(count, seed, demo_spec))
        return datasets.Dataset.from_dict({"text": documents})
    if is_stdlib_source(source):
        return datasets.Dataset.from_dict({"text": stdlib_documents(source)})
    files = _local_files(source)
    if files is None:  # not a local path: a hub dataset
        dataset = datasets.load_dataset(source, split="train")
    else:
        kinds = {Path(f).suffix for f in files}
        if len(kinds) != 1 or next(iter(kinds)) not in _BUILDERS:
            raise InputError(
                f"{source}: mix or unknown kind of files {sorted(kinds)}; "
                f"use one of {sorted(_BUILDERS)}"
            )
        builder = _BUILDERS[next(iter(kinds))]
        extra = {"sample_by": "document"} if builder == "text" else {}
        dataset = datasets.load_dataset(builder, data_files=files, split="train", **extra)
    if text_key not in dataset.column_names:
        raise InputError(
            f"{source} has no column {text_key!r} (columns: {dataset.column_names}); pass the "
            "field that holds the text"
        )
    dataset = dataset.select_columns([text_key])
    return dataset if text_key == "text" else dataset.rename_column(text_key, "text")


def _local_files(source: str) -> list[str] | None:
    path = Path(source)
    if path.is_dir():
        files = sorted(str(p) for p in path.iterdir() if p.suffix in _BUILDERS)
        if not files:
            raise MissingInputError(f"{source} holds no {'/'.join(sorted(_BUILDERS))} files")
        return files
    if path.is_file():
        return [str(path)]
    if any(ch in source for ch in "*?["):
        files = sorted(glob.glob(source))
        if not files:
            raise MissingInputError(f"no file matches {source}")
        return files
    if path.suffix in _BUILDERS or os.sep in source:
        raise MissingInputError(f"corpus file {source} does not exist")
    return None


_WORKER: dict[str, Any] = {}


def _init_worker(model_path: str, prefix: Sequence[int]) -> None:
    _WORKER.update(tokenizer=Tokenizer(model_path), prefix=list(prefix))


def _encode_batch(texts: list[str]) -> list[np.ndarray]:
    documents = _WORKER["tokenizer"].encode_documents(texts, _WORKER["prefix"])
    return [np.array(ids, dtype=np.int64) for ids in documents]


def token_dtype(vocab_size: int) -> type[np.unsignedinteger] | type[np.signedinteger]:
    """The dtype of token files for a vocabulary: ``uint16`` below 65535 ids, else ``int32``."""
    return np.uint16 if vocab_size < np.iinfo(np.uint16).max else np.int32


def check_tokenizer(
    prefix: str | os.PathLike, tokenizer: Tokenizer, add_bos: bool | str = "auto"
) -> None:
    """Refuse token files made by another tokenizer than ``tokenizer``, or (``add_bos`` true
    or false) with other document prefixes, when they say which.

    Raises:
        InputError: naming both tokenizers (or prefixes) and the fix.
    """
    stamp_path = Path(f"{prefix}.tokenizer.json")
    if not stamp_path.is_file():
        return  # token files from elsewhere: nothing recorded to check against
    stamp = json.loads(stamp_path.read_text())
    if stamp["sha256"] != tokenizer.unique_identifiers["sha256"]:
        raise InputError(
            f"token files {prefix} were made with tokenizer {stamp['tokenizer']} "
            f"(sha256 {stamp['sha256']}, {stamp['vocab_size']} pieces) but data.tokenizer is "
            f"{tokenizer.path} (sha256 {tokenizer.unique_identifiers['sha256']}, "
            f"{tokenizer.vocab_size} pieces); point data.tokenizer at the original or "
            "re-tokenise with focus-pretrain preprocess"
        )
    check_document_prefix(stamp.get("document_prefix", []), tokenizer, add_bos, str(prefix))


def _batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def say_phase(line: str, show: bool = True) -> None:
    """A data-preparation phase line, on stderr with the progress bars (``show``: whether the
    run shows progress)."""
    if show:
        print(line, file=sys.stderr, flush=True)


def tokenize_to_indexed(
    texts: Iterable[str],
    tokenizer_path: str | os.PathLike,
    output_prefix: str | os.PathLike,
    *,
    workers: int = 1,
    batch_size: int = 64,
    total: int | None = None,
    label: str | None = None,
    add_bos: bool | str = "auto",
) -> dict[str, Any]:
    """Tokenise ``texts`` into ``PREFIX.bin``/``PREFIX.idx``: each document begins with the
    tokenizer's :meth:`~focus_pretrain.data.tokenizer.Tokenizer.document_prefix` for
    ``add_bos`` and ends with its EOD id (``label``: what the progress bar names, default the
    prefix's name).

    Documents keep their order whatever ``workers`` is. Both files are written under a temporary
    prefix and renamed at the end, so an interrupted run never leaves a half-written dataset.
    ``PREFIX.tokenizer.json`` records which tokenizer made them (see :func:`check_tokenizer`).

    Returns:
        ``{"documents": ..., "tokens": ..., "document_prefix": [ids]}``.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tokenizer = Tokenizer(tokenizer_path)
    document_prefix = tokenizer.document_prefix(add_bos)
    dtype = token_dtype(tokenizer.vocab_size)
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = prefix.with_name(f".{prefix.name}.tmp{os.getpid()}")
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
    documents = tokens = 0
    progress = tqdm(total=total, unit="doc", desc=f"tokenising {label or prefix.name}")
    pool = None
    if workers > 1:
        pool = mp.get_context("spawn").Pool(
            workers, _init_worker, (str(tokenizer_path), document_prefix)
        )
    try:
        if pool is None:
            _init_worker(str(tokenizer_path), document_prefix)
            encoded = map(_encode_batch, _batches(texts, batch_size))
        else:
            encoded = pool.imap(_encode_batch, _batches(texts, batch_size))
        for batch in encoded:
            for doc in batch:
                builder.add_document(doc, [len(doc)])
                tokens += len(doc)
            documents += len(batch)
            progress.update(len(batch))
        builder.finalize(f"{tmp}.idx")
    finally:
        progress.close()
        if pool is not None:
            pool.close()
            pool.join()
    Path(f"{prefix}.idx").unlink(missing_ok=True)  # never pair an old index with new data
    stamp = {"tokenizer": str(tokenizer.path), "vocab_size": tokenizer.vocab_size}
    stamp["sha256"] = tokenizer.unique_identifiers["sha256"]
    stamp["document_prefix"] = document_prefix
    Path(f"{prefix}.tokenizer.json").write_text(json.dumps(stamp, indent=1))
    for suffix in (".bin", ".idx"):  # .idx last: a dataset is complete once its .idx exists
        os.replace(f"{tmp}{suffix}", f"{prefix}{suffix}")
    return {"documents": documents, "tokens": tokens, "document_prefix": document_prefix}
