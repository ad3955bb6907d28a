"""Per-token loss and argmax hits of a model on fixed sequences, and means over token masks.

The evaluation metrics (long-range recall, retrieval probes, loss by distance) all score a
model on chosen label positions; :func:`token_scores` runs the model (under tensor and context
parallelism: every replica evaluates the whole batch; context-parallel ranks each score their
shard and only the ``[b, s]`` losses and hits are gathered back, never ``[b, s, vocab]``
logits) and :func:`masked_means` reduces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from torch import Tensor

from focus_pretrain.data.documents import packing_fields
from focus_pretrain.parallel.sharding import gather_sequence, shard_batch
from focus_pretrain.train.loss import packed_documents


def _tensor_parallel() -> bool:
    return (
        parallel_state.model_parallel_is_initialized()
        and parallel_state.get_tensor_model_parallel_world_size() > 1
    )


@torch.no_grad()
def token_scores(
    model,
    tokens: Tensor,
    labels: Tensor,
    micro_batch_size: int,
    device: torch.device,
    cp_group: dist.ProcessGroup | None = None,
    *,
    documents: Tensor | None = None,
    rope_positions: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Next-token loss and argmax hits of ``model`` at every position.

    Args:
        model: a Megatron ``GPTModel`` (or a DeepSpeed engine around one, or any module with
            its call signature ``model(tokens [b, s], positions [b, s], None) -> logits
            [b, s, vocab / tp]``), in the mode it is in.
        tokens, labels: ``[n, s]`` int64 (``labels[:, p]`` is the target after ``tokens[:, p]``);
            every row starts at position 0.
        micro_batch_size: rows per forward.
        device: where the forwards run.
        cp_group: the context-parallel group (``s`` must divide into its shards), or ``None``.
        documents, rope_positions: ``[n, s]`` document starts and RoPE positions of packed
            documents (:mod:`focus_pretrain.data.documents`), or ``None``.

    Returns:
        ``(loss [n, s] float64, hits [n, s] bool)`` on the CPU.
    """
    losses, hits = [], []
    for start in range(0, tokens.shape[0], micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        x, y = tokens[rows].to(device), labels[rows].to(device)
        positions = torch.arange(x.shape[1], device=device).expand_as(x)  # [b, s]
        batch = dict(tokens=x, positions=positions, labels=y)
        for name, extra in (("documents", documents), ("rope_positions", rope_positions)):
            if extra is not None:
                batch[name] = extra[rows].to(device)  # [b, s]
        if "rope_positions" in batch:
            batch["positions"] = batch["rope_positions"]  # learned absolute positions restart
        if cp_group is not None:  # each context-parallel rank scores its shard
            batch = shard_batch(batch, cp_group)  # [b, s_loc] each
        logits = model(
            batch["tokens"], batch["positions"], None, **packed_documents(batch, x.shape[1])
        )  # [b, s_loc, vocab / tp]
        if _tensor_parallel():
            logits = gather_from_tensor_model_parallel_region(logits)  # [b, s_loc, vocab]
        logits = logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), batch["labels"], reduction="none"
        )  # [b, s_loc]
        hit = (logits.argmax(dim=-1) == batch["labels"]).to(loss.dtype)  # [b, s_loc]
        if cp_group is not None:  # only [b, s] scores cross ranks, never the logits
            loss, hit = gather_sequence(loss, 1, cp_group), gather_sequence(hit, 1, cp_group)
        losses.append(loss.double().cpu())
        hits.append(hit.cpu().bool())
    return torch.cat(losses), torch.cat(hits)


@dataclass(frozen=True)
class Packing:
    """How a run packs documents (its ``data:`` keys), to score other text the same way.

    Attributes:
        eod: the EOD token id (a document starts at position 0 and after every EOD).
        document_mask: attention stays inside documents (``data.document_mask``).
        reset_position_ids: positions restart at each document (``data.reset_position_ids``).
    """

    eod: int
    document_mask: bool
    reset_position_ids: bool

    def fields(self, tokens: Tensor) -> dict[str, Tensor]:
        """``documents``/``rope_positions`` ``[n, s]`` for :func:`token_scores` (``{}`` when
        the run packs nothing)."""
        return packing_fields(
            tokens,
            self.eod,
            document_mask=self.document_mask,
            reset_position_ids=self.reset_position_ids,
        )


def masked_means(
    loss: Tensor, hits: Tensor, masks: dict[str, Tensor]
) -> dict[str, dict[str, float]]:
    """``{name: {"loss", "acc", "tokens"}}``: mean loss and accuracy over each ``[n, s]`` bool
    mask (``nan`` where a mask is empty)."""
    out = {}
    for name, mask in masks.items():
        count = int(mask.sum())
        out[name] = {
            "loss": float(loss[mask].mean()) if count else float("nan"),
            "acc": float(hits[mask].double().mean()) if count else float("nan"),
            "tokens": count,
        }
    return out
