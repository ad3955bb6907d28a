"""What a record must be to become a document, checked strictly: UTF-8, and (for JSON and
table inputs) an object or row whose text field is a string. A bad record raises
:class:`BadRecordError` naming where it is and the fix, or, when asked, is skipped and counted
(:class:`RecordCounts`). The readers of :mod:`focus_pretrain.data.corpus` call these checks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from focus_pretrain.errors import InputError

MAX_EXAMPLES = 10  # skipped records quoted in the stats
SKIP_HINT = "or pass --skip-bad-records to skip (and count) such records"


class BadRecordError(InputError):
    """A record or input file that cannot become a document; the message names the file and
    line (or row) and the fix (an :class:`~focus_pretrain.errors.InputError`: one line and
    status 2 from the commands)."""


@dataclass(frozen=True)
class ReadOptions:
    """How records become documents.

    Attributes:
        text_key: the field (column) holding a record's text.
        skip_bad_records: skip and count bad records instead of raising.
        seed: the demo corpus's seed.
        split: the split of a hub or saved ``datasets`` dataset.
    """

    text_key: str = "text"
    skip_bad_records: bool = False
    seed: int = 0
    split: str = "train"


class RecordCounts:
    """What reading skipped: bad records by kind (``skipped``), ``blank_lines``, and the first
    :data:`MAX_EXAMPLES` bad records' messages."""

    def __init__(self) -> None:
        self.skipped: Counter[str] = Counter()
        self.blank_lines = 0
        self.examples: list[str] = []

    def bad(self, kind: str, message: str, fix: str, options: ReadOptions) -> None:
        """Count a bad record, or raise :class:`BadRecordError` (``message; fix``)."""
        if not options.skip_bad_records:
            raise BadRecordError(f"{message}; {fix} {SKIP_HINT}")
        self.skipped[kind] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(message)


def decode_utf8(
    raw: bytes, where: str, first_line: int | None, options: ReadOptions, counts: RecordCounts
) -> str | None:
    """``raw`` as UTF-8 (strict); with ``first_line``, ``where`` is a file whose line and
    column of the bad byte are added to the message."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line_start = raw.rfind(b"\n", 0, error.start) + 1
        column = error.start - line_start + 1
        if first_line is not None:
            line = first_line + raw.count(b"\n", 0, error.start)
            where = f"{where}:{line}"
        counts.bad(
            "invalid_utf8",
            f"{where}: not valid UTF-8 (byte 0x{raw[error.start]:02x} at column {column})",
            "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8),",
            options,
        )
        return None


def text_of(record: Any, where: str, options: ReadOptions, counts: RecordCounts) -> str | None:
    key = options.text_key
    if not isinstance(record, dict):
        counts.bad(
            "not_an_object",
            f"{where}: the record is a JSON {type(record).__name__}, not an object",
            f"every record must be an object with a {key!r} string field;",
            options,
        )
        return None
    if key not in record:
        fields = ", ".join(sorted(map(str, record))[:10]) or "none"
        counts.bad(
            "missing_field",
            f"{where}: the record has no {key!r} field (its fields: {fields})",
            "pass --text-key FIELD if the text is in another field,",
            options,
        )
        return None
    return text_string(record[key], where, options, counts)


def text_string(value: Any, where: str, options: ReadOptions, counts: RecordCounts) -> str | None:
    if isinstance(value, bytes):
        return decode_utf8(value, where, None, options, counts)
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        counts.bad(
            "not_a_string",
            f"{where}: field {options.text_key!r} is {kind}, not a string",
            "give every record a text string,",
            options,
        )
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        counts.bad(
            "invalid_utf8",
            f"{where}: the text holds a lone surrogate (\\u{ord(value[error.start]):04x})",
            "fix the escaped character,",
            options,
        )
        return None
    return value
