"""Training data: the ``data:`` section, preparing token files, Megatron's ``GPTDataset`` splits
and blends, and a sampler that resumes exactly from a consumed-sample count.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from focus_pretrain.data.copies import copy_room_refusal
from focus_pretrain.data.corpus import resolve_inputs
from focus_pretrain.data.demo_corpus import VALUES, DemoSpec, is_demo_source
from focus_pretrain.data.manifest import find_manifest, manifest_shards
from focus_pretrain.data.preprocess import (
    check_tokenizer,
    load_texts,
    say_phase,
    tokenize_to_indexed,
)
from focus_pretrain.data.stdlib_corpus import is_stdlib_source, stdlib_cache_key
from focus_pretrain.data.tokenizer import Tokenizer, check_add_bos, train_tokenizer
from focus_pretrain.errors import InputError
from focus_pretrain.validation import check_int, check_positive


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
        add_bos: what each document begins with when it is tokenised: ``auto`` (what the
            tokenizer's own encoding puts first: an HF tokenizer's BOS when it adds one, as
            Gemma's and Llama 3's do; nothing for a SentencePiece model), ``true`` (its BOS
            id) or ``false`` (nothing). Token files made elsewhere are taken as they are under
            ``auto`` and checked against the prefix they record otherwise.
        bos_every_sample: every training and validation sample (a window of ``seq_length``
            tokens, which mostly begins inside a document) begins with that prefix too, as
            lm-eval's rolling windows begin with the BOS: what a model that was always shown
            its BOS first (Gemma) needs; nothing changes when the prefix is empty.
        seq_length: tokens per training sample.
        split: train/valid/test split of each source's documents, e.g. ``"98,2,0"``.
        cache_dir: where token files, tokenizers and Megatron's index caches go.
        workers: tokenisation processes.
        tokenize_in_job: let a training job tokenise raw corpora (local files, hub names) on
            rank 0; without it only ``demo`` and ``pystdlib`` are tokenised in the job, and a
            raw corpus is refused with the ``focus-pretrain preprocess`` command to run first.
        prepare_timeout_s: how long the other ranks wait for rank 0 to prepare the data
            before every rank fails with a clear error (instead of a process-group timeout).
        demo_pairs: key-value pairs each demo document defines and recalls.
        demo_values: value words (of 64) the demo documents draw from.
        demo_filler_sentences: filler between definitions and recalls in the demo corpus.
        document_mask: packed documents never see each other: attention (every backend, under
            context parallelism too) stays inside the document, which ends with its EOD token.
        reset_position_ids: RoPE positions restart at 0 at every document start.
        eod_mask_loss: no loss on predictions made *from* an EOD token (the next document's
            first token, which the previous document cannot know).
        min_document_tokens: documents shorter than this (tokens, EOD included) are left out
            of training samples (0: keep all; validation keeps every document).
        long_document_tokens, long_document_repeat: documents of at least
            ``long_document_tokens`` tokens appear ``long_document_repeat`` times per epoch
            (up-sampling, so that a long-context recipe holds long documents at all).
        copy_spans, copy_span_tokens, copy_min_distance: long-range copies in the training
            samples (validation keeps the text as it is): each training sample ends with
            ``copy_spans`` spans of ``copy_span_tokens`` tokens, each a copy of a span of the
            sample's own text that ends at least ``copy_min_distance`` tokens before the copy
            begins (0: any earlier span; beyond ``model.focus.window``: every source out of
            the window). Predicting a copy needs attention to its source far back, as a
            needle test's answer does (:func:`~focus_pretrain.data.copies.long_range_copies`;
            in E7, docs/experiments.md, it did not change what a retrofit's routers keep).
            0 spans: off.
    """

    sources: list[str] = field(default_factory=lambda: ["demo:2000"])
    weights: list[float] | None = None
    tokenizer: str | None = None
    vocab_size: int = 1024
    add_bos: bool | str = "auto"
    bos_every_sample: bool = False
    seq_length: int = 512
    split: str = "98,2,0"
    cache_dir: str = "data/cache"
    workers: int = 1
    tokenize_in_job: bool = False
    prepare_timeout_s: float = 1800.0
    demo_pairs: int = 4
    demo_values: int = 64
    demo_filler_sentences: int = 16
    document_mask: bool = False
    reset_position_ids: bool = False
    eod_mask_loss: bool = False
    min_document_tokens: int = 0
    long_document_tokens: int = 0
    long_document_repeat: int = 1
    copy_spans: int = 0
    copy_span_tokens: int = 32
    copy_min_distance: int = 0

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError(
                "data.sources must list at least one corpus: local .jsonl/.parquet/.txt files or "
                "directories, tokenised shards, a hub dataset name, or demo:N"
            )
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
        if self.long_document_tokens and self.long_document_repeat == 1:
            raise ValueError(
                f"data.long_document_tokens is {self.long_document_tokens} but "
                "data.long_document_repeat is 1 (no up-sampling); set "
                "data.long_document_repeat > 1, or data.long_document_tokens to 0"
            )
        if self.long_document_repeat > 1 and not self.long_document_tokens:
            raise ValueError(
                f"data.long_document_repeat is {self.long_document_repeat} but "
                "data.long_document_tokens is 0; set data.long_document_tokens to the length "
                "from which documents are up-sampled"
            )
        self._check_copies()
        parts = self.split.split(",")
        if len(parts) != 3 or not all(p.strip().replace(".", "", 1).isdigit() for p in parts):
            raise ValueError(f"data.split must be three numbers like '98,2,0', got {self.split!r}")
        if not self.demo_pairs <= self.demo_values <= len(VALUES):
            raise ValueError(
                f"data.demo_pairs ({self.demo_pairs}) <= data.demo_values "
                f"({self.demo_values}) <= {len(VALUES)} must hold"
            )
        check_positive("data.prepare_timeout_s", self.prepare_timeout_s)
        check_add_bos(self.add_bos)

    def _check_copies(self) -> None:
        """Refuse copy settings that leave no room for a copy and its source, or that
        document masking would make unlearnable."""
        for name in ("copy_spans", "copy_min_distance"):
            check_int(f"data.{name}", getattr(self, name), low=0)
        check_int("data.copy_span_tokens", self.copy_span_tokens, low=1)
        if not self.copy_spans:
            return
        refusal = copy_room_refusal(
            self.seq_length, self.copy_spans, self.copy_span_tokens, self.copy_min_distance
        )  # the sample's first token is never copied; a longer prefix: checked by the dataset
        if refusal:
            raise ValueError(refusal)
        if self.document_mask or self.reset_position_ids:
            raise ValueError(
                "data.copy_spans with data.document_mask or data.reset_position_ids: a copy's "
                "source may lie in an earlier packed document, which the mask hides from it "
                "and whose positions restart; set both to false, or data.copy_spans=0"
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


def _is_tokenised(source: str) -> bool:
    """Token files already: a shard directory (or its manifest) or a ``PREFIX`` with ``.idx``."""
    return find_manifest(source) is not None or Path(f"{source}.idx").is_file()


def _raw_sources(config: DataConfig) -> list[str]:
    """Sources a job would have to tokenise itself (neither built-in nor token files); a
    missing file or an empty glob raises ``FileNotFoundError`` naming it."""
    raw = []
    for source in config.sources:
        if is_demo_source(source) or is_stdlib_source(source) or _is_tokenised(source):
            continue
        resolve_inputs([source])  # names a missing file
        raw.append(source)
    return raw


def _refuse_raw_sources(config: DataConfig, raw: list[str], tokenizer: Path | None) -> None:
    """Raise :class:`InputError` (a ``ValueError``) with the ``focus-pretrain preprocess``
    commands that tokenise the raw sources offline, and the ``data.sources`` to train on
    afterwards."""
    outputs = {s: str(Path(config.cache_dir) / "shards" / _slug(s)) for s in raw}
    commands = []
    for source in raw:
        if tokenizer is not None:
            using = f"--tokenizer {shlex.quote(str(tokenizer))}"
        elif source == raw[0]:
            using = f"--train-tokenizer --vocab-size {config.vocab_size}"
        else:
            using = f"--tokenizer {shlex.quote(outputs[raw[0]])}/tokenizer.model"
        if config.add_bos != "auto":
            using += f" --add-bos {str(config.add_bos).lower()}"
        commands.append(
            f"  focus-pretrain preprocess --input {shlex.quote(source)} "
            f"--output {shlex.quote(outputs[source])} {using} --workers $(nproc)"
        )
    sources = json.dumps([outputs.get(s, s) for s in config.sources])
    then = f"--set 'data.sources={sources}'"
    if tokenizer is None:
        then += f" --set data.tokenizer={outputs[raw[0]]}/tokenizer.model"
    raise InputError(
        f"data.sources {', '.join(raw)}: a raw corpus; a training job tokenises only the "
        "built-in corpora (demo, pystdlib), since tokenising a large corpus on rank 0 would "
        "keep the other ranks waiting. Tokenise it once, offline and in parallel:\n"
        + "\n".join(commands)
        + f"\nthen train on the shards: {then}; or set data.tokenize_in_job=true to tokenise "
        "it inside the job (small corpora only)"
    )


def prepare_data(
    config: DataConfig, seed: int = 0, *, in_job: bool = False
) -> tuple[Path, list[str]]:
    """Make sure a tokenizer and token files exist; returns ``(tokenizer_path, prefixes)``.

    A source naming a directory written by ``focus-pretrain preprocess --output`` (or its
    ``manifest.json``) becomes its shards' prefixes, checked against the tokenizer;
    :func:`blend_weights` gives the blend weights that keep it one corpus. Idempotent: existing
    tokenizers and token files in ``cache_dir`` are reused. Run it on one process (a job runs it
    through :func:`~focus_pretrain.data.coordinate.prepare_data_in_job`: rank 0 first, the
    others wait with a timeout).

    Args:
        in_job: called by a training or evaluation job: raw corpora (local files, hub names)
            are refused unless ``data.tokenize_in_job``, with the commands that tokenise them.

    Raises:
        ValueError: a raw corpus in a job, token files of another tokenizer, or
            ``data.tokenizer: null`` with already tokenised ``data.sources[0]``.
    """
    cache = Path(config.cache_dir)
    spec = config.demo_spec
    raw = _raw_sources(config) if in_job and not config.tokenize_in_job else []

    def texts(source: str) -> list[str]:
        documents = load_texts(source, seed=seed, demo_spec=spec)["text"]
        if not any(isinstance(text, str) and text.strip() for text in documents):  # no text
            raise InputError(
                f"{source} holds no text (an empty input): remove it from data.sources, or "
                "give a corpus with some text"
            )
        return documents

    tokenizer_path = tokenizer_path_for(config, seed)
    if config.tokenizer is not None:
        Tokenizer(tokenizer_path).document_prefix(config.add_bos)  # a missing file, no BOS
    elif _is_tokenised(config.sources[0]):
        raise InputError(
            f"data.tokenizer is null, so a tokenizer would be trained on data.sources[0], but "
            f"{config.sources[0]} is token files; set data.tokenizer to the tokenizer that made "
            "them (a directory's manifest.json names it)"
        )
    elif not tokenizer_path.is_file() and config.sources[0] not in raw:
        say_phase(
            f"data: training a SentencePiece tokenizer ({config.vocab_size:,} pieces) on "
            f"{config.sources[0]} -> {tokenizer_path}"
        )
        train_tokenizer(texts(config.sources[0]), tokenizer_path.with_suffix(""), config.vocab_size)
    if raw:  # the recipe's tokenizer (a file or an HF directory), else one trained earlier
        known = config.tokenizer is not None or tokenizer_path.is_file()
        _refuse_raw_sources(config, raw, tokenizer_path if known else None)
    prefixes = []
    tokenizer = Tokenizer(tokenizer_path)
    for source in config.sources:
        manifest = find_manifest(source)
        if manifest is not None:
            shards = manifest_shards(manifest, tokenizer, config.add_bos)
            prefixes += [prefix for prefix, _ in shards]
            continue
        if Path(f"{source}.idx").is_file():
            check_tokenizer(source, tokenizer, config.add_bos)
            prefixes.append(source)
            continue
        name = f"{_source_slug(source, seed, spec)}-{tokenizer_path.stem}"
        document_prefix = tokenizer.document_prefix(config.add_bos)
        if document_prefix:  # documents that begin with BOS (or more) are other token files
            name += "-prefix" + "_".join(map(str, document_prefix))
        prefix = cache / name
        if not Path(f"{prefix}.idx").is_file():
            say_phase(f"data: tokenising {source} into {prefix}.bin/.idx (kept for the next runs)")
            documents = texts(source)
            tokenize_to_indexed(
                documents, tokenizer_path, prefix, workers=config.workers,
                total=len(documents), label=source, add_bos=config.add_bos,
            )  # fmt: skip
        prefixes.append(str(prefix))
    return tokenizer_path, prefixes


def blend_weights(config: DataConfig, prefixes: list[str]) -> list[float] | None:
    """Megatron blend weights for :func:`prepare_data`'s ``prefixes`` that keep each sharded
    source one corpus.

    ``None`` (Megatron's blend by size) when no source is sharded and ``data.weights`` is
    ``None``, or for a single prefix. Otherwise one weight per prefix: each source's weight
    (``data.weights[i]``, or its token count when ``data.weights`` is ``None``) split over its
    shards in proportion to their token counts. (Megatron's blend by size builds at most one
    epoch of a blend; weights let a sharded corpus repeat like one big dataset.)

    Raises:
        ValueError: ``prefixes`` are not what ``prepare_data(config)`` returned.
    """
    manifests = [find_manifest(source) for source in config.sources]
    if len(prefixes) == 1 or (config.weights is None and not any(manifests)):
        return None
    weights: list[float] = []
    for i, manifest in enumerate(manifests):
        if manifest is not None:
            tokens = [count for _, count in manifest_shards(manifest)]
        elif len(weights) < len(prefixes):
            tokens = [1 if config.weights else _token_count(prefixes[len(weights)])]
        else:
            tokens = []
        share = config.weights[i] if config.weights is not None else sum(tokens)
        weights += [share * count / max(sum(tokens), 1) for count in tokens]
    if len(weights) != len(prefixes):
        raise ValueError(
            f"{len(prefixes)} prefixes for data.sources that name {len(weights)} token files; "
            "pass the prefixes prepare_data returned for this config"
        )
    return weights


def _token_count(prefix: str) -> int:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)  # alive while its memory-mapped lengths are read
    return int(dataset.sequence_lengths.sum())


def build_datasets(
    config: DataConfig,
    tokenizer: Tokenizer,
    prefixes: list[str],
    train_samples: int,
    valid_samples: int,
    seed: int = 0,
):
    """Megatron ``GPTDataset`` train/valid splits (blended when several sources), with the
    document options of ``config`` (:class:`~focus_pretrain.data.documents.DocumentGPTDataset`)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    from focus_pretrain.data.documents import DocumentDatasetConfig, DocumentGPTDataset

    blend = (prefixes, blend_weights(config, prefixes))
    dataset_config = DocumentDatasetConfig(
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
        document_mask=config.document_mask,
        sample_prefix=tuple(tokenizer.document_prefix(config.add_bos))
        if config.bos_every_sample
        else (),
        reset_document_positions=config.reset_position_ids,
        mask_eod_loss=config.eod_mask_loss,
        min_document_tokens=config.min_document_tokens,
        long_document_tokens=config.long_document_tokens,
        long_document_repeat=config.long_document_repeat,
        copy_spans=config.copy_spans,
        copy_span_tokens=config.copy_span_tokens,
        copy_min_distance=config.copy_min_distance,
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(
        DocumentGPTDataset, [train_samples, valid_samples, 0], lambda: True, dataset_config
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
