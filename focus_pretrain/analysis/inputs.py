"""Text to inspect: token samples from text files or a corpus, checked against the model.

``--text FILE``: each file is one sample (all of it, or its first ``length`` tokens).
``--corpus SOURCE``: anything :func:`focus_pretrain.data.load_texts` reads (``demo:50``, a
``.jsonl``/``.txt`` file, a directory, a hub dataset), tokenised, each document followed by the
end-of-document id as in training, concatenated and cut into ``samples`` pieces of ``length``
tokens.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from focus_pretrain.data import Tokenizer, load_texts
from focus_pretrain.errors import InputError, MissingInputError


@dataclass
class Sample:
    """One sample: a name (file or corpus piece) and its token ids ``[n]`` (int64)."""

    name: str
    ids: Tensor


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A token as it reads in text: its piece with the word-boundary marker as a space
    (SentencePiece ``▁``; byte-level BPE pieces and byte-fallback tokens are decoded)."""
    if tokenizer.hf is None:
        processor = tokenizer.processor
        if processor.is_byte(token_id):
            return processor.decode([token_id])
        return processor.id_to_piece(token_id).replace("▁", " ")
    piece = tokenizer.hf.id_to_token(token_id)
    if piece is None:
        return f"<{token_id}>"
    if (piece.startswith("<0x") and piece.endswith(">")) or "Ġ" in piece or "Ċ" in piece:
        return tokenizer.hf.decode([token_id], skip_special_tokens=False)
    return piece.replace("▁", " ")


def check_counts(counts: dict[str, int | None]) -> None:
    """Refuse a count below 1 (``None``: not given), naming its option."""
    for name, value in counts.items():
        if value is not None and value < 1:
            raise InputError(f"{name} must be at least 1, got {value}")


def check_length(length: int, max_length: int) -> None:
    """Refuse ``--length`` outside ``1 .. max_length``."""
    if not 1 <= length <= max_length:
        raise InputError(
            f"--length {length} is outside 1 .. {max_length} (the model's maximum length): "
            f"pass --length {max_length} or less"
        )


def text_samples(
    paths: Sequence[str | os.PathLike],
    tokenizer: Tokenizer,
    max_length: int,
    length: int | None = None,
    prefix: Sequence[int] = (),
) -> list[Sample]:
    """One sample per text file, beginning with ``prefix`` (the tokenizer's document prefix)
    (its first ``length`` tokens when given).

    Raises:
        MissingInputError: a file does not exist.
        InputError: a file is empty (no token), or longer than the model's maximum length
            with no ``length`` to cut it.
    """
    if length is not None:
        check_length(length, max_length)
    samples = []
    for path in map(Path, paths):
        if not path.is_file():
            raise MissingInputError(f"--text {path} does not exist: give an existing text file")
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        ids = [*prefix, *ids] if ids else ids
        if not ids:
            raise InputError(f"--text {path} is empty (no token): give a file with some text")
        if length is None and len(ids) > max_length:
            raise InputError(
                f"--text {path} has {len(ids)} tokens, more than the model's maximum length "
                f"{max_length}: shorten the text, or pass --length {max_length} to inspect its "
                f"first {max_length} tokens"
            )
        samples.append(Sample(str(path), torch.tensor(ids[:length], dtype=torch.int64)))
    return samples


def corpus_samples(
    source: str,
    tokenizer: Tokenizer,
    *,
    samples: int,
    length: int,
    max_length: int,
    prefix: Sequence[int] = (),
) -> list[Sample]:
    """``samples`` pieces of ``length`` tokens from the start of corpus ``source``, its
    documents as training packs them (``prefix``, the text, EOD).

    Raises:
        InputError: bad ``samples``/``length``, or a corpus with fewer tokens than needed.
    """
    check_length(length, max_length)
    check_counts({"--samples": samples})
    needed = samples * length
    stream: list[int] = []
    for text in load_texts(source)["text"]:
        stream += tokenizer.encode_documents([text], prefix)[0]
        if len(stream) >= needed:
            break
    if len(stream) < needed:
        raise InputError(
            f"--corpus {source} has {len(stream)} tokens, fewer than --samples {samples} x "
            f"--length {length} = {needed}: lower --samples or --length, or use a larger corpus"
        )
    ids = torch.tensor(stream[:needed], dtype=torch.int64).reshape(samples, length)  # [N, L]
    return [Sample(f"{source}[{i * length}:{(i + 1) * length}]", row) for i, row in enumerate(ids)]


def batches(samples: Sequence[Sample], batch_size: int) -> Iterator[Tensor]:
    """``[b, s]`` token batches of equal-length samples (at most ``batch_size`` each), in
    order of first appearance of each length; the first batch starts with ``samples[0]``."""
    check_counts({"--batch-size": batch_size})
    by_length: dict[int, list[Tensor]] = {}
    for sample in samples:
        by_length.setdefault(sample.ids.numel(), []).append(sample.ids)
    for rows in by_length.values():
        for start in range(0, len(rows), batch_size):
            yield torch.stack(rows[start : start + batch_size])  # [b, s]
