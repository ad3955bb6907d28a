"""What an export writes: the shipped modeling code it carries, the marker that says a
directory is an export (and lists the files it wrote), and the check that refuses to write over
anything that is not an earlier export (see :mod:`focus_pretrain.storage.files`). Reading an
export back: :mod:`focus_pretrain.convert.export_dir`."""

from __future__ import annotations

import hashlib
import json
import os
from fnmatch import fnmatch
from pathlib import Path

from focus_pretrain.storage.files import check_output_dir

MODELING_DIR = Path(__file__).with_name("hf_modeling")
# the remote code an export ships (loaded by ``trust_remote_code``; imports only torch/transformers)
SHIPPED_MODELING_FILES = (
    "configuration_focus.py",
    "modeling_focus.py",
    "focus_cache.py",
    "focus_inputs.py",
    "focus_router.py",
    "focus_rules.py",
    "focus_static.py",
    "focus_static_sparse.py",
)


EXPORT_MARKER = "focus_export.json"
ADAPTER_MARKER = "focus_adapter.json"
# what an export from before the marker listed its files wrote (besides the marker)
_EARLIER_EXPORT_FILES = (
    "*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "configuration_focus.py", "modeling_focus.py", "focus_cache.py", "focus_rules.py",
    "focus_static.py",  # the shipped code of then (fixed: later files are in the marker's list)
)  # fmt: skip


def _files_written(out: Path, marker: str) -> set[str] | None:
    """The entries an earlier export into ``out`` wrote (its marker's ``files``; for an
    export from before that list existed, the names an export writes), ``None`` when the
    marker is unreadable."""
    try:
        record = json.loads((out / marker).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("files"), list):
        return {str(name) for name in record["files"]}
    if marker == ADAPTER_MARKER:  # an adapter of then wrote its weights alone (it may lie
        return {"focus_adapter.safetensors"}  # next to the base model's files: not ours)
    return {p.name for p in out.iterdir() if any(fnmatch(p.name, g) for g in _EARLIER_EXPORT_FILES)}


def check_export_dir(
    out_dir: str | os.PathLike,
    overwrite: bool,
    inputs: list[tuple] = (),
    marker: str = EXPORT_MARKER,
) -> None:
    """Refuse an output directory an export may not write (before any work): a file; one
    that is, holds or lies inside one of the export's ``inputs``; a non-empty one without
    ``overwrite`` (``--force``); with it, one that is not an earlier export (no ``marker``)
    or holds files that export did not write (named). A full export may replace an
    adapter-only one and the other way round (either marker: both are this command's).
    See :mod:`focus_pretrain.storage.files`."""
    markers = (marker, *(m for m in (EXPORT_MARKER, ADAPTER_MARKER) if m != marker))

    def owned(out: Path) -> set[str] | None:
        present = next(m for m in markers if (out / m).is_file())  # checked there first
        return _files_written(out, present)

    check_output_dir(
        out_dir,
        force=overwrite,
        marker=markers,
        what="export",
        owned=owned,
        inputs=inputs,
    )


def shipped_code_digests(directory: str | os.PathLike) -> dict[str, str]:
    """sha256 of each shipped modeling file in ``directory`` (what ``trust_remote_code``
    runs when the export is loaded)."""
    return {
        name: hashlib.sha256((Path(directory) / name).read_bytes()).hexdigest()
        for name in SHIPPED_MODELING_FILES
        if (Path(directory) / name).is_file()
    }
