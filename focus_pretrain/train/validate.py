"""Validation on its own cadence: held-out loss and perplexity, and the long-range recall
metric on held-out demo documents (demo corpus only)."""

from __future__ import annotations

import math
import warnings

import torch
from tqdm import tqdm

from focus_pretrain.config import Config
from focus_pretrain.data.datasets import ResumableSampler
from focus_pretrain.data.demo_corpus import is_demo_source
from focus_pretrain.data.tokenizer import Tokenizer
from focus_pretrain.parallel.launch import ParallelLayout
from focus_pretrain.train.loss import batch_to, group_mean, micro_batch_loss
from focus_pretrain.train.recall import RecallBatch, recall_batch, recall_metrics

RECALL_KEYS = ("recall_loss", "recall_acc", "value_loss")  # logged at each validation


class Validator:
    """Evaluates the model every ``train.eval_interval`` steps (and at the last step).

    Args:
        config: the recipe (``train.eval_interval``, ``eval_iters``, ``micro_batch_size``,
            ``recall_docs``; ``data`` for the recall documents).
        valid_set: the validation split (each data-parallel rank reads its own slice).
        tokenizer: the run's tokenizer (to build the recall documents).
        layout: the run's parallel layout.
        device: where batches go.

    Attributes:
        last_loss: the most recent validation loss, or ``None``.
        last_recall: the most recent recall scores (:func:`recall_metrics`), or ``None``.
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
        self.last_loss: float | None = None
        self.last_recall: dict[str, float] | None = None
        self.recall: RecallBatch | None = None
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
        """Whether step ``step`` validates."""
        return bool(self.interval) and (step % self.interval == 0 or step == self.steps)

    @torch.no_grad()
    def run(self, model) -> dict[str, float]:
        """Validate ``model`` (the model's inference mode; training mode restored after):
        ``loss``, ``ppl`` and, on the demo corpus, the recall scores of :data:`RECALL_KEYS`."""
        model.eval()
        try:
            self.last_loss = self.loss(model)
            scalars = {"loss": self.last_loss, "ppl": math.exp(min(self.last_loss, 50))}
            if self.recall is not None:
                self.last_recall = recall_metrics(
                    model,
                    self.recall,
                    self.micro_batch_size,
                    self.device,
                    self.layout.context_parallel_group,
                )
                scalars.update({k: self.last_recall[k] for k in RECALL_KEYS})
        finally:
            model.train()
        return scalars

    def loss(self, model) -> float:
        """Mean loss over ``eval_iters`` micro-batches per data-parallel rank, averaged over
        the data-parallel ranks."""
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
        losses = []
        for i, batch in enumerate(batches):
            if i == self.iters:
                break
            batch = batch_to(batch, self.device)
            losses.append(micro_batch_loss(model, batch, layout.context_parallel_group)[1])
        return group_mean(torch.stack(losses).mean(), layout.data_parallel_group)
