"""SentencePiece tokenizer: training with Llama-style options, and the object datasets use.

The options mirror Llama's tokenizer (BPE, byte fallback, digits split one per token, a dummy
prefix space, identity normalisation, ``<unk>=0, <s>=1, </s>=2``, no pad piece) so that a later
HuggingFace export (``LlamaTokenizer``-compatible) tokenises identically.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

from focus_pretrain.errors import InputError, MissingInputError

LLAMA_STYLE_OPTIONS: dict[str, object] = dict(
    model_type="bpe",
    byte_fallback=True,
    split_digits=True,
    add_dummy_prefix=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    character_coverage=1.0,
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=-1,
    max_sentence_length=1 << 16,
    num_threads=os.cpu_count() or 1,
)


MIN_VOCAB_SIZE = 259  # byte fallback's 256 byte pieces and <unk>, <s>, </s>


def check_vocab_size(vocab_size: int, **options: object) -> None:
    """Refuse a ``vocab_size`` below what any corpus needs (with byte fallback, the default
    of :data:`LLAMA_STYLE_OPTIONS` that ``options`` override: :data:`MIN_VOCAB_SIZE`).

    Raises:
        InputError: naming the setting and the minimum.
    """
    low = MIN_VOCAB_SIZE if {**LLAMA_STYLE_OPTIONS, **options}.get("byte_fallback") else 4
    if vocab_size < low:
        raise InputError(
            f"vocab_size={vocab_size} is less than the {low} pieces a tokenizer needs (with byte "
            "fallback: 256 bytes, <unk>, <s>, </s>); raise data.vocab_size (--vocab-size of "
            "focus-pretrain preprocess)"
        )


def check_tokenizer_path(path: str | os.PathLike) -> None:
    """Refuse a tokenizer path that is neither a file (a SentencePiece ``.model``) nor a
    directory with ``tokenizer.json`` (HuggingFace).

    Raises:
        MissingInputError: naming the path and what to give instead.
    """
    path = Path(path)
    if path.is_dir() and not (path / "tokenizer.json").is_file():
        raise MissingInputError(
            f"{path} is a directory without tokenizer.json: point data.tokenizer at a "
            "SentencePiece .model or a HuggingFace tokenizer directory"
        )
    if not path.exists():
        raise MissingInputError(
            f"tokenizer model {path} does not exist; train one with "
            "focus-pretrain preprocess --train-tokenizer or point data.tokenizer at a .model "
            "(or at a HuggingFace tokenizer directory)"
        )


def train_tokenizer(
    texts: Iterable[str], model_prefix: str | os.PathLike, vocab_size: int, **options: object
) -> Path:
    """Train a SentencePiece model on ``texts``; returns the ``.model`` path.

    ``options`` override :data:`LLAMA_STYLE_OPTIONS`. Each text is split into lines (one
    SentencePiece "sentence" per line).

    Raises:
        InputError: ``vocab_size`` is more than the corpus can fill, or less than its
            characters, the byte-fallback bytes and the special pieces need; no text at all.
    """
    check_vocab_size(vocab_size, **options)
    prefix = Path(model_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    settings = {**LLAMA_STYLE_OPTIONS, "minloglevel": 2, **options}  # minloglevel: quiet
    lines = (line for text in texts for line in text.split("\n") if line)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines, model_prefix=str(prefix), vocab_size=vocab_size, **settings
        )
    except RuntimeError as err:
        if "smaller than required_chars" in str(err):  # "... required_chars. 260 vs 298."
            needed = str(err).partition("required_chars.")[2].partition(" vs ")[2].split(".")[0]
            raise InputError(
                f"vocab_size={vocab_size} is less than the {needed} pieces this corpus needs (its "
                "characters, 256 byte-fallback bytes, <unk>, <s>, </s>); raise data.vocab_size "
                "(--vocab-size of focus-pretrain preprocess)"
            ) from err
        if "sentences_.empty()" in str(err):
            raise InputError("no text to train a tokenizer on: the corpus is empty") from err
        if "Vocabulary size too high" not in str(err):
            raise
        # SentencePiece says "... Please set it to a value <= N": the corpus is too small
        raise InputError(
            f"data.vocab_size={vocab_size} is more than a tokenizer can learn from this corpus "
            f"(SentencePiece: {str(err).strip().splitlines()[-1]}); lower data.vocab_size "
            "(model.vocab_size may stay larger) or point data.sources at a larger corpus "
            "(the embedded demo corpus supports a few thousand pieces)"
        ) from err
    return prefix.with_suffix(".model")


class Tokenizer:
    """A tokenizer with what Megatron's datasets need: a SentencePiece ``.model`` file, or a
    HuggingFace tokenizer directory (``tokenizer.json``, as a pretrained model ships it, for
    retrofitting that model on its own tokenisation).

    Attributes:
        vocab_size: number of ids (``0 .. vocab_size - 1``).
        bos, eod: begin-of-sequence (``None`` if the tokenizer has none) and end-of-document ids
            (``</s>``, or an HF tokenizer's ``eos_token``, ends every document).
        pad: an id *outside* the vocabulary, so Megatron masks only its own padding.
        unique_identifiers: part of Megatron's dataset cache key (the tokenizer file's hash).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        check_tokenizer_path(path)
        if path.is_dir():
            self._init_hf(path)
            digest_of = path / "tokenizer.json"
        else:
            self.processor = spm.SentencePieceProcessor(model_file=str(path))
            self.hf = None
            self.vocab_size = self.processor.get_piece_size()
            self.bos = self.processor.bos_id()
            self.eod = self.processor.eos_id()
            digest_of = path
        self.path = path
        self.pad = self.vocab_size
        digest = hashlib.sha256(digest_of.read_bytes()).hexdigest()[:16]
        kind = "SentencePiece" if self.hf is None else "HuggingFace"
        self.unique_identifiers = {"class": kind, "sha256": digest}

    def _init_hf(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
        self.processor = None
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        settings = {}
        if (path / "tokenizer_config.json").is_file():
            settings = json.loads((path / "tokenizer_config.json").read_text())

        def token_id(name: str) -> int | None:
            token = settings.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            return None if token is None else self.hf.token_to_id(token)

        self.bos = token_id("bos_token")
        self.eod = token_id("eos_token")
        if self.eod is None:
            raise InputError(
                f"{path}: tokenizer_config.json names no eos_token present in tokenizer.json; "
                "documents need an end-of-document id"
            )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        if self.hf is not None:
            return self.hf.encode(text, add_special_tokens=False).ids
        return self.processor.encode(text)

    def encode_with_offsets(self, text: str) -> list[tuple[int, int, int]]:
        """``(id, begin, end)`` per token, with character offsets into ``text``."""
        if self.hf is not None:
            encoding = self.hf.encode(text, add_special_tokens=False)
            return [(i, a, b) for i, (a, b) in zip(encoding.ids, encoding.offsets, strict=True)]
        pieces = self.processor.encode(text, return_type="proto").pieces
        return [(p.id, p.begin, p.end) for p in pieces]

    def decode(self, ids: Iterable[int]) -> str:
        if self.hf is not None:
            return self.hf.decode(list(ids), skip_special_tokens=False)
        return self.processor.decode(list(ids))

    def tokenize(self, text: str) -> list[int]:
        """Megatron's tokenizer protocol: same as :meth:`encode`."""
        return self.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.decode(ids)
