"""A checkpoints directory on disk: its ``latest`` pointer, its step folders, and the manifest
that lets a reader tell a whole checkpoint from a truncated or corrupt one.

Layout (``run.output_dir/checkpoints``)::

    latest               the tag of the newest complete checkpoint ("step_00000100")
    step_00000100/       DeepSpeed's files, config.yaml, the tokenizer, checkpoint.json
    .tmp-step_00000200/  a save in progress (renamed to step_00000200 when complete)

``checkpoint.json`` lists every file of the folder with its size and CRC-32, as written (each
rank checksums the files it wrote, rank 0 writes the list); :func:`verify_checkpoint` compares
the folder with it. :func:`read_latest` never lets a missing, empty or dangling ``latest`` pass
for a fresh run when step folders exist.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections.abc import Iterable, Sequence
from fnmatch import fnmatch
from pathlib import Path

from focus_pretrain.errors import InputError

TAG = re.compile(r"^step_(\d+)$")
LATEST = "latest"
MANIFEST = "checkpoint.json"
TOKENIZER_FILE = "tokenizer.model"  # a SentencePiece tokenizer's copy in a checkpoint
TOKENIZER_DIR = "tokenizer"  # a HuggingFace tokenizer's files' copy in a checkpoint
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_CHUNK = 1 << 24


def tag_for(step: int) -> str:
    """The directory name of step ``step``'s checkpoint."""
    return f"step_{step:08d}"


def step_of(tag: str) -> int | None:
    """The step a tag names, or ``None`` when it is not a step tag."""
    match = TAG.match(tag)
    return None if match is None else int(match.group(1))


