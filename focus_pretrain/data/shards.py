"""Offline tokenisation at scale: many inputs -> a directory of sharded Megatron indexed
datasets with a manifest, in parallel, resumable, deterministic.

Layout of an output directory ``OUT``::

    OUT/shard-00000.bin, .idx, .json   # records [0, D) of the inputs (D = shard_documents)
    OUT/shard-00001.bin, .idx, .json   # records [D, 2D) ...
    OUT/manifest.json                  # written last: shards, documents and tokens per shard,
                                       # the tokenizer's sha256, skipped records
    OUT/stats.json                     # the last run's timing (tokens/s) and counts
    OUT/.plan.json                     # the inputs' index and settings (for resuming)
    OUT/tokenizer.model, .vocab        # with no tokenizer given: the one trained for the run

Shard ``k`` holds records ``[k D, (k + 1) D)`` of the inputs (:mod:`focus_pretrain.data.corpus`),
whatever the number of worker processes, so runs with different ``workers`` write identical
bytes. Every document begins with the tokenizer's document prefix (``add_bos``: its BOS,
when it adds one) and ends with its EOD id. A worker
(:mod:`~focus_pretrain.data.shard_writer`) writes a shard under a temporary name and renames
``.bin``, ``.json`` and, last, ``.idx`` into place: a shard is complete once its ``.idx``
exists. A rerun of the same command resumes: it removes temporary files, keeps complete
shards and writes the others; different inputs or settings are refused (``overwrite=True``
starts again) once a shard is complete, and before that start again (a
tokenizer the run trained is trained again). Turning ``skip_bad_records`` on is not a change
that matters: the complete shards hold no bad record (it would have raised), so they are kept.
Training finds and reads the output with :mod:`focus_pretrain.data.manifest`.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from focus_pretrain.data.corpus import (
    FILE_KINDS,
    ReadOptions,
    RecordCounts,
    Unit,
    check_sizes,
    index_inputs,
    read_all,
    resolve_inputs,
)
from focus_pretrain.data.manifest import FORMAT, MANIFEST
from focus_pretrain.data.manifest import find_manifest as find_manifest
from focus_pretrain.data.manifest import manifest_shards as manifest_shards
from focus_pretrain.data.manifest import read_manifest as read_manifest
from focus_pretrain.data.preprocess import say_phase, token_dtype
from focus_pretrain.data.shard_writer import KILL_HOOK as KILL_HOOK
from focus_pretrain.data.shard_writer import run_shards, shard_name
from focus_pretrain.data.tokenizer import (
    Tokenizer,
    check_add_bos,
    check_tokenizer_path,
    check_vocab_size,
    train_tokenizer,
)
from focus_pretrain.errors import InputError

PLAN = ".plan.json"
STATS = "stats.json"
TOKENIZER = "tokenizer.model"  # trained here when no tokenizer is given
SHARD_DOCUMENTS = 20_000
TOKENIZER_DOCUMENTS = 100_000
_SHARD = re.compile(r"shard-\d{5,}\.(bin|idx|json)")
_TEMP = re.compile(r"\.(shard-\d{5,}|manifest\.json|\.plan\.json|stats\.json)\.tmp\d+(\.\w+)?")


def tokenizer_sha256(path: str | os.PathLike) -> str:
    """sha256 of a tokenizer: the ``.model`` file, or a directory's ``tokenizer.json``."""
    path = Path(path)
    return hashlib.sha256(
        (path / "tokenizer.json" if path.is_dir() else path).read_bytes()
    ).hexdigest()


