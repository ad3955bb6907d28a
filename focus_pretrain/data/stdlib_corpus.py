"""A real local corpus every machine has: the Python standard library's source files.

``pystdlib`` (or ``pystdlib:N``, the first ``N`` files by path) as a ``data.sources`` entry
reads the ``.py`` files of the running interpreter's standard library (``sysconfig``'s
``stdlib`` path; ``site-packages``, test suites and caches left out), one document per file,
in path order. It is real text with long-range structure (imports, definitions and their later
uses, classes whose methods refer to each other), needs no download, and is the same on every
machine with the same Python version (the version is part of its cache key). CPython 3.11:
734 files, 12 MB.
"""

from __future__ import annotations

import platform
import sysconfig
from pathlib import Path

from focus_pretrain.errors import InputError, MissingInputError

STDLIB_SOURCE = "pystdlib"
_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def is_stdlib_source(source: str) -> bool:
    """Does a ``data.sources`` entry name this corpus (``pystdlib`` or ``pystdlib:N``)?"""
    return source == STDLIB_SOURCE or source.startswith(f"{STDLIB_SOURCE}:")


def stdlib_files(source: str = STDLIB_SOURCE) -> list[Path]:
    """The corpus's files, in path order (the first ``N`` for ``pystdlib:N``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not set(p.relative_to(root).parts[:-1]) & _SKIP)
    if not files:
        raise MissingInputError(
            f"no standard-library sources under {root} (a stripped Python?): use another corpus"
        )
    count = stdlib_count(source)
    return files if count is None else files[:count]


def stdlib_count(source: str) -> int | None:
    """``N`` of ``pystdlib:N`` (``None``: every file).

    Raises:
        InputError: ``N`` is not a positive integer.
    """
    count = source.partition(":")[2]
    if not count:
        return None
    if not count.isdigit() or int(count) < 1:
        raise InputError(f"{source}: N in pystdlib:N must be a positive integer")
    return int(count)


def stdlib_documents(source: str = STDLIB_SOURCE) -> list[str]:
    """One document per file (undecodable bytes replaced)."""
    return [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files(source)]


def stdlib_cache_key(source: str) -> str:
    """``source`` plus the interpreter version (another stdlib is another corpus)."""
    return f"{source}-py{platform.python_version()}"