def step_folders(root: str | os.PathLike) -> list[str]:
    """The step folders under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if p.is_dir() and TAG.match(p.name)]
    return sorted(tags, key=step_of)


def _listed(tags: Sequence[str]) -> str:
    shown = list(tags) if len(tags) <= 6 else [*tags[:2], "...", *tags[-3:]]
    return ", ".join(shown)


class CheckpointStateError(InputError):
    """The checkpoints directory is not in a state a run may resume from or start over."""


def read_latest(root: str | os.PathLike) -> str | None:
    """The tag ``root/latest`` names, validated; ``None`` for a fresh run (no ``latest`` and
    no step folder). Never a silent fresh start over existing checkpoints:

    Raises:
        CheckpointStateError: ``latest`` is missing while step folders exist, empty, not a
            step tag, or names a folder that does not exist; the message names the folders
            present and the fix.
    """
    root = Path(root)
    pointer = root / LATEST
    tags = step_folders(root)
    present = f"checkpoints present: {_listed(tags)}" if tags else "no checkpoint folder remains"
    fix = (
        f"write the tag to resume from into {pointer} (e.g. `echo {tags[-1]} > {pointer}`)"
        if tags
        else f"delete {pointer} to start this run over from step 0"
    )
    fix += ", or train into a new run.output_dir"
    if not pointer.exists():
        if not tags:
            return None
        raise CheckpointStateError(
            f"{root} holds checkpoints but no {LATEST} file ({present}): {fix}"
        )
    if not pointer.is_file():
        raise CheckpointStateError(f"{pointer} is not a file: {fix}")
    tag = pointer.read_text(errors="replace").strip()
    if not tag:
        raise CheckpointStateError(f"{pointer} is empty ({present}): {fix}")
    if step_of(tag) is None:
        raise CheckpointStateError(
            f"{pointer} names {tag[:60]!r}, which is not a checkpoint tag (step_NNNNNNNN) "
            f"({present}): {fix}"
        )
    if not (root / tag).is_dir():
        raise CheckpointStateError(
            f"{pointer} names {tag}, which does not exist ({present}): {fix}"
        )
    return tag


def file_record(path: str | os.PathLike) -> dict[str, int]:
    """``{"size", "crc32"}`` of a file."""
    crc, size = 0, 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"size": size, "crc32": crc}


# the recipe is the user's to edit (a moved train.init_from_hf, say: our refusals say so), and
# it is validated whenever it is read; every other file of a checkpoint is listed
UNLISTED = frozenset({MANIFEST, "config.yaml"})


def write_manifest(folder: Path, records: dict[str, dict[str, int]]) -> Path:
    """``folder/checkpoint.json`` listing ``records`` (relative path -> size and CRC-32) plus
    every other file already in the folder (checksummed here, e.g. the tokenizer copy), but
    :data:`UNLISTED`."""
    folder = Path(folder)
    files = {name: record for name, record in records.items() if name not in UNLISTED}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_file() and name not in UNLISTED and name not in files:
            files[name] = file_record(path)
    path = folder / MANIFEST
    path.write_text(json.dumps({"format": 1, "files": dict(sorted(files.items()))}, indent=1))
    return path


def read_manifest(folder: str | os.PathLike) -> dict[str, dict[str, int]] | None:
    """The files ``checkpoint.json`` lists, or ``None`` for a checkpoint written before
    manifests existed.

    Raises:
        InputError: the manifest is unreadable (itself truncated or corrupt).
    """
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        return {
            str(k): {"size": int(v["size"]), "crc32": int(v["crc32"])} for k, v in files.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise InputError(f"{path} is unreadable ({err}): the checkpoint is damaged") from err


def check_files(
    folder: str | os.PathLike,
    names: Iterable[str],
    manifest: dict[str, dict[str, int]],
    checksums: bool = True,
) -> list[str]:
    """The problems of ``names`` (relative paths listed in ``manifest``) in ``folder``: a file
    missing, of another size (truncated) or, with ``checksums``, of another CRC-32
    (corrupt)."""
    problems = []
    for name in names:
        path, expected = Path(folder) / name, manifest[name]
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        size = path.stat().st_size
        if size != expected["size"]:
            written = expected["size"]
            problems.append(f"{path} is {size:,} bytes, written as {written:,} (truncated)")
        elif checksums and file_record(path)["crc32"] != expected["crc32"]:
            problems.append(f"{path} does not match its checksum (corrupt)")
    return problems


def verify_checkpoint(
    folder: str | os.PathLike, checksum_patterns: Sequence[str] | None = None
) -> list[str]:
    """The problems of checkpoint ``folder`` against its manifest (empty: whole, or written
    before manifests). Every listed file's size is checked; its CRC-32 too when its name
    matches one of ``checksum_patterns`` (``None``: every file)."""
    manifest = read_manifest(folder)
    if manifest is None:
        return []
    problems = check_files(folder, manifest, manifest, checksums=False)
    if problems:
        return problems
    names = [
        n
        for n in manifest
        if checksum_patterns is None or any(fnmatch(n, p) for p in checksum_patterns)
    ]
    return check_files(folder, names, manifest)


def damaged_checkpoint_error(root: Path, tag: str, problems: list[str]) -> InputError:
    """The refusal of a damaged checkpoint ``tag``: its problems, and the newest earlier
    checkpoint that verifies whole, offered as the one to resume from."""
    earlier = [t for t in step_folders(root) if step_of(t) < step_of(tag)]
    offer = f"no earlier checkpoint in {root} is whole"
    for candidate in reversed(earlier):
        if not verify_checkpoint(root / candidate):
            offer = (
                f"the previous checkpoint {candidate} is whole: to use it, "
                f"`echo {candidate} > {root / LATEST}`"
            )
            break
    shown = "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
    return InputError(f"checkpoint {root / tag} is damaged: {shown}; {offer}")


def prune(root: Path, current: str, keep_last: int) -> list[str]:
    """Delete the checkpoints older than ``current`` beyond the ``keep_last`` newest (current
    included); never ``current`` nor a newer one (a rollback's later folders stay). Returns
    the tags deleted."""
    now = step_of(current)
    older = [t for t in step_folders(root) if step_of(t) < now]
    doomed = older[: max(0, len(older) - (keep_last - 1))]
    for tag in doomed:
        discard(root / tag)
    return doomed


LEFTOVERS = (".tmp-step_*", ".old-step_*", ".deleting-step_*", f".{LATEST}.tmp-*")


def discard(folder: Path) -> None:
    """Delete a checkpoint folder: renamed to ``.deleting-<tag>`` first (atomic), so a crash
    mid-deletion never leaves a half-deleted ``step_N`` that looks like a checkpoint; the
    leftover is removed at the next start (:data:`LEFTOVERS`)."""
    folder = Path(folder)
    doomed = folder.with_name(f".deleting-{folder.name}")
    if doomed.exists():  # an earlier deletion's leftover
        shutil.rmtree(doomed, ignore_errors=True)
    os.rename(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_leftovers(root: Path) -> list[str]:
    """Delete what killed saves and prunes left under ``root`` (:data:`LEFTOVERS`: all of them
    named by this module; call it only while holding the run's lock, since a live save's
    ``.tmp-step_*`` is among them). Returns the names removed."""
    removed = []
    for pattern in LEFTOVERS:
        for path in Path(root).glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def tokenizer_copy(folder: str | os.PathLike) -> Path | None:
    """The tokenizer a checkpoint folder holds a copy of (see :func:`copy_tokenizer`)."""
    folder = Path(folder)
    if (folder / TOKENIZER_FILE).is_file():
        return folder / TOKENIZER_FILE
    if (folder / TOKENIZER_DIR / "tokenizer.json").is_file():
        return folder / TOKENIZER_DIR
    return None


def copy_tokenizer(source: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """Copy the run's tokenizer (a SentencePiece ``.model``, or a HuggingFace tokenizer
    directory's tokenizer files) into a checkpoint folder, so the checkpoint is whole without
    the data cache or the directory it was trained from. Returns the copy."""
    source, folder = Path(source), Path(folder)
    if source.is_file():
        shutil.copyfile(source, folder / TOKENIZER_FILE)
        return folder / TOKENIZER_FILE
    target = folder / TOKENIZER_DIR
    target.mkdir(exist_ok=True)
    for name in HF_TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    return target
