"""Validation on its own cadence: held-out loss and perplexity, the loss by distance (beyond
the window; tokens whose evidence lies only beyond it), the retrieval probes of the
``probes:`` section, and the long-range recall metric on held-out demo documents (demo corpus
only)."""

from __future__ import annotations

import itertools
import math
import warnings
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from tqdm import tqdm

from focus_pretrain.config import Config
from focus_pretrain.data.datasets import ResumableSampler
from focus_pretrain.data.demo_corpus import is_demo_source
from focus_pretrain.data.tokenizer import Tokenizer
from focus_pretrain.parallel.launch import ParallelLayout
from focus_pretrain.train.distance import distance_masks
from focus_pretrain.train.probes import ProbeBatch, probe_batches, probe_metrics
from focus_pretrain.train.recall import RecallBatch, recall_batch, recall_metrics
from focus_pretrain.train.scoring import Packing, token_scores

RECALL_KEYS = ("recall_loss", "recall_acc", "value_loss")  # logged at each validation


def validation_samples(train, per_step: int) -> int:
    """Samples of the validation split a run builds (``train``: its ``TrainConfig``;
    ``per_step``: micro-batch x data-parallel size): ``eval_iters`` batches per validation,
    one validation per ``eval_interval`` steps plus one. Every validation reads the first
    ``eval_iters`` batches, but the split's size decides its shuffle: tools/evaluate.py builds
    it with this same count, and so reads the very batches the run validated on."""
    rounds = train.steps // train.eval_interval + 1 if train.eval_interval else 1
    return max(1, train.eval_iters * per_step * rounds)


def position_edges(window: int, seq_length: int) -> list[int]:
    """Bucket edges of the loss by position: ``0``, the window, then doubling up to the
    sequence length (``[0, 16, 32, 64, 128]`` for window 16 and length 128; 64 stands in for
    a window of 0)."""
    edges, edge = [0], window if window > 0 else 64
    while edge < seq_length:
        edges.append(edge)
        edge *= 2
    return [*edges, seq_length]


def _position_sums(
    loss: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor | None, edges: list[int]
) -> torch.Tensor:
    """``[buckets, 2]`` (loss sum, count) of the valid tokens per position bucket; positions
    are the tokens' indices, or ``positions`` (``[b, s]``, reset per document) when given."""
    if positions is None:
        positions = torch.arange(loss.shape[1]).expand_as(loss)  # [b, s]
    bucket = torch.bucketize(positions.cpu().contiguous(), torch.tensor(edges[1:-1]), right=True)
    bucket, values = bucket[valid.cpu()], loss[valid].double().cpu()  # [n_valid] each
    buckets = len(edges) - 1
    sums = torch.zeros(buckets, dtype=torch.float64).index_add_(0, bucket, values)
    counts = torch.bincount(bucket, minlength=buckets).double()
    return torch.stack([sums, counts], dim=1)


