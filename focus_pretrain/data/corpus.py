"""Corpora read record by record, strictly: every document knows its file and line, and bad
input is a clear error (or, when asked, a skipped and counted record).

Inputs (:func:`resolve_inputs`), in the order given:

* ``demo`` / ``demo:N`` (the embedded demo corpus) and ``pystdlib`` / ``pystdlib:N`` (the
  Python standard library's sources);
* local files, globs and directories (searched recursively, in path order) of ``.jsonl``
  (one JSON object per line), ``.json`` (a JSON array of objects, or JSON lines),
  ``.parquet`` (one row per document) and ``.txt`` (one whole file per document);
* a dataset saved with ``datasets``' ``save_to_disk`` (a directory holding ``state.json``), or
  anything else as a HuggingFace hub dataset name (needs a machine that is online).

A *record* is one line of a ``.jsonl`` file, one element or row of the others, one ``.txt``
file, one demo document or one standard-library file. Records are numbered across the inputs in
order; :mod:`focus_pretrain.data.shards` cuts that numbering into shards, so which shard a
document lands in depends on the inputs only. ``.jsonl`` and ``.txt`` are read as bytes and
decoded as UTF-8 strictly, so an error names the file, the line and the column. Blank lines of
``.jsonl`` files are not documents (counted as ``blank_lines``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from focus_pretrain.data.demo_corpus import demo_count, demo_document, is_demo_source
from focus_pretrain.data.records import (
    SKIP_HINT,
    BadRecordError,
    ReadOptions,
    RecordCounts,
    decode_utf8,
    text_of,
    text_string,
)
from focus_pretrain.data.stdlib_corpus import (
    is_stdlib_source,
    stdlib_cache_key,
    stdlib_count,
    stdlib_files,
)
from focus_pretrain.errors import InputError, MissingInputError

__all__ = [  # BadRecordError, ReadOptions and RecordCounts: data.records', re-exported
    "FILE_KINDS",
    "BadRecordError",
    "ReadOptions",
    "RecordCounts",
    "Unit",
    "check_sizes",
    "index_inputs",
    "index_unit",
    "read_all",
    "read_unit",
    "resolve_inputs",
]

FILE_KINDS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".txt": "txt"}
LINE_STRIDE = 1024  # a .jsonl index keeps the byte offset of every LINE_STRIDE-th line


@dataclass(frozen=True)
class Unit:
    """One input of the record stream.

    Attributes:
        kind: ``jsonl``, ``json``, ``parquet``, ``txt``, ``demo``, ``pystdlib``, ``hf`` (hub
            name) or ``hf_disk`` (a ``save_to_disk`` directory).
        name: the file path or the source string.
        fingerprint: what changes when the input changes (size and mtime of a file).
    """

    kind: str
    name: str
    fingerprint: str


def _file_unit(path: Path) -> Unit:
    kind = FILE_KINDS.get(path.suffix)
    if kind is None:
        raise InputError(
            f"{path}: unknown kind of input file; use {', '.join(sorted(FILE_KINDS))} files"
        )
    stat = path.stat()
    return Unit(kind, str(path), f"{stat.st_size}:{stat.st_mtime_ns}")


def _directory_units(path: Path) -> list[Unit]:
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        state = path / "state.json"
        described = state if state.is_file() else path / "dataset_dict.json"
        digest = hashlib.sha256(described.read_bytes()).hexdigest()[:16]
        return [Unit("hf_disk", str(path), digest)]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.suffix in FILE_KINDS and p.is_file() and not p.name.startswith(".")
    )
    if not files:
        raise MissingInputError(
            f"{path} holds no {'/'.join(sorted(FILE_KINDS))} files (searched recursively)"
        )
    return [_file_unit(p) for p in files]


def resolve_inputs(sources: Sequence[str]) -> list[Unit]:
    """The inputs ``sources`` name, in order (each glob and directory in path order).

    Raises:
        MissingInputError: a path, glob or directory that names no file.
        InputError: a file of an unknown kind, a bad ``N`` in ``demo:N`` or ``pystdlib:N``.
    """
    units: list[Unit] = []
    for source in sources:
        path = Path(source)
        if is_demo_source(source):
            demo_count(source)  # refuses a bad N now, not while indexing
            units.append(Unit("demo", source, source))
        elif is_stdlib_source(source):
            stdlib_count(source)
            units.append(Unit("pystdlib", source, stdlib_cache_key(source)))
        elif path.is_dir():
            units += _directory_units(path)
        elif path.is_file():
            units.append(_file_unit(path))
        elif any(ch in source for ch in "*?["):
            matches = sorted(glob.glob(source, recursive=True))
            if not matches:
                raise MissingInputError(f"no file matches {source}")
            for match in matches:
                match_path = Path(match)
                units += _directory_units(match_path) if match_path.is_dir() else []
                units += [] if match_path.is_dir() else [_file_unit(match_path)]
        elif path.suffix in FILE_KINDS or os.sep in source:
            raise MissingInputError(f"corpus file {source} does not exist")
        else:
            units.append(Unit("hf", source, source))
    return units


# -- indexing: how many records each input holds ---------------------------------------------


def index_unit(unit: Unit, options: ReadOptions) -> dict[str, Any]:
    """``{"records": n, "offsets": [...], "problem": None | [kind, message]}`` for one input.

    ``offsets`` lets a reader start at any record without reading what comes before (the byte
    offset of every :data:`LINE_STRIDE`-th line of a ``.jsonl`` file, the first row of every
    row group of a ``.parquet`` file). ``problem`` is a whole-file problem (an empty file, a
    ``.json`` array that does not parse); such a file holds no records.

    Raises:
        InputError: a ``.parquet`` file or dataset without the ``options.text_key`` column, a
            hub dataset that is not there.
    """
    if unit.kind == "demo":
        return _index(demo_count(unit.name))
    if unit.kind == "pystdlib":
        return _index(len(stdlib_files(unit.name)))
    if unit.kind in ("hf", "hf_disk"):
        return _index(len(_hf_dataset(unit, options)))
    if unit.kind == "parquet":
        return _index_parquet(unit.name, options.text_key)
    data_start = _first_byte(unit.name)
    if data_start is None:
        return _index(0, problem=("empty_files", f"{unit.name}: empty input file (no records)"))
    if unit.kind == "txt":
        return _index(1)
    if unit.kind == "json" and data_start == b"[":
        try:
            records = _json_array(unit.name)
        except BadRecordError as error:
            return _index(0, problem=("bad_files", str(error)))
        return {**_index(len(records)), "layout": "array"}
    count, offsets = 0, []
    position = 0
    with open(unit.name, "rb") as file:
        for line in file:
            if count % LINE_STRIDE == 0:
                offsets.append(position)
            position += len(line)
            count += 1
    return {**_index(count), "offsets": offsets}


def _index(records: int, problem: tuple[str, str] | None = None) -> dict[str, Any]:
    return {"records": records, "offsets": [], "problem": None if problem is None else [*problem]}


def _first_byte(path: str) -> bytes | None:
    """The first non-whitespace byte of a file, ``None`` for an empty (or blank) file."""
    with open(path, "rb") as file:
        while block := file.read(1 << 16):
            stripped = block.lstrip()
            if stripped:
                return stripped[:1]
    return None


def _index_parquet(path: str, key: str) -> dict[str, Any]:
    import pyarrow.parquet as pq

    metadata = pq.ParquetFile(path).metadata
    columns = metadata.schema.names
    if key not in columns:
        raise InputError(
            f"{path}: no column {key!r} (columns: {', '.join(columns)}); pass --text-key COLUMN"
        )
    if metadata.num_rows == 0:
        return _index(0, problem=("empty_files", f"{path}: empty input file (no rows)"))
    starts, row = [], 0
    for group in range(metadata.num_row_groups):
        starts.append(row)
        row += metadata.row_group(group).num_rows
    return {**_index(metadata.num_rows), "offsets": starts}


# -- reading ---------------------------------------------------------------------------------


def read_unit(
    unit: Unit,
    index: dict[str, Any],
    start: int,
    stop: int,
    options: ReadOptions,
    counts: RecordCounts,
    step: int = 1,
) -> Iterator[str]:
    """The documents of records ``start, start + step, ... < stop`` of one input.

    Bad records raise :class:`BadRecordError` naming the file and line (or row), or, with
    ``options.skip_bad_records``, are counted in ``counts`` and left out.
    """
    if start >= stop:
        return
    if unit.kind == "demo":
        for i in range(start, stop, step):
            yield demo_document(i, options.seed)
    elif unit.kind == "pystdlib":
        files = _cached(f"pystdlib:{unit.name}", lambda: stdlib_files(unit.name))
        for i in range(start, stop, step):
            yield files[i].read_text(encoding="utf-8", errors="replace")
    elif unit.kind == "txt":
        text = decode_utf8(Path(unit.name).read_bytes(), f"{unit.name}", 1, options, counts)
        if text is not None:
            yield text
    elif unit.kind == "json" and index.get("layout") == "array":
        records = _json_array(unit.name)
        for i in range(start, stop, step):
            text = text_of(records[i], f"{unit.name}: record {i + 1}", options, counts)
            if text is not None:
                yield text
    elif unit.kind in ("jsonl", "json"):
        yield from _read_lines(unit.name, index["offsets"], start, stop, step, options, counts)
    elif unit.kind == "parquet":
        yield from _read_parquet(unit.name, index["offsets"], start, stop, step, options, counts)
    else:
        dataset = _hf_dataset(unit, options)
        for first in range(start, stop, 1024):
            rows = dataset[first : min(stop, first + 1024)][options.text_key]
            for row, value in enumerate(rows, start=first):
                if (row - start) % step:
                    continue
                text = text_string(value, f"{unit.name}: row {row + 1}", options, counts)
                if text is not None:
                    yield text


def _read_lines(
    path: str,
    offsets: list[int],
    start: int,
    stop: int,
    step: int,
    options: ReadOptions,
    counts: RecordCounts,
) -> Iterator[str]:
    with open(path, "rb") as file:
        file.seek(offsets[start // LINE_STRIDE])
        lines = islice(file, start % LINE_STRIDE, None)
        for number, raw in enumerate(islice(lines, stop - start), start=start + 1):
            if (number - 1 - start) % step:
                continue
            where = f"{path}:{number}"
            line = decode_utf8(raw, where, None, options, counts)
            if line is None:
                continue
            if not line.strip():
                counts.blank_lines += 1
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as error:
                counts.bad(
                    "invalid_json",
                    f"{where}: invalid JSON ({error.msg} at column {error.colno})",
                    "fix or remove the line,",
                    options,
                )
                continue
            text = text_of(record, where, options, counts)
            if text is not None:
                yield text


_CACHE: dict[str, Any] = {}  # per process: the last inputs opened (file lists, arrays, ...)


def _cached(key: str, load: Any) -> Any:
    if key not in _CACHE:
        if len(_CACHE) >= 4:
            _CACHE.clear()
        _CACHE[key] = load()
    return _CACHE[key]


def _json_array(path: str) -> list[Any]:
    def load() -> list[Any]:
        raw = Path(path).read_bytes()
        try:
            return json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as error:
            line = raw.count(b"\n", 0, error.start) + 1
            problem = f"not valid UTF-8 (byte 0x{raw[error.start]:02x})"
        except json.JSONDecodeError as error:
            line, problem = error.lineno, f"invalid JSON ({error.msg} at column {error.colno})"
        raise BadRecordError(f"{path}:{line}: {problem}")  # a whole-file problem: no fix here

    return _cached(f"json:{path}", load)


def _read_parquet(
    path: str,
    starts: list[int],
    start: int,
    stop: int,
    step: int,
    options: ReadOptions,
    counts: RecordCounts,
) -> Iterator[str]:
    import pyarrow.parquet as pq

    parquet = _cached(f"parquet:{path}", lambda: pq.ParquetFile(path))
    ends = [*starts[1:], parquet.metadata.num_rows]
    for group, (first, end) in enumerate(zip(starts, ends, strict=True)):
        if end <= start or first >= stop:
            continue
        column = parquet.read_row_group(group, columns=[options.text_key]).column(0)
        for row in range(max(first, start), min(end, stop)):
            if (row - start) % step:
                continue
            value = column[row - first].as_py()
            text = text_string(value, f"{path}: row {row + 1}", options, counts)
            if text is not None:
                yield text


def _hf_dataset(unit: Unit, options: ReadOptions) -> Any:
    def load() -> Any:
        import datasets

        if unit.kind == "hf_disk":
            dataset = datasets.load_from_disk(unit.name)
            if isinstance(dataset, datasets.DatasetDict):
                dataset = dataset[options.split]
        else:
            dataset = _hub_dataset(unit.name, options.split)
        if options.text_key not in dataset.column_names:
            raise InputError(
                f"{unit.name} has no column {options.text_key!r} (columns: "
                f"{', '.join(dataset.column_names)}); pass --text-key COLUMN"
            )
        return dataset

    return _cached(f"hf:{unit.name}:{options.split}", load)


def _hub_dataset(name: str, split: str) -> Any:
    """Hub dataset ``name`` (its ``split``); a name that is none, or a hub out of reach, is
    refused as input (a local path without a slash or suffix lands here too)."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    try:
        return datasets.load_dataset(name, split=split)
    except (DatasetNotFoundError, ConnectionError) as error:
        raise MissingInputError(
            f"{name} is no local file or directory, nor a hub dataset this machine can load "
            f"({error}): check the path (a directory: ./{name}), or go online"
        ) from error


