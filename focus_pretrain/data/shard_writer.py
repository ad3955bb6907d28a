"""Writing the shards of :func:`focus_pretrain.data.shards.preprocess_corpus`: the worker
processes (or this process), each tokenising its shards' records into
``OUT/shard-K.{bin,idx,json}`` under temporary names and renaming them into place (``.idx``
last: a shard is complete once its ``.idx`` exists), with one progress bar over them all.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from focus_pretrain.data.corpus import ReadOptions, RecordCounts, Unit, read_unit
from focus_pretrain.data.preprocess import token_dtype
from focus_pretrain.data.tokenizer import Tokenizer

KILL_HOOK = "FOCUS_PREPROCESS_KILL_AFTER_SHARDS"  # tests: SIGKILL inside shard N + 1
_BATCH_DOCUMENTS, _BATCH_CHARS = 256, 1 << 23


def shard_name(index: int) -> str:
    """``shard-00042``: the prefix of shard ``index`` inside an output directory."""
    return f"shard-{index:05d}"


# -- workers ---------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(
    tokenizer: str, prefix: list[int], options: dict, progress: Any, parallel: bool
) -> None:
    """Set up a shard writer (a pool worker, or this process): its tokenizer, the ids every
    document begins with, read options and progress counters (a callback here, two shared
    ``multiprocessing.Value`` in a pool)."""
    if parallel:  # one core per worker: the rate per core is what scales
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with warnings.catch_warnings():  # megatron-core's notes about optional GPU packages
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    tok = Tokenizer(tokenizer)
    _WORKER.update(
        builder=IndexedDatasetBuilder,
        tokenizer=tok,
        prefix=prefix,
        options=ReadOptions(**options),
        progress=progress,
        done=0,
    )
    _WORKER["dtype"] = token_dtype(tok.vocab_size)


def _report(records: int, tokens: int) -> None:
    progress = _WORKER["progress"]
    if progress is None:
        return
    if callable(progress):
        progress(records, tokens)
        return
    for value, amount in zip(progress, (records, tokens), strict=True):
        with value.get_lock():
            value.value += amount


def _write_shard(task: tuple[int, list[tuple[Unit, dict, int, int]], str]) -> dict[str, Any]:
    """Tokenise one shard's records into ``OUT/shard-K.{bin,idx,json}``; returns its stats."""
    started = time.perf_counter()
    number, pieces, out = task
    name = shard_name(number)
    tmp = Path(out) / f".{name}.tmp{os.getpid()}"
    builder = _WORKER["builder"](f"{tmp}.bin", dtype=_WORKER["dtype"])
    counts = RecordCounts()
    stats = Counter(records=0, documents=0, tokens=0, bytes=0)
    batch: list[str] = []

    def flush() -> None:
        for ids in _WORKER["tokenizer"].encode_documents(batch, _WORKER["prefix"]):
            builder.add_document(ids, [len(ids)])
            stats["tokens"] += len(ids)
        stats["documents"] += len(batch)
        stats["bytes"] += sum(len(t.encode("utf-8")) for t in batch)
        batch.clear()
        if _WORKER["done"] == int(os.environ.get(KILL_HOOK, -1)):
            os.kill(os.getpid(), signal.SIGKILL)

    reported = Counter()
    for unit, index, start, stop in pieces:
        chars = 0
        for text in read_unit(unit, index, start, stop, _WORKER["options"], counts):
            batch.append(text)
            chars += len(text)
            if len(batch) >= _BATCH_DOCUMENTS or chars >= _BATCH_CHARS:
                documents = len(batch)
                flush()
                chars = 0
                _report(documents, stats["tokens"] - reported["tokens"])  # the bar moves
                reported["records"] += documents
                reported["tokens"] = stats["tokens"]
        stats["records"] += stop - start
    if batch:
        flush()
    builder.finalize(f"{tmp}.idx")
    # the rest: the last batch and the records that held no document (blank, skipped)
    _report(stats["records"] - reported["records"], stats["tokens"] - reported["tokens"])
    result = {"name": name, **stats, "blank_lines": counts.blank_lines}
    result["seconds"] = round(time.perf_counter() - started, 3)
    result.update(skipped=dict(counts.skipped), examples=counts.examples)
    Path(f"{tmp}.json").write_text(json.dumps(result, indent=1))
    for suffix in (".bin", ".json", ".idx"):  # .idx last: the shard is complete once it exists
        os.replace(f"{tmp}{suffix}", Path(out) / f"{name}{suffix}")
    _WORKER["done"] += 1
    return result


# -- running them ---------------------------------------------------------------------------


def run_shards(
    tasks: list[tuple],
    tokenizer: str,
    prefix: list[int],
    options: ReadOptions,
    workers: int,
    total: int,
    show: bool,
    label: str,
) -> list[dict[str, Any]]:
    """Write ``tasks``' shards with ``workers`` processes (in this process when 1), with a
    progress bar in documents and tokens/s."""
    if not tasks:
        return []
    done_records = total - sum(stop - start for _, pieces, _ in tasks for *_, start, stop in pieces)
    bar = tqdm(
        total=total,
        initial=done_records,
        unit="doc",
        desc=f"tokenising -> {label}",
        disable=not show,
    )
    started = time.perf_counter()
    seen = Counter()

    def show_progress(records: int, tokens: int) -> None:
        seen["records"] += records
        seen["tokens"] += tokens
        bar.n = done_records + seen["records"]
        rate = seen["tokens"] / max(time.perf_counter() - started, 1e-9)
        bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=True)

    results: list[dict[str, Any]] = []
    try:
        if workers == 1 or len(tasks) <= 1:
            _init_worker(tokenizer, prefix, asdict(options), show_progress, parallel=False)
            results = [_write_shard(task) for task in tasks]
        else:
            results = _run_pool(tasks, tokenizer, prefix, options, workers, show_progress)
    finally:
        bar.close()
    return results


def _run_pool(
    tasks: list[tuple],
    tokenizer: str,
    prefix: list[int],
    options: ReadOptions,
    workers: int,
    show_progress: Callable[[int, int], None],
) -> list[dict[str, Any]]:
    context = mp.get_context("spawn")
    counters = (context.Value("q", 0), context.Value("q", 0))  # records, tokens done
    args = (tokenizer, prefix, asdict(options), counters, True)
    results: list[dict[str, Any]] = []
    last = [0, 0]
    pool = context.Pool(min(workers, len(tasks)), _init_worker, args)
    try:
        pending = pool.imap_unordered(_write_shard, tasks)
        while len(results) < len(tasks):
            with contextlib.suppress(mp.TimeoutError):
                results.append(pending.next(timeout=0.5))
            now = [counters[0].value, counters[1].value]
            show_progress(now[0] - last[0], now[1] - last[1])
            last = now
        pool.close()
    finally:
        pool.terminate()
        pool.join()
    return results
