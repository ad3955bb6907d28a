"""Document-aware samples: where packed documents start, per-document positions, EOD loss mask,
and which documents a long-context run trains on.

Megatron's ``GPTDataset`` packs documents (each ending with the EOD token) into fixed-length
samples. Its own ``reset_position_ids``/``reset_attention_mask`` loop over the EOD tokens in
Python and build an ``s x s`` mask; here every field is a vectorised ``[s]`` tensor:

* ``documents``: each token's document start (a document starts at position 0 and after every
  EOD token; the EOD belongs to the document it ends), the attention's document structure
  (:mod:`focus_pretrain.model.packing`);
* ``position_ids`` (and ``rope_positions``): positions restarting at every document start;
* ``loss_mask``: 0 where the *input* token is EOD (the prediction of the next document's first
  token from the previous document), Megatron's ``eod_mask_loss``;
* with ``data.bos_every_sample``, every sample (a window that may begin inside a document)
  begins with the tokenizer's BOS, as lm-eval's rolling windows do (:func:`prefixed_sample`).

:class:`DocumentGPTDataset` also drops short documents and repeats long ones in the training
split (:func:`select_documents`) before Megatron builds its sample index, and ends training
samples with long-range copies (``data.copy_spans``, :mod:`focus_pretrain.data.copies`);
validation keeps its documents and samples as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import Split
from torch import Tensor

from focus_pretrain.data.copies import copy_room_refusal, long_range_copies
from focus_pretrain.errors import InputError
from focus_pretrain.focus.pattern import document_starts


def eod_document_starts(tokens: Tensor, eod: int) -> Tensor:
    """``[..., s]`` token ids -> ``[..., s]`` int64 document starts.

    Position 0 and every position right after an EOD token start a document.
    """
    after_eod = torch.zeros(tokens.shape, dtype=torch.int64, device=tokens.device)
    after_eod[..., 1:] = tokens[..., :-1] == eod
    ids = after_eod.cumsum(dim=-1)  # [..., s]: a new id after every EOD
    return document_starts(ids.reshape(-1, tokens.shape[-1])).view(tokens.shape)


def packing_fields(
    tokens: Tensor, eod: int, *, document_mask: bool, reset_position_ids: bool
) -> dict[str, Tensor]:
    """The document fields of ``tokens`` ``[..., s]`` that the flags ask for: ``documents``
    (starts) and ``rope_positions`` (restarting positions), each ``[..., s]``."""
    starts = eod_document_starts(tokens, eod)
    out = {}
    if document_mask:
        out["documents"] = starts
    if reset_position_ids:
        out["rope_positions"] = torch.arange(tokens.shape[-1], device=tokens.device) - starts
    return out


def document_fields(
    sample: dict[str, Tensor],
    eod: int,
    *,
    document_mask: bool,
    reset_position_ids: bool,
    eod_mask_loss: bool,
) -> dict[str, Tensor]:
    """``sample`` (``tokens``, ``labels``, ``loss_mask``, ``position_ids``, each ``[s]``) with
    the document fields the flags ask for (see the module docstring); a new dict."""
    tokens = sample["tokens"]
    out = dict(sample)
    fields = packing_fields(
        tokens, eod, document_mask=document_mask, reset_position_ids=reset_position_ids
    )
    out.update(fields)
    if reset_position_ids:
        out["position_ids"] = out["rope_positions"]
    if eod_mask_loss:
        out["loss_mask"] = torch.where(tokens == eod, 0.0, sample["loss_mask"].float())
    return out


def prefixed_sample(
    sample: dict[str, Tensor], prefix: Sequence[int], pad: int
) -> dict[str, Tensor]:
    """``sample`` (Megatron's ``tokens``, ``labels``, ``loss_mask``, each ``[s]``) as a window
    that begins with ``prefix`` (the tokenizer's BOS): the window's text shifts right by
    ``len(prefix)`` (its last tokens drop out), the text's first token is now predicted (from
    the prefix; weight 1 unless it is padding), the prefix's own tokens are not; a new dict.
    A sample that already begins with ``prefix`` (a document's start) is kept as it is."""
    tokens, labels = sample["tokens"], sample["labels"]
    head = torch.tensor(list(prefix), dtype=tokens.dtype)
    p, s = len(head), tokens.shape[-1]
    if p == 0 or torch.equal(tokens[:p], head):
        return dict(sample)
    text = torch.cat([tokens[:1], labels])  # [s + 1]: the window's tokens
    weights = torch.cat([(tokens[:1] != pad).float(), sample["loss_mask"].float()])  # [s + 1]
    stream = torch.cat([head, text])[: s + 1]  # [s + 1]: prefix first
    stream_weights = torch.cat([torch.zeros(p), weights])[: s + 1]  # of predicting stream[i]
    out = dict(sample)
    out.update(tokens=stream[:s], labels=stream[1:], loss_mask=stream_weights[1:])
    return out


def select_documents(
    lengths: np.ndarray,
    indices: np.ndarray,
    *,
    min_tokens: int = 0,
    long_tokens: int = 0,
    long_repeat: int = 1,
) -> np.ndarray:
    """The document indices a split trains on: ``indices`` without documents shorter than
    ``min_tokens``, and documents of at least ``long_tokens`` tokens ``long_repeat`` times.

    Args:
        lengths: ``[num_documents]`` tokens per document of the indexed dataset (EOD included).
        indices: ``[n]`` the split's document indices, in order.

    Returns:
        ``[m]`` int32 indices; order kept, a repeated document's copies follow each other
        (Megatron shuffles documents afterwards).
    """
    sizes = lengths[indices]
    keep = indices[sizes >= min_tokens]
    if long_repeat > 1 and long_tokens > 0:
        repeats = np.where(lengths[keep] >= long_tokens, long_repeat, 1)
        keep = np.repeat(keep, repeats)
    return keep.astype(np.int32)


@dataclass
class DocumentDatasetConfig(GPTDatasetConfig):
    """``GPTDatasetConfig`` plus the document options of the ``data:`` section (all part of
    Megatron's cache key, so changing one rebuilds the sample index)."""

    document_mask: bool = False
    sample_prefix: tuple[int, ...] = ()  # data.bos_every_sample: what every sample begins with
    reset_document_positions: bool = False
    mask_eod_loss: bool = False
    min_document_tokens: int = 0
    long_document_tokens: int = 0
    long_document_repeat: int = 1
    copy_spans: int = 0  # data.copy_spans: long-range copies in training samples
    copy_span_tokens: int = 32
    copy_min_distance: int = 0


class DocumentGPTDataset(GPTDataset):
    """Megatron's ``GPTDataset`` over the selected documents, with the document fields.

    Samples are dicts of ``[s]`` tensors: ``tokens``, ``labels``, ``loss_mask``,
    ``position_ids``, and ``documents``/``rope_positions`` when asked for.
    """

    def __init__(
        self,
        indexed_dataset,
        dataset_path,
        indexed_indices: np.ndarray,
        num_samples,
        index_split,
        config: DocumentDatasetConfig,
    ) -> None:
        selected = indexed_indices  # validation measures the corpus as it is
        if index_split == Split.train:
            selected = select_documents(
                indexed_dataset.sequence_lengths,
                indexed_indices,
                min_tokens=config.min_document_tokens,
                long_tokens=config.long_document_tokens,
                long_repeat=config.long_document_repeat,
            )
        if not len(indexed_indices) and num_samples:  # Megatron would loop forever
            raise InputError(
                f"the {index_split.name} split of {dataset_path} holds no document "
                f"({len(indexed_dataset.sequence_lengths)} documents, data.split="
                f"{config.split!r}) but {num_samples} samples are asked of it; give that "
                "split a larger share in data.split, or preprocess into larger shards "
                "(focus-pretrain preprocess --shard-documents)"
            )
        if len(indexed_indices) and not len(selected):
            longest = int(indexed_dataset.sequence_lengths[indexed_indices].max())
            raise InputError(
                f"data.min_document_tokens={config.min_document_tokens} leaves no document in "
                f"the {index_split.name} split of {dataset_path} (its longest document has "
                f"{longest} tokens); lower data.min_document_tokens"
            )
        self.copies = config.copy_spans if index_split == Split.train else 0
        refusal = self.copies and copy_room_refusal(
            config.sequence_length, self.copies, config.copy_span_tokens,
            config.copy_min_distance, kept=len(config.sample_prefix),
        )  # fmt: skip
        if refusal:  # the config checked a 1-token prefix; the tokenizer's may be longer
            raise InputError(refusal)
        super().__init__(indexed_dataset, dataset_path, selected, num_samples, index_split, config)

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return [
            *GPTDataset._key_config_attributes(),
            "document_mask",
            "reset_document_positions",
            "mask_eod_loss",
            "min_document_tokens",
            "long_document_tokens",
            "long_document_repeat",
        ]

    def __getitem__(self, idx) -> dict[str, Tensor]:
        config = self.config
        sample = super().__getitem__(idx)
        if config.sample_prefix:
            sample = prefixed_sample(sample, config.sample_prefix, config.tokenizer.pad)
        if self.copies:  # the same copies for a sample index in every run of a seed
            rng = np.random.default_rng((config.random_seed, 0 if idx is None else int(idx)))
            sample = long_range_copies(
                sample, self.copies, config.copy_span_tokens, config.copy_min_distance, rng,
                keep_first=len(config.sample_prefix),
            )  # fmt: skip
        return document_fields(
            sample,
            config.tokenizer.eod,
            document_mask=config.document_mask,
            reset_position_ids=config.reset_document_positions,
            eod_mask_loss=config.mask_eod_loss,
        )