def check_sizes(units: Sequence[Unit], options: ReadOptions) -> None:
    """What the inputs' sizes tell before any is read: an empty file is refused (unless
    ``options.skip_bad_records``), and so are inputs that are all empty files.

    Raises:
        BadRecordError: an empty file, as :func:`index_inputs` would.
        InputError: every input is an empty file.
    """
    empty = [u for u in units if u.kind in FILE_KINDS.values() and u.fingerprint[:2] == "0:"]
    if empty and not options.skip_bad_records:
        message = f"{empty[0].name}: empty input file (no records)"
        raise BadRecordError(f"{message}; remove it from the inputs {SKIP_HINT}")
    if units and len(empty) == len(units):
        _no_records(units)


def _no_records(units: Sequence[Unit]) -> None:
    names = ", ".join(unit.name for unit in units[:3]) + (", ..." if len(units) > 3 else "")
    raise InputError(f"the inputs ({names}) hold no records: give a corpus with some text")


def index_inputs(units: Sequence[Unit], options: ReadOptions, pool: Any = None) -> list[dict]:
    """:func:`index_unit` of every input (in ``pool``, a ``multiprocessing`` pool, if given).

    Raises:
        BadRecordError: an input with a whole-file problem (an empty file), naming the file and
            the fix, unless ``options.skip_bad_records``.
        InputError: the inputs hold no record at all.
    """
    jobs = [(unit, options) for unit in units]
    indexes = pool.starmap(index_unit, jobs) if pool is not None else [index_unit(*j) for j in jobs]
    for index in indexes:
        if index["problem"] and not options.skip_bad_records:
            kind, message = index["problem"]
            fix = "remove it from the inputs" if kind == "empty_files" else "repair the file"
            raise BadRecordError(f"{message}; {fix} {SKIP_HINT}")
    if units and not any(index["records"] for index in indexes):
        _no_records(units)
    return indexes


def read_all(
    units: Sequence[Unit],
    indexes: Sequence[dict],
    options: ReadOptions,
    counts: RecordCounts,
    step: int = 1,
) -> Iterator[str]:
    """The documents of every ``step``-th record of all inputs, in order."""
    base = 0
    for unit, index in zip(units, indexes, strict=True):
        first = (-base) % step
        yield from read_unit(unit, index, first, index["records"], options, counts, step)
        base += index["records"]