def _write_json(path: Path, value: Any) -> None:
    """Write ``value`` to ``path`` atomically (a temporary file renamed into place)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


# -- planning --------------------------------------------------------------------------------


def _cut(units: Sequence[Unit], indexes: Sequence[dict], size: int) -> list[list[tuple]]:
    """Shard ``k``'s pieces ``(unit, index, start, stop)``: records ``[k size, (k+1) size)``."""
    shards: list[list[tuple]] = [[]]
    room = size
    for unit, index in zip(units, indexes, strict=True):
        start = 0
        while start < index["records"]:
            if room == 0:
                shards.append([])
                room = size
            stop = min(index["records"], start + room)
            shards[-1].append((unit, index, start, stop))
            room -= stop - start
            start = stop
    return shards if shards[0] else []


def _clear(out: Path, everything: bool, tokenizer: bool = False) -> None:
    """Remove temporary files (and, with ``everything``, every file a run writes) in ``out``;
    ``tokenizer``: the run trains its tokenizer, so ``everything`` includes :data:`TOKENIZER`
    (never a tokenizer the run was given)."""
    trained = (TOKENIZER, Path(TOKENIZER).with_suffix(".vocab").name) if tokenizer else ()
    for path in out.iterdir():
        if not path.is_file():
            continue
        ours = _SHARD.fullmatch(path.name) or path.name in (MANIFEST, PLAN, STATS, *trained)
        if _TEMP.fullmatch(path.name) or (everything and ours):
            path.unlink()


def _load_plan(out: Path, units: list[Unit], overwrite: bool, trained: bool) -> dict | None:
    """The stored plan of an interrupted (or finished) run with the same inputs, if any
    (``trained``: this run trains its tokenizer into ``out``)."""
    _clear(out, everything=overwrite, tokenizer=trained)
    plan_path = out / PLAN
    # without a plan, the files a run writes are not this program's: never replaced unasked
    written = {
        MANIFEST,
        STATS,
        *((TOKENIZER, Path(TOKENIZER).with_suffix(".vocab").name) if trained else ()),
    }
    leftovers = sorted(
        p.name for p in out.iterdir() if _SHARD.fullmatch(p.name) or p.name in written
    )
    if not plan_path.is_file():
        if leftovers:
            raise InputError(
                f"{out} already holds {', '.join(leftovers[:3])}"
                f"{', ...' if len(leftovers) > 3 else ''} but no {PLAN} (not a run of this "
                "command): pass --overwrite to replace them, or choose another --output"
            )
        return None
    plan = json.loads(plan_path.read_text())
    stored = [Unit(**u) for u in plan["units"]]
    if stored != units and not any(out.glob("shard-*.idx")):
        _clear(out, everything=True, tokenizer=trained)  # nothing finished: start again
        return None
    if stored != units:
        changed = [f"{u.name}" for u in units if u not in stored] or [u.name for u in stored]
        raise InputError(
            f"{out} holds a run over other inputs (changed or new: {', '.join(changed[:3])}); "
            "rerun with the original inputs to resume it, or pass --overwrite to start again"
        )
    return plan


def _index_all(units: list[Unit], options: ReadOptions, workers: int) -> list[dict]:
    """Every input's index; large inputs (over 1 GB of files in all) in ``workers`` processes
    (a pass over every line of a ``.jsonl`` file)."""
    files = [u for u in units if u.kind in FILE_KINDS.values()]
    if (
        workers == 1
        or len(units) == 1
        or sum(int(u.fingerprint.split(":")[0]) for u in files) < 1 << 30
    ):
        return index_inputs(units, options)
    with mp.get_context("spawn").Pool(min(workers, len(units))) as pool:
        return index_inputs(units, options, pool)


def _differ(stored: dict, settings: dict) -> list[str]:
    return sorted(k for k in {*stored, *settings} if stored.get(k) != settings.get(k))


def _compatible(stored: dict, settings: dict) -> bool:
    """Whether a run with ``stored`` settings resumes under ``settings``: they differ only in
    ``skip_bad_records`` turned on. Records are skipped only where they would have raised, so
    the shards the stored run finished (none raised) are what the new settings write."""
    return (
        _differ(stored, settings) == ["skip_bad_records"]
        and not stored["skip_bad_records"]
        and settings["skip_bad_records"]
    )


