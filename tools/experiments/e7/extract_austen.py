"""Extract Jane Austen's novels from Debian's r-cran-janeaustenr (an R lazy-load database,
Rdata.rdb/.rdx) into one plain-text file per novel (needs `pip install rdata`).

    python tools/experiments/e7/extract_austen.py .../janeaustenr/data OUT_DIR
"""

from __future__ import annotations

import gzip
import struct
import sys
import zlib
from pathlib import Path

import rdata


def unpack(blob: bytes) -> bytes:
    """One object of the .rdb: a 4-byte big-endian length, then zlib data."""
    size = struct.unpack(">I", blob[:4])[0]
    raw = zlib.decompress(blob[4:])
    assert len(raw) == size
    return raw


def main() -> None:
    data, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    index = rdata.parser.parse_data(gzip.decompress((data / "Rdata.rdx").read_bytes()))
    variables = rdata.conversion.convert(index)["variables"]
    database = (data / "Rdata.rdb").read_bytes()
    for name, (offset, length) in variables.items():
        offset, length = int(offset), int(length)
        value = rdata.conversion.convert(
            rdata.parser.parse_data(unpack(database[offset : offset + length]))
        )
        value = value.tolist() if hasattr(value, "tolist") else value
        if isinstance(value, list) and value and all(isinstance(x, str | None) for x in value):
            text = "\n".join(x or "" for x in value)
            (out / f"{name}.txt").write_text(text)
            print(name, len(value), "lines", len(text), "chars")


if __name__ == "__main__":
    main()
