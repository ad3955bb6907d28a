"""SentencePiece tokenizer: training with Llama-style options, and the object datasets use.

The options mirror Llama's tokenizer (BPE, byte fallback, digits split one per token, a dummy
prefix space, identity normalisation, ``<unk>=0, <s>=1, </s>=2``, no pad piece) so that a later
HuggingFace export (``LlamaTokenizer``-compatible) tokenises identically.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
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


ADD_BOS_CHOICES = ("auto", True, False)  # data.add_bos: see Tokenizer.document_prefix

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
            "(--vocab-size of focus-pretrain preprocess; model.vocab_size may stay larger) or "
            "point data.sources at a larger corpus "
            "(the embedded demo corpus supports a few thousand pieces)"
        ) from err
    return prefix.with_suffix(".model")


def check_add_bos(value: object) -> None:
    """Raise :class:`InputError` unless ``value`` is one of :data:`ADD_BOS_CHOICES`."""
    if not isinstance(value, (bool, str)) or value not in ADD_BOS_CHOICES:
        raise InputError(f"data.add_bos is {value!r}: use auto, true or false")


def check_document_prefix(
    recorded: Sequence[int], tokenizer: Tokenizer, add_bos: bool | str, files: str
) -> None:
    """Refuse token ``files`` whose documents begin with ``recorded`` ids when ``data.add_bos``
    (true or false; ``auto`` takes the files as they are) asks for others.

    Raises:
        InputError: naming both prefixes and the two fixes.
    """
    if add_bos == "auto":
        return
    wanted = tokenizer.document_prefix(add_bos)
    if list(recorded) != wanted:
        raise InputError(
            f"token files {files} were made with documents beginning with {list(recorded)} "
            f"but data.add_bos={str(add_bos).lower()} asks for {wanted}; re-tokenise them "
            f"(focus-pretrain preprocess --add-bos {str(add_bos).lower()}) or set "
            "data.add_bos to auto"
        )


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
            try:
                self.processor = spm.SentencePieceProcessor(model_file=str(path))
            except RuntimeError as err:  # "could not parse ModelProto": not a model file
                raise InputError(
                    f"tokenizer {path} is not a SentencePiece model ({err}); give a .model "
                    "file (focus-pretrain preprocess --train-tokenizer writes one) or a "
                    "directory with tokenizer.json"
                ) from None
            self.hf = None
            self._adds_bos = None
            self.vocab_size = self.processor.get_piece_size()
            bos = self.processor.bos_id()
            self.bos = None if bos < 0 else bos
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
        # transformers' split_special_tokens (our exports set it): "<s>" in text is text
        self.hf.encode_special_tokens = settings.get("split_special_tokens") is True
        add_bos = settings.get("add_bos_token")  # transformers' own switch, when set
        self._adds_bos = add_bos if isinstance(add_bos, bool) else None
        if self.eod is None:
            raise InputError(
                f"{path}: tokenizer_config.json names no eos_token present in tokenizer.json; "
                "documents need an end-of-document id"
            )

    def document_prefix(self, add_bos: bool | str = "auto") -> list[int]:
        """The ids every training document begins with (``data.add_bos``).

        ``True``: the BOS id; ``False``: none; ``"auto"``: what the tokenizer's own encoding
        puts before a text, so that a pretrained model sees documents as it was trained to
        (an HF tokenizer's ``add_bos_token`` when its ``tokenizer_config.json`` sets it, else
        its post-processor's leading ids: Gemma and Llama 3 begin with their BOS, Qwen2 and
        SmolLM2 with nothing); a SentencePiece ``.model``: none (documents are separated by
        their EOD only, as Megatron's GPT data are).

        Raises:
            InputError: ``add_bos`` is not one of :data:`ADD_BOS_CHOICES`, or ``True`` for a
                tokenizer without a BOS token.
        """
        check_add_bos(add_bos)
        if add_bos is True and self.bos is None:
            raise InputError(
                f"data.add_bos is true but tokenizer {self.path} has no BOS token; set "
                "data.add_bos to auto or false"
            )
        if add_bos != "auto":
            return [self.bos] if add_bos else []
        if self.hf is None:
            return []
        if self._adds_bos is not None:
            return [self.bos] if self._adds_bos and self.bos is not None else []
        return self._post_processor_prefix()

    def _post_processor_prefix(self) -> list[int]:
        """The ids an HF tokenizer's post-processor puts before a text's own ids."""
        probe = "Focus attention"
        plain = self.hf.encode(probe, add_special_tokens=False).ids
        full = self.hf.encode(probe, add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[:start]
        return []  # the post-processor changes the text's own ids: add nothing

    def encode_documents(self, texts: list[str], prefix: Sequence[int] = ()) -> list[list[int]]:
        """Each text as a training document: ``prefix`` (:meth:`document_prefix`), the
        text's ids, the EOD id."""
        if self.hf is not None:
            encoded = [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]
        else:
            encoded = self.processor.encode(texts, num_threads=1)
        return [[*prefix, *ids, self.eod] for ids in encoded]

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
