"""Training data: the ``data:`` section, preparing token files, Megatron's ``GPTDataset`` splits
and blends, and a sampler that resumes exactly from a consumed-sample count.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from focus_pretrain.data.demo_corpus import VALUES, DemoSpec, is_demo_source
from focus_pretrain.data.preprocess import check_tokenizer, load_texts, tokenize_to_indexed
from focus_pretrain.data.stdlib_corpus import is_stdlib_source, stdlib_cache_key
from focus_pretrain.data.tokenizer import Tokenizer, train_tokenizer
from focus_pretrain.focus.config import check_int, check_positive


@dataclass(frozen=True)
class DataConfig:
    """The ``data:`` section of a recipe.

    Attributes:
        sources: corpora; each is a token-file prefix (``PREFIX.idx`` exists), ``demo[:N]``,
            ``pystdlib[:N]`` (the Python standard library's sources), a local
            file/glob/directory, or a hub name; non-prefixes are tokenised once into
            ``cache_dir``.
        weights: blend weights, one per source (``None``: proportional to size).
        tokenizer: a SentencePiece ``.model``; ``None`` trains one on the first source
            (Llama-style options) into ``cache_dir``.
        vocab_size: size of a tokenizer trained here.
        seq_length: tokens per training sample.
        split: train/valid/test split of each source's documents, e.g. ``"98,2,0"``.
        cache_dir: where token files, tokenizers and Megatron's index caches go.
        workers: tokenisation processes.
        demo_pairs: key-value pairs each demo document defines and recalls.
        demo_values: value words (of 64) the demo documents draw from.
        demo_filler_sentences: filler between definitions and recalls in the demo corpus.
        document_mask: packed documents never see each other: attention (every backend, under
            context parallelism too) stays inside the document, which ends with its EOD token.
        reset_position_ids: RoPE positions restart at 0 at every document start.
        eod_mask_loss: no loss on predictions made *from* an EOD token (the next document's
            first token, which the previous document cannot know).
        min_document_tokens: documents shorter than this (tokens, EOD included) are left out
            of training samples (0: keep all).
        long_document_tokens, long_document_repeat: documents of at least
            ``long_document_tokens`` tokens appear ``long_document_repeat`` times per epoch
            (up-sampling, so that a long-context recipe holds long documents at all).
    """

    sources: list[str] = field(default_factory=lambda: ["demo:2000"])
    weights: list[float] | None = None
    tokenizer: str | None = None
    vocab_size: int = 1024
    seq_length: int = 512
    split: str = "98,2,0"
    cache_dir: str = "data/cache"
    workers: int = 1
    demo_pairs: int = 4
    demo_values: int = 64
    demo_filler_sentences: int = 16
    document_mask: bool = False
    reset_position_ids: bool = False
    eod_mask_loss: bool = False
    min_document_tokens: int = 0
    long_document_tokens: int = 0
    long_document_repeat: int = 1

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("data.sources must list at least one corpus")
        if self.weights is not None:
            if len(self.weights) != len(self.sources):
                raise ValueError(
                    f"data.weights has {len(self.weights)} entries for "
                    f"{len(self.sources)} data.sources"
                )
            for w in self.weights:
                check_positive("data.weights[]", w)
        for name in ("vocab_size", "seq_length", "workers", "demo_pairs", "demo_filler_sentences"):
            check_int(f"data.{name}", getattr(self, name), low=1)
        for name in ("min_document_tokens", "long_document_tokens"):
            check_int(f"data.{name}", getattr(self, name), low=0)
        check_int("data.long_document_repeat", self.long_document_repeat, low=1)
        if self.long_document_repeat > 1 and not self.long_document_tokens:
            raise ValueError(
                f"data.long_document_repeat is {self.long_document_repeat} but "
                "data.long_document_tokens is 0; set data.long_document_tokens to the length "
                "from which documents are up-sampled"
            )
        parts = self.split.split(",")
        if len(parts) != 3 or not all(p.strip().replace(".", "", 1).isdigit() for p in parts):
            raise ValueError(f"data.split must be three numbers like '98,2,0', got {self.split!r}")
        if not self.demo_pairs <= self.demo_values <= len(VALUES):
            raise ValueError(
                f"data.demo_pairs ({self.demo_pairs}) <= data.demo_values "
                f"({self.demo_values}) <= {len(VALUES)} must hold"
            )

    @property
    def demo_spec(self) -> DemoSpec:
        """The shape of ``demo`` sources' documents."""
        return DemoSpec(self.demo_pairs, self.demo_values, self.demo_filler_sentences)


def _slug(source: str) -> str:
    name = "".join(c if c.isalnum() else "_" for c in Path(source).name)[:40]
    return f"{name}-{hashlib.sha256(source.encode()).hexdigest()[:10]}"


def _source_slug(source: str, seed: int, spec: DemoSpec) -> str:
    if is_demo_source(source):  # the demo also depends on seed and spec
        return _slug(f"{source}-seed{seed}-{spec.pairs}x{spec.values}x{spec.filler_sentences}")
    if is_stdlib_source(source):
        return _slug(stdlib_cache_key(source))
    return _slug(source)


def tokenizer_path_for(config: DataConfig, seed: int = 0) -> Path:
    """The tokenizer a run uses: ``data.tokenizer``, or the one trained into ``cache_dir``."""
    if config.tokenizer is not None:
        return Path(config.tokenizer)
    name = (
        f"tokenizer-{_source_slug(config.sources[0], seed, config.demo_spec)}-{config.vocab_size}"
    )
    return Path(config.cache_dir) / f"{name}.model"


def prepare_data(config: DataConfig, seed: int = 0) -> tuple[Path, list[str]]:
    """Make sure a tokenizer and token files exist; returns ``(tokenizer_path, prefixes)``.

    Idempotent: existing tokenizers and token files in ``cache_dir`` are reused. Run it on one
    process per machine (the trainer does it on rank 0 behind a barrier).
    """
    cache = Path(config.cache_dir)
    spec = config.demo_spec

    def texts(source: str) -> list[str]:
        return load_texts(source, seed=seed, demo_spec=spec)["text"]

    tokenizer_path = tokenizer_path_for(config, seed)
    if config.tokenizer is not None:
        Tokenizer(tokenizer_path)  # fails early, naming the missing file
    else:
        if not tokenizer_path.is_file():
            train_tokenizer(
                texts(config.sources[0]), tokenizer_path.with_suffix(""), config.vocab_size
            )
    prefixes = []
    tokenizer = Tokenizer(tokenizer_path)
    for source in config.sources:
        if Path(f"{source}.idx").is_file():
            check_tokenizer(source, tokenizer)
            prefixes.append(source)
            continue
        prefix = cache / f"{_source_slug(source, seed, spec)}-{tokenizer_path.stem}"
        if not Path(f"{prefix}.idx").is_file():
            documents = texts(source)
            tokenize_to_indexed(
                documents, tokenizer_path, prefix, workers=config.workers, total=len(documents)
            )
        prefixes.append(str(prefix))
    return tokenizer_path, prefixes


def build_datasets(
    config: DataConfig,
    tokenizer: Tokenizer,
    prefixes: list[str],
    train_samples: int,
    valid_samples: int,
    seed: int = 0,
):
    """Megatron ``GPTDataset`` train/valid splits (blended when several sources)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    blend = (prefixes, None if config.weights is None else list(config.weights))
    dataset_config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=config.seq_length,
        blend=blend,
        split=config.split,
        path_to_cache=os.path.join(config.cache_dir, "index-cache"),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, valid_samples, 0], lambda: True, dataset_config
    ).build()
    return train, valid


class ResumableSampler:
    """Micro-batches of sample indices for one data-parallel rank, resumable exactly.

    The global stream is ``consumed, consumed + 1, ...``; each global micro-step takes
    ``micro_batch_size * dp_size`` samples and rank ``r`` gets its contiguous slice. After
    ``n`` micro-steps ``consumed`` grows by ``n * micro_batch_size * dp_size`` on every rank, so
    restarting with that count continues the same stream.
    """

    def __init__(
        self, total: int, consumed: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1
    ) -> None:
        self.total, self.consumed = total, consumed
        self.micro, self.rank, self.size = micro_batch_size, dp_rank, dp_size

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro * self.size
        start = self.consumed
        while start + step <= self.total:
            first = start + self.rank * self.micro
            yield list(range(first, first + self.micro))
            start += step

    def __len__(self) -> int:
        return max(0, (self.total - self.consumed) // (self.micro * self.size))