def _check_settings(out: Path, plan: dict, settings: dict) -> None:
    """Refuse to resume finished shards under other settings (nothing finished: start again)."""
    if any(out.glob("shard-*.idx")):
        differ = _differ(plan["settings"], settings)
        raise InputError(
            f"{out} holds a run with other settings ({', '.join(differ)} differ); rerun with "
            "the original arguments to resume it, or pass --overwrite to start again"
        )


def tokenizer_sample_step(records: int) -> int:
    """Every how many records the tokenizer trains on: about :data:`TOKENIZER_DOCUMENTS`
    spread evenly over ``records`` (all of them below twice that)."""
    return max(1, records // TOKENIZER_DOCUMENTS)


def train_corpus_tokenizer(
    units: list[Unit], indexes: list[dict], options: ReadOptions, prefix: Path, vocab: int
) -> Path:
    """A SentencePiece model trained on :data:`TOKENIZER_DOCUMENTS` documents spread evenly
    over the inputs (every ``step``-th record)."""
    step = tokenizer_sample_step(sum(i["records"] for i in indexes))
    texts = read_all(units, indexes, options, RecordCounts(), step)
    return train_tokenizer(texts, prefix, vocab)


# -- the run ---------------------------------------------------------------------------------


def preprocess_corpus(
    inputs: Sequence[str],
    output_dir: str | os.PathLike,
    tokenizer: str | os.PathLike | None = None,
    *,
    vocab_size: int = 32000,
    workers: int = 1,
    shard_documents: int = SHARD_DOCUMENTS,
    options: ReadOptions | None = None,
    overwrite: bool = False,
    progress: bool = True,
    add_bos: bool | str = "auto",
) -> dict[str, Any]:
    """Tokenise ``inputs`` (see :func:`~focus_pretrain.data.corpus.resolve_inputs`) into
    sharded indexed datasets in ``output_dir`` with ``workers`` processes; resumes an
    interrupted run of the same command.

    ``tokenizer`` ``None`` trains a SentencePiece model of ``vocab_size`` pieces (Llama-style
    options) into ``OUT/tokenizer.model`` first (reused when resuming; ``vocab_size`` is then
    one of the settings a resumed run must share). Each document begins with the tokenizer's
    :meth:`~focus_pretrain.data.tokenizer.Tokenizer.document_prefix` for ``add_bos`` (recorded
    in the manifest) and ends with its EOD id.

    Returns:
        the run's stats (also written to ``OUT/stats.json``): documents, tokens, shards
        written and reused, skipped records by kind, seconds and tokens/s of this run.

    Raises:
        BadRecordError: a bad record or an empty input, naming the file and line (unless
            ``options.skip_bad_records``: then skipped and counted).
        InputError: bad counts, missing inputs or tokenizer, no records, or ``output_dir``
            holds a run over other inputs or settings (or is a file); all but bad records
            found before anything is written.
    """
    started = time.perf_counter()
    options = options or ReadOptions()
    out = Path(output_dir)
    _check_request(out, workers, shard_documents, tokenizer, vocab_size, add_bos)
    units = resolve_inputs(inputs)
    trained = tokenizer is None
    tokenizer = out / TOKENIZER if tokenizer is None else tokenizer
    plan = _load_plan(out, units, overwrite, trained) if out.is_dir() else None
    settings = {**asdict(options), "shard_documents": shard_documents, "format": FORMAT}
    settings["add_bos"] = add_bos
    if trained:  # the run's own tokenizer: how it is trained is a setting too
        settings.update(tokenizer_trained=True, vocab_size=vocab_size)
    if not trained or (plan is not None and Path(tokenizer).is_file()):
        settings["tokenizer_sha256"] = tokenizer_sha256(tokenizer)  # resuming: the one trained
    plan = _reconcile_plan(out, plan, settings, trained)
    if plan is None:
        trained_into = tokenizer if trained else None
        plan = _new_plan(out, units, options, settings, workers, trained_into, progress)
    else:
        say_phase(show=progress, line=f"resuming {out}: inputs indexed, tokenizer {tokenizer}")
    indexes = plan["index"]
    shards = _cut(units, indexes, shard_documents)
    if not shards:
        raise InputError(f"the inputs {', '.join(inputs)} hold no records")
    pending = [k for k in range(len(shards)) if not (out / f"{shard_name(k)}.idx").is_file()]
    finished = (
        f", {len(shards) - len(pending)} finished before" if len(pending) < len(shards) else ""
    )
    say_phase(
        show=progress, line=f"{len(shards)} shard(s) of up to {shard_documents:,} records{finished}"
    )
    index_seconds = time.perf_counter() - started
    tokens = Tokenizer(tokenizer)
    document_prefix = tokens.document_prefix(add_bos)
    written = run_shards(
        [(k, shards[k], str(out)) for k in pending],
        str(tokenizer),
        document_prefix,
        options,
        workers,
        sum(i["records"] for i in indexes),
        progress,
        out.name,
    )
    seconds = (index_seconds, time.perf_counter() - started - index_seconds)
    shard_stats = [
        json.loads((out / f"{shard_name(k)}.json").read_text()) for k in range(len(shards))
    ]
    manifest = _manifest(units, indexes, shard_stats, settings, tokens)
    manifest["document_prefix"] = document_prefix  # what every document of the shards begins with
    _write_json(out / MANIFEST, manifest)  # last: the directory is complete once it exists
    stats = _run_stats(out, workers, len(shards), written, manifest, seconds, tokenizer)
    _write_json(out / STATS, stats)
    return stats


def _check_request(
    out: Path,
    workers: int,
    shard_documents: int,
    tokenizer: str | os.PathLike | None,
    vocab_size: int,
    add_bos: bool | str,
) -> None:
    """Refuse bad counts, a file as the output, a missing tokenizer or a bad vocabulary size,
    and a BOS asked of a tokenizer with none (``InputError``), before anything is read."""
    if workers < 1 or shard_documents < 1:
        raise InputError(
            f"workers ({workers}) and shard_documents ({shard_documents}) must be >= 1"
        )
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} is a file: give a directory for the shards")
    check_add_bos(add_bos)
    if tokenizer is None:
        check_vocab_size(vocab_size)
    else:
        check_tokenizer_path(tokenizer)
        Tokenizer(tokenizer).document_prefix(add_bos)  # a BOS asked of a tokenizer with none


