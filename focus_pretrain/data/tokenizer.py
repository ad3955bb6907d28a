"""SentencePiece tokenizer: training with Llama-style options, and the object datasets use.

The options mirror Llama's tokenizer (BPE, byte fallback, digits split one per token, a dummy
prefix space, identity normalisation, ``<unk>=0, <s>=1, </s>=2``, no pad piece) so that a later
HuggingFace export (``LlamaTokenizer``-compatible) tokenises identically.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

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


def train_tokenizer(
    texts: Iterable[str], model_prefix: str | os.PathLike, vocab_size: int, **options: object
) -> Path:
    """Train a SentencePiece model on ``texts``; returns the ``.model`` path.

    ``options`` override :data:`LLAMA_STYLE_OPTIONS`. Each text is split into lines (one
    SentencePiece "sentence" per line).
    """
    prefix = Path(model_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    settings = {**LLAMA_STYLE_OPTIONS, "minloglevel": 2, **options}  # minloglevel: quiet
    lines = (line for text in texts for line in text.split("\n") if line)
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, model_prefix=str(prefix), vocab_size=vocab_size, **settings
    )
    return prefix.with_suffix(".model")


class Tokenizer:
    """A SentencePiece model with what Megatron's datasets need.

    Attributes:
        vocab_size: number of pieces (token ids ``0 .. vocab_size - 1``).
        bos, eod: begin-of-sequence and end-of-document ids (``</s>`` ends every document).
        pad: an id *outside* the vocabulary, so Megatron masks only its own padding.
        unique_identifiers: part of Megatron's dataset cache key (the model file's hash).
    """

    def __init__(self, model_path: str | os.PathLike) -> None:
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(
                f"tokenizer model {path} does not exist; train one with "
                "tools/preprocess_data.py --train-tokenizer or point data.tokenizer at a .model"
            )
        self.path = path
        self.processor = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self.processor.get_piece_size()
        self.bos = self.processor.bos_id()
        self.eod = self.processor.eos_id()
        self.pad = self.vocab_size
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        self.unique_identifiers = {"class": "SentencePiece", "sha256": digest}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return self.processor.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.processor.decode(list(ids))

    def tokenize(self, text: str) -> list[int]:
        """Megatron's tokenizer protocol: same as :meth:`encode`."""
        return self.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.decode(ids)
