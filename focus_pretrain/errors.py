"""Errors in what the user gave (a recipe, an override, a file, a checkpoint), not crashes.

An :class:`InputError`'s message says what is wrong and how to fix it; the command-line entry
points (:func:`exit_on_input_error`) print it on one line and exit with status 2, as argparse
does for a bad argument, and keep the full traceback for everything else (a real crash). The
classes are also ``ValueError`` / ``FileNotFoundError`` / ``NotImplementedError``, so code and
tests that catch those still do.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

EXIT_INPUT_ERROR = 2  # argparse's status for a bad command line


class InputError(ValueError):
    """Bad user input: a config key or value, a layout that does not divide, a checkpoint that
    does not fit its recipe. The message names the problem and the fix."""


class MissingInputError(InputError, FileNotFoundError):
    """A file or directory the user named (or one it should hold) does not exist."""


class UnsupportedInputError(InputError, NotImplementedError):
    """Valid input that this operation cannot do (e.g. exporting a model whose routing the
    exported code cannot reproduce)."""


@contextmanager
def exit_on_input_error(prog: str) -> Iterator[None]:
    """Inside it, an :class:`InputError` ends the process with ``prog: error: <message>`` on
    stderr and status 2 (no traceback); any other exception propagates with its traceback."""
    try:
        yield
    except InputError as err:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        sys.exit(EXIT_INPUT_ERROR)


def as_input_error(call: Callable[[], T]) -> T:
    """``call()``, with a ``ValueError`` it raises re-raised as an :class:`InputError` (same
    message; the original chained) and a ``FileNotFoundError`` as a :class:`MissingInputError`:
    for validators whose every ``ValueError`` is about the input."""
    try:
        return call()
    except InputError:
        raise
    except FileNotFoundError as err:
        raise MissingInputError(str(err)) from err
    except ValueError as err:
        raise InputError(str(err)) from err