class Validator:
    """Evaluates the model every ``train.eval_interval`` steps (and at the last step).

    Args:
        config: the recipe (``train.eval_interval``, ``eval_iters``, ``micro_batch_size``,
            ``recall_docs``; ``data`` for the recall documents; ``probes``;
            ``model.focus.window`` for the loss by distance).
        valid_set: the validation split (each data-parallel rank reads its own slice).
        tokenizer: the run's tokenizer (to build the recall documents).
        layout: the run's parallel layout.
        device: where batches go.

    Attributes:
        last_loss: the most recent validation loss, or ``None``.
        last_loss_by_position: the most recent validation's loss by position in the sequence
            (its document's, when positions reset), ``{"lo-hi": loss}`` over
            :func:`position_edges`, or ``None``.
        last_recall: the most recent recall scores (:func:`recall_metrics`), or ``None``.
        last_scalars: everything the most recent validation measured, or ``None``.
    """

    def __init__(
        self,
        config: Config,
        valid_set,
        tokenizer: Tokenizer,
        layout: ParallelLayout,
        device: torch.device,
    ) -> None:
        train = config.train
        self.interval, self.iters, self.steps = train.eval_interval, train.eval_iters, train.steps
        self.micro_batch_size = train.micro_batch_size
        self.valid_set, self.layout, self.device = valid_set, layout, device
        self.window, self.eod = config.model.focus.window, tokenizer.eod
        data = config.data
        self.packing = None  # probes and recall are scored as training packs documents
        if data.document_mask or data.reset_position_ids:
            self.packing = Packing(tokenizer.eod, data.document_mask, data.reset_position_ids)
        self.last_loss: float | None = None
        self.last_recall: dict[str, float] | None = None
        self.last_scalars: dict[str, float] | None = None
        self.last_loss_by_position: dict[str, float | None] | None = None  # "lo-hi": loss
        self.seq_length = data.seq_length
        self.recall: RecallBatch | None = None
        self.probes: list[ProbeBatch] = []
        if config.probes.lengths:
            self.probes = probe_batches(tokenizer, config.probes, config.run.seed)
        demo = all(is_demo_source(s) for s in config.data.sources)
        if self.interval and train.recall_docs and demo:
            self.recall = recall_batch(
                tokenizer, config.data.seq_length, train.recall_docs, config.run.seed,
                config.data.demo_spec,
            )  # fmt: skip
        if config.model.focus.balance == "sinkhorn" and self.interval and layout.is_main:
            warnings.warn(
                "model.focus.balance=sinkhorn routes with future tokens: the validation "
                "perplexity it reports is not causal (see docs/focus-method.md)",
                stacklevel=2,
            )

    def due(self, step: int) -> bool:
        """Whether step ``step`` validates (never with ``eval_interval`` or ``eval_iters`` 0)."""
        if not (self.interval and self.iters):
            return False
        return step % self.interval == 0 or step == self.steps

    @torch.no_grad()
    def run(self, model, during_loss: AbstractContextManager | None = None) -> dict[str, float]:
        """Validate ``model`` (the model's inference mode; training mode restored after):
        ``loss``, ``ppl``, ``loss_beyond_window``, ``loss_far_evidence`` (and the share of
        tokens each covers), the probe scores (:func:`probe_metrics`) and, on the demo
        corpus, the recall scores of :data:`RECALL_KEYS`. ``during_loss`` is entered around
        the validation-split forwards only (e.g. hooks that measure the pattern there)."""
        model.eval()
        try:
            with during_loss or nullcontext():
                scalars = self.loss_by_distance(model)
            self.last_loss = scalars["loss"]
            if self.probes:
                scalars.update(
                    probe_metrics(
                        model,
                        self.probes,
                        self.window,
                        self.micro_batch_size,
                        self.device,
                        self.layout.context_parallel_group,
                        self.packing,
                    )
                )
            if self.recall is not None:
                self.last_recall = recall_metrics(
                    model,
                    self.recall,
                    self.micro_batch_size,
                    self.device,
                    self.layout.context_parallel_group,
                    self.packing,
                )
                scalars.update({k: self.last_recall[k] for k in RECALL_KEYS})
        finally:
            model.train()
        self.last_scalars = scalars
        return scalars

    def loss_by_distance(self, model) -> dict[str, float | None]:
        """Mean loss over ``eval_iters`` micro-batches per data-parallel rank (all ranks'
        tokens), and on the :func:`distance_masks` subsets (None for a subset with no token)."""
        layout = self.layout
        sampler = ResumableSampler(
            len(self.valid_set),
            0,
            self.micro_batch_size,
            layout.data_parallel_rank,
            layout.data_parallel_size,
        )
        loader = torch.utils.data.DataLoader(self.valid_set, batch_sampler=sampler)
        batches = tqdm(
            loader,
            total=min(len(sampler), self.iters),
            desc="validation",
            leave=False,
            disable=not layout.is_main,
        )
        edges = position_edges(self.window, self.seq_length)  # loss by position: buckets
        sums = torch.zeros(3 + len(edges) - 1, 2, dtype=torch.float64)  # (all, beyond, far,
        # position buckets) x (loss sum, count)
        for i, batch in enumerate(batches):
            if i == self.iters:
                break
            valid = batch["loss_mask"] > 0  # [b, s]
            labels = batch["labels"].masked_fill(~valid, self.eod)  # padding: any valid id
            loss, _ = token_scores(
                model,
                batch["tokens"],
                labels,
                self.micro_batch_size,
                self.device,
                layout.context_parallel_group,
                documents=batch.get("documents"),
                rope_positions=batch.get("rope_positions"),
            )  # [b, s]
            masks = distance_masks(batch["tokens"], labels, self.window, self.eod)
            for row, mask in enumerate((valid, masks["beyond_window"], masks["far_evidence"])):
                mask = mask & valid
                sums[row] += torch.stack([loss[mask].sum(), mask.sum().double()])
            sums[3:] += _position_sums(loss, valid, batch.get("rope_positions"), edges)
        sums = sums.to(self.device)
        dist.all_reduce(sums, group=layout.data_parallel_group)
        sums = sums.cpu()
        loss = float(sums[0, 0] / sums[0, 1].clamp(min=1))

        def mean(row: int) -> float | None:  # no token of the subset: None (strict JSON)
            return float(sums[row, 0] / sums[row, 1]) if sums[row, 1] > 0 else None

        self.last_loss_by_position = {  # an empty bucket (no valid token there): None
            f"{lo}-{hi}": mean(3 + j) for j, (lo, hi) in enumerate(itertools.pairwise(edges))
        }
        return {
            "loss": loss,
            "ppl": math.exp(min(loss, 50)),
            "loss_beyond_window": mean(1),
            "loss_far_evidence": mean(2),
            "beyond_window_share": float(sums[1, 1] / sums[0, 1].clamp(min=1)),
            "far_evidence_share": float(sums[2, 1] / sums[0, 1].clamp(min=1)),
        }

    def loss(self, model) -> float:
        """Mean validation loss (see :meth:`loss_by_distance`)."""
        return self.loss_by_distance(model)["loss"]