def _reconcile_plan(out: Path, plan: dict | None, settings: dict, trained: bool) -> dict | None:
    """``plan`` when it resumes under ``settings`` (a compatible change is stored in it), else
    ``None`` after clearing ``out`` (refused when shards are finished)."""
    if plan is None or plan["settings"] == settings:
        return plan
    if _compatible(plan["settings"], settings):  # keep the finished shards, go on
        plan["settings"] = settings
        _write_json(out / PLAN, plan)
        return plan
    _check_settings(out, plan, settings)  # refused when shards are done; else start again
    _clear(out, everything=True, tokenizer=trained)
    return None


def _new_plan(
    out: Path,
    units: list[Unit],
    options: ReadOptions,
    settings: dict,
    workers: int,
    trained: str | os.PathLike | None,
    show: bool = False,
) -> dict:
    """Index the inputs, train the run's tokenizer into ``trained`` (when not ``None``; its
    sha256 joins ``settings``) and store the plan."""
    started = time.perf_counter()
    check_sizes(units, options)  # empty files: refused before the long part starts
    say_phase(show=show, line=f"indexing {len(units)} input(s) ...")
    indexes = _index_all(units, options, workers)
    records = sum(i["records"] for i in indexes)
    say_phase(
        show=show, line=f"indexed {records:,} records in {time.perf_counter() - started:.1f} s"
    )
    out.mkdir(parents=True, exist_ok=True)  # the inputs are good: the run writes from here
    if trained is not None:  # a tokenizer found here without a plan is of unknown inputs
        vocab = settings["vocab_size"]
        started = time.perf_counter()
        used = -(-records // tokenizer_sample_step(records))  # every step-th record
        say_phase(
            show=show,
            line=f"training a SentencePiece tokenizer ({vocab:,} pieces) on {used:,} records",
        )
        train_corpus_tokenizer(units, indexes, options, Path(trained).with_suffix(""), vocab)
        settings["tokenizer_sha256"] = tokenizer_sha256(trained)
        say_phase(show=show, line=f"tokenizer: {trained} ({time.perf_counter() - started:.1f} s)")
    plan = {"units": [asdict(u) for u in units], "index": indexes, "settings": settings}
    _write_json(out / PLAN, plan)
    return plan


def _run_stats(
    out: Path,
    workers: int,
    shards: int,
    written: list[dict],
    manifest: dict,
    seconds: tuple[float, float],
    tokenizer: str | os.PathLike,
) -> dict[str, Any]:
    """The stats of a run that wrote ``written`` of ``shards`` shards in ``seconds`` (indexing,
    tokenising): :data:`STATS`."""
    index_seconds, tokenise_seconds = seconds
    tokens_written = sum(s["tokens"] for s in written)
    busy = sum(s["seconds"] for s in written)  # inside the shard writers: per busy core
    return {
        "output": str(out),
        "workers": workers,
        "shards": shards,
        "shards_written": len(written),
        "shards_reused": shards - len(written),
        **{k: manifest[k] for k in ("documents", "tokens", "skipped", "skipped_total")},
        "blank_lines": manifest["blank_lines"],
        "documents_written": sum(s["documents"] for s in written),
        "tokens_written": tokens_written,
        "bytes_written": sum(s["bytes"] for s in written),
        "index_seconds": round(index_seconds, 3),
        "tokenise_seconds": round(tokenise_seconds, 3),
        "tokens_per_s": round(tokens_written / max(tokenise_seconds, 1e-9), 1),
        "busy_seconds": round(busy, 3),
        "tokens_per_s_per_worker": round(tokens_written / max(busy, 1e-9), 1),
        "skipped_examples": manifest["skipped_examples"],
        "tokenizer": str(tokenizer),
    }


def _manifest(
    units: list[Unit], indexes: list[dict], shards: list[dict], settings: dict, tok: Tokenizer
) -> dict[str, Any]:
    skipped: Counter[str] = Counter()
    examples: list[str] = []
    for index in indexes:  # whole files left out (empty, unreadable)
        if index["problem"]:
            skipped[index["problem"][0]] += 1
            examples.append(index["problem"][1])
    for shard in shards:
        skipped.update(shard["skipped"])
        examples += shard["examples"]
    return {
        "format": FORMAT,
        "version": 1,
        "tokenizer": {
            "path": str(Path(tok.path).resolve()),
            "sha256": settings["tokenizer_sha256"],
            "vocab_size": tok.vocab_size,
            "eod": tok.eod,
        },
        "dtype": token_dtype(tok.vocab_size).__name__,
        "text_key": settings["text_key"],
        "shard_documents": settings["shard_documents"],
        "skip_bad_records": settings["skip_bad_records"],
        "inputs": [
            {**asdict(u), "records": i["records"]} for u, i in zip(units, indexes, strict=True)
        ],
        "records": sum(i["records"] for i in indexes),
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "blank_lines": sum(s["blank_lines"] for s in shards),
        "skipped": dict(sorted(skipped.items())),
        "skipped_total": sum(skipped.values()),
        "skipped_examples": examples[:10],
        "shards": [
            {k: s[k] for k in ("name", "records", "documents", "tokens", "skipped")} for s in shards
        ],
    }
