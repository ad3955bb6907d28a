"""Long-range recall on held-out demo documents: what Focus reaches and a window cannot.

Each demo document defines key-value pairs and recalls them later
(:mod:`focus_pretrain.data.demo_corpus`). A recalled value is predictable only from its
definition, which the recipes put beyond the local window; a sliding-window model can do no
better than the prior over the value words (``ln data.demo_values`` nats). This module builds a
batch of held-out documents (another seed of the generator, so never seen in training) that
start at position 0, marks the label positions that are recalled values (and keys), and
measures the model's loss and argmax accuracy there, next to its loss on every other token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from focus_pretrain.data.demo_corpus import DemoSpec, demo_document
from focus_pretrain.data.tokenizer import Tokenizer
from focus_pretrain.errors import InputError
from focus_pretrain.train.scoring import Packing, masked_means, token_scores

HELD_OUT_SEED_OFFSET = 1_000_003  # demo documents of seed + offset are never trained on
_RECALL = re.compile(r"recall: the code of (\w+) is (\w+)\.")


@dataclass(frozen=True)
class RecallBatch:
    """Held-out documents and where their recalled values and keys are.

    Attributes:
        tokens, labels: ``[n, s]`` int64; ``labels[:, p] = tokens[:, p + 1]`` of the document
            (each row starts with the end-of-document id, as after a previous document).
        value_mask: ``[n, s]`` bool: label positions whose target is (part of) a recalled
            value.
        key_mask: ``[n, s]`` bool: label positions whose target is part of a recalled key.
        valid_mask: ``[n, s]`` bool: label positions inside the document (not padding).
    """

    tokens: Tensor
    labels: Tensor
    value_mask: Tensor
    key_mask: Tensor
    valid_mask: Tensor


def recall_batch(
    tokenizer: Tokenizer,
    seq_length: int,
    count: int,
    seed: int = 0,
    spec: DemoSpec | None = None,
) -> RecallBatch:
    """``count`` held-out demo documents, each truncated to ``seq_length`` labels.

    Raises:
        ValueError: when no recalled value fits inside ``seq_length`` (the documents' recalls
            lie further out: raise ``seq_length`` or lower ``data.demo_filler_sentences``).
    """
    rows, recall_rows, key_rows, valid_rows = [], [], [], []
    for index in range(count):
        text = demo_document(index, seed + HELD_OUT_SEED_OFFSET, spec)
        recalls = list(_RECALL.finditer(text))
        pieces = tokenizer.encode_with_offsets(text)  # [(id, begin, end)]

        def inside(spans, piece) -> bool:
            _, begin, end = piece
            return end > begin and any(a <= begin and end <= b for a, b in spans)

        # a key piece may start with the space before the key ("▁kal"): widen its span by one
        key_spans = [(m.start(1) - 1, m.end(1)) for m in recalls]
        value_spans = [(m.start(2) - 1, m.end(2)) for m in recalls]
        ids = [tokenizer.eod] + [p[0] for p in pieces] + [tokenizer.eod]
        values = [False] + [inside(value_spans, p) for p in pieces] + [False]
        keys = [False] + [inside(key_spans, p) for p in pieces] + [False]
        ids, values, keys = ids[: seq_length + 1], values[: seq_length + 1], keys[: seq_length + 1]
        valid = len(ids) - 1
        pad = seq_length + 1 - len(ids)
        rows.append(ids + [tokenizer.eod] * pad)  # padding is masked out below
        recall_rows.append(values[1:] + [False] * pad)
        key_rows.append(keys[1:] + [False] * pad)
        valid_rows.append([True] * valid + [False] * pad)
    ids = torch.tensor(rows, dtype=torch.long)  # [n, s + 1]
    value_mask = torch.tensor(recall_rows, dtype=torch.bool)  # [n, s]
    if not value_mask.any():
        raise InputError(
            f"no recalled value of the demo documents fits in {seq_length} tokens; raise "
            "data.seq_length, lower data.demo_filler_sentences or set train.recall_docs=0"
        )
    return RecallBatch(
        tokens=ids[:, :-1].contiguous(),
        labels=ids[:, 1:].contiguous(),
        value_mask=value_mask,
        key_mask=torch.tensor(key_rows, dtype=torch.bool),
        valid_mask=torch.tensor(valid_rows, dtype=torch.bool),
    )


def recall_metrics(
    model,
    batch: RecallBatch,
    micro_batch_size: int,
    device,
    cp_group=None,
    packing: Packing | None = None,
) -> dict[str, float]:
    """Loss and accuracy of ``model`` (a Megatron ``GPTModel`` or a DeepSpeed engine around
    one, in the mode it is in) on the recall lines' query tokens (key and value pieces), each
    part alone, and on all other tokens.

    Every tensor-parallel and data-parallel rank evaluates the whole batch (it is small), so
    the result is the same on every rank. ``packing``: score as the run packs documents.

    Returns:
        ``{"recall_loss", "recall_acc", "key_loss", "value_loss", "other_loss",
        "recall_tokens"}`` (``recall_*``: keys and values together).
    """
    extra = {} if packing is None else packing.fields(batch.tokens)
    loss, hits = token_scores(
        model, batch.tokens, batch.labels, micro_batch_size, device, cp_group, **extra
    )  # [n, s] each
    means = masked_means(
        loss,
        hits,
        {
            "recall": batch.key_mask | batch.value_mask,
            "key": batch.key_mask,
            "value": batch.value_mask,
            "other": batch.valid_mask & ~(batch.key_mask | batch.value_mask),
        },
    )
    return {
        "recall_loss": means["recall"]["loss"],
        "recall_acc": means["recall"]["acc"],
        "key_loss": means["key"]["loss"],
        "value_loss": means["value"]["loss"],
        "other_loss": means["other"]["loss"],
        "recall_tokens": means["recall"]["tokens"],
    }
