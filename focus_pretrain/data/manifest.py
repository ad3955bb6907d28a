"""Reading the output of :func:`focus_pretrain.data.shards.preprocess_corpus` for training:
find a directory's manifest, read it, and list its shards (checked against the tokenizer)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from focus_pretrain.data.tokenizer import Tokenizer, check_document_prefix
from focus_pretrain.errors import InputError

FORMAT = "focus-pretrain-shards"
MANIFEST = "manifest.json"


def find_manifest(source: str) -> Path | None:
    """The manifest a ``data.sources`` entry names (``OUT/manifest.json`` or ``OUT``), else
    ``None``.

    Raises:
        ValueError: ``OUT`` holds shards but no manifest (an unfinished run), with the fix.
    """
    path = Path(source)
    if path.name == MANIFEST and path.is_file():
        return path
    if not path.is_dir():
        return None
    if (path / MANIFEST).is_file():
        return path / MANIFEST
    if any(path.glob("shard-*.idx")):
        raise ValueError(
            f"{path} holds shards but no {MANIFEST}: its focus-pretrain preprocess run has not "
            "finished; rerun the same command to resume it"
        )
    return None


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """A manifest written by :func:`~focus_pretrain.data.shards.preprocess_corpus`.

    Raises:
        ValueError: not such a manifest.
    """
    manifest = json.loads(Path(path).read_text())
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a manifest of focus-pretrain preprocess")
    return manifest


def manifest_shards(
    path: str | os.PathLike, tokenizer: Tokenizer | None = None, add_bos: bool | str = "auto"
) -> list[tuple[str, int]]:
    """``(prefix, tokens)`` of each non-empty shard a manifest lists, checking that every shard
    exists and, with ``tokenizer``, that the shards were made with it (and, ``add_bos`` true
    or false, with the document prefix it asks for).

    Raises:
        InputError: another tokenizer made the shards, or another document prefix (naming
            both and the fix).
        FileNotFoundError: a listed shard is missing.
    """
    manifest = read_manifest(path)
    made_with = manifest["tokenizer"]
    if tokenizer is not None and not made_with["sha256"].startswith(
        tokenizer.unique_identifiers["sha256"]
    ):
        raise InputError(
            f"the shards of {path} were made with tokenizer {made_with['path']} (sha256 "
            f"{made_with['sha256'][:16]}, {made_with['vocab_size']} pieces) but data.tokenizer "
            f"is {tokenizer.path} (sha256 {tokenizer.unique_identifiers['sha256']}, "
            f"{tokenizer.vocab_size} pieces); point data.tokenizer at the original or "
            "re-tokenise with focus-pretrain preprocess --tokenizer"
        )
    if tokenizer is not None:  # manifests from before the prefix was recorded: none
        recorded = manifest.get("document_prefix", [])
        check_document_prefix(recorded, tokenizer, add_bos, str(Path(path).parent))
    directory = Path(path).parent
    shards = []
    for shard in manifest["shards"]:
        prefix = directory / shard["name"]
        if not Path(f"{prefix}.idx").is_file() or not Path(f"{prefix}.bin").is_file():
            raise FileNotFoundError(
                f"{prefix}.bin/.idx, listed in {path}, is missing; rerun focus-pretrain preprocess "
                "with --overwrite to rebuild the directory"
            )
        if shard["documents"]:
            shards.append((str(prefix), int(shard["tokens"])))
    if not shards:
        raise ValueError(f"{path} lists no documents (every record was skipped?)")
    return shards
